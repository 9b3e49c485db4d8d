"""Parked nodes (``rankscope.drill.warm``) without torch: a real supervisor and real parked interpreters.

The drill tests (test_drill_recovery, test_drill_hot_update) show parked
interpreters becoming the ranks of a real torch job; these check the node's
own contract cheaply: the go makes each parked process run the entry point as
``__main__`` with its argv, cwd and environment, discovery finds it as a
torchrun rank, the node ends as torchrun would, and bad requests are refused
with a reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from rankscope.drill import warm
from rankscope.drill.processes import kill_trees
from rankscope.probes.discovery import discover_ranks

SCRIPT = """
import json, os, sys, time
from pathlib import Path
out = Path(os.environ["OUT_DIR"])
tmp = out / f"rank{os.environ['RANK']}.tmp"
tmp.write_text(json.dumps(
    {"name": __name__, "argv": sys.argv, "cwd": os.getcwd(), "pid": os.getpid(), "rank": os.environ["RANK"],
     "pad": os.environ.get("RANKSCOPE_PARKED_ENV"), "preloaded": "fractions" in sys.modules}))
os.replace(tmp, out / f"rank{os.environ['RANK']}.json")  # whole, or not there: the test reads it at once
while not (out / "release").exists():
    time.sleep(0.02)
raise SystemExit(int(sys.argv[2]))
"""


def _start_node(sock: Path, preload: list[str]) -> subprocess.Popen[bytes]:
    """A parked node of two interpreters, once every one is ready (killed with its tree if it never gets ready)."""
    proc = subprocess.Popen(warm.node_argv(sys.executable, sock, 2, preload), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                status = warm.ask(sock, {"op": "status"})
            except warm.WarmError:
                status = {"ready": [None]}
            if None not in status["ready"]:
                return proc
            assert proc.poll() is None and time.monotonic() < deadline, "the parked node did not get ready"
            time.sleep(0.05)
    except BaseException:
        kill_trees([proc.pid])
        proc.wait(10)
        raise


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    sock = tmp_path / "n.sock"
    proc = _start_node(sock, ["fractions"])
    try:
        yield proc, sock
    finally:
        kill_trees([proc.pid])
        proc.wait(10)


def _specs(tmp_path: Path, codes: tuple[int, int]) -> list[dict[str, object]]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    return [warm.RankSpec({**warm.rank_env(rank=r, local_rank=r, world=2, local_world=2, node_rank=0, nodes=1,
                                           master_addr="127.0.0.1", master_port=29999, run_id="warm-test"),
                           "OUT_DIR": str(tmp_path)}, [str(script), "--code", str(codes[r])], module=False,
                          cwd=str(tmp_path)).to_json() for r in range(2)]


def _wait_files(paths: list[Path]) -> None:
    deadline = time.monotonic() + 60
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"no {paths}"
        time.sleep(0.05)


def test_a_go_turns_the_parked_interpreters_into_ranks_that_discovery_finds(
        node: tuple[subprocess.Popen[bytes], Path], tmp_path: Path) -> None:
    proc, sock = node
    parked = warm.ask(sock, {"op": "status"})["pids"]
    reply = warm.ask(sock, {"op": "go", "ranks": _specs(tmp_path, (0, 0))})
    assert reply["pids"] == parked and reply["warm"] == [True, True]
    _wait_files([tmp_path / "rank0.json", tmp_path / "rank1.json"])
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [s["pid"] for s in seen] == parked  # the parked processes themselves, not new ones
    assert all(s["name"] == "__main__" and s["cwd"] == str(tmp_path) and s["pad"] is None and s["preloaded"]
               for s in seen)
    assert [s["argv"] for s in seen] == [[str(tmp_path / "train.py"), "--code", "0"]] * 2
    # /proc/PID/environ shows the rank's coordinates: discovery finds them as torchrun's ranks, under the node.
    found = discover_ranks(launcher_pid=proc.pid)
    assert [(r.rank, r.pid, r.world_size, r.local_world_size, r.run_id, r.master_port) for r in found] == [
        (0, parked[0], 2, 2, "warm-test", 29999), (1, parked[1], 2, 2, "warm-test", 29999)]
    # A node goes once.
    with pytest.raises(warm.WarmError, match="already"):
        warm.ask(sock, {"op": "go", "ranks": _specs(tmp_path, (0, 0))})
    (tmp_path / "release").write_text("")
    assert proc.wait(60) == 0


def test_the_first_failing_rank_ends_the_node_with_its_status(node: tuple[subprocess.Popen[bytes], Path],
                                                              tmp_path: Path) -> None:
    proc, sock = node
    warm.ask(sock, {"op": "go", "ranks": _specs(tmp_path, (0, 3))})
    _wait_files([tmp_path / "rank0.json", tmp_path / "rank1.json"])
    (tmp_path / "release").write_text("")
    assert proc.wait(60) == 3


BAD_REQUESTS = (
    {"op": "go", "ranks": []},
    {"op": "go", "ranks": [{"env": {}, "argv": []}, {"env": {}, "argv": ["x"]}]},
    {"op": "go", "ranks": [{"env": {"A": 1}, "argv": ["x"]}, {"env": {}, "argv": ["x"]}]},
    {"op": "launch"},
)


def test_bad_requests_are_refused_with_a_reason_and_the_node_keeps_waiting(
        node: tuple[subprocess.Popen[bytes], Path]) -> None:
    proc, sock = node
    for request in BAD_REQUESTS:
        with pytest.raises(warm.WarmError) as err:
            warm.ask(sock, request)
        assert str(err.value), request
        status = warm.ask(sock, {"op": "status"})
        assert status["went"] is False and None not in status["ready"] and proc.poll() is None, request


STORE_CLIENT = """
import json, os
from datetime import timedelta
from pathlib import Path
import torch.distributed as dist
rank = os.environ["RANK"]
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                      False, timedelta(seconds=60))
store.set(f"rank{rank}", f"pid {os.getpid()}")
peer = store.get(f"rank{1 - int(rank)}").decode()
tmp = Path(os.environ["OUT_DIR"]) / f"rank{rank}.tmp"
tmp.write_text(json.dumps({"peer": peer, "agent_store": os.environ["TORCHELASTIC_USE_AGENT_STORE"]}))
os.replace(tmp, tmp.with_suffix(".json"))
"""


@pytest.mark.timeout(600)
def test_the_interpreter_that_becomes_rank_0_hosts_the_store_before_the_go_is_answered(tmp_path: Path) -> None:
    """The job's TCPStore listens before anyone is told the node went (the launcher then tells the other nodes):
    created by rank 0 in its rendezvous, a rank that asked first was refused and retried only after torch's
    back-off, 0.5-0.66 s of a restart. Every rank is its client, as under torchrun's agent."""
    import psutil
    from rankscope.drill.spawner import free_port

    sock, port = tmp_path / "n.sock", free_port()
    proc = _start_node(sock, ["torch.distributed"])
    try:
        script = tmp_path / "train.py"
        script.write_text(STORE_CLIENT)
        parked = warm.ask(sock, {"op": "status"})["pids"]
        specs = [warm.RankSpec({**warm.rank_env(rank=r, local_rank=r, world=2, local_world=2, node_rank=0, nodes=1,
                                                master_addr="127.0.0.1", master_port=port, run_id="warm-test"),
                                warm.AGENT_STORE_ENV: "True", "OUT_DIR": str(tmp_path)}, [str(script)], module=False,
                               cwd=str(tmp_path), store_port=port if r == 0 else 0).to_json() for r in range(2)]
        reply = warm.ask(sock, {"op": "go", "ranks": specs})
        assert reply["store"] is True
        # Listening already, in the interpreter that becomes rank 0: not refused.
        listening = [c for c in psutil.Process(parked[0]).net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
        assert len(listening) == 1, psutil.Process(parked[0]).net_connections(kind="tcp")
        _wait_files([tmp_path / "rank0.json", tmp_path / "rank1.json"])
        seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
        assert seen == [{"peer": f"pid {parked[1]}", "agent_store": "True"},
                        {"peer": f"pid {parked[0]}", "agent_store": "True"}]
        assert proc.wait(60) == 0
    finally:
        kill_trees([proc.pid])
        proc.wait(10)
