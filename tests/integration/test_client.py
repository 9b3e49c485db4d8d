"""JobClient and `rankscope snapshot` against real agents: lost machines never fail the rest."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from agent_helpers import RANK_FUNCTION, Processes, clean_env, make_token_file
from rankscope.contract.bundle import loads, read_bundle
from rankscope.contract.snapshot import CaptureErrorKind, JobSnapshot, MachineSnapshot
from rankscope.wire.client import JobClient, capture_once

pytestmark = pytest.mark.timeout(180)


def by_address(snap: JobSnapshot) -> dict[str, MachineSnapshot]:
    return {m.address: m for m in snap.machines}


def parked_threads(machine: MachineSnapshot, rank: int) -> int:
    (stacks,) = [s for s in machine.stacks if s.rank == rank]
    assert stacks.main.threads is not None, stacks.main.error
    return sum(1 for t in stacks.main.threads if any(f.name == RANK_FUNCTION for f in t.frames))


async def test_an_agent_killed_during_a_capture_is_marked_and_the_rest_is_kept(procs: Processes, tmp_path: Path) -> None:
    token, token_file = make_token_file(tmp_path)
    rank_a = procs.rank(0, 2, threads=2, depth=5)
    # Machine B's rank has deep stacks in many threads, and its agent dumps one process at a
    # time: py-spy takes tenths of a second there, a real window in which B is mid-capture.
    rank_b = procs.rank(1, 2, threads=24, depth=300)
    a = procs.agent("machine-a", "--run-id", rank_a.run_id, token_file=token_file)
    b = procs.agent("machine-b", "--run-id", rank_b.run_id, "--concurrency", "1", token_file=token_file)
    agent_b = psutil.Process(b.proc.pid)

    async with JobClient([a.address, b.address], token, deadline_s=60) as client:
        capture = asyncio.create_task(client.capture(timeout_s=30))
        deadline = time.monotonic() + 60
        # Wait for the event "B is running py-spy on its rank", then kill B like a crashed machine.
        while not any(c.name() == "py-spy" for c in agent_b.children(recursive=True)):
            assert not capture.done(), "the capture ended before machine B started py-spy"
            assert time.monotonic() < deadline, "machine B never started py-spy"
            await asyncio.sleep(0.005)
        b.proc.send_signal(signal.SIGKILL)
        snap = await asyncio.wait_for(capture, 90)

    machines = by_address(snap)
    assert list(machines) == [a.address, b.address]
    lost = machines[b.address]
    assert not lost.reachable and lost.captured is None and lost.ranks == ()
    assert lost.error is not None and lost.error.kind is CaptureErrorKind.UNREACHABLE
    assert b.address in lost.error.message and "rankscope agent" in lost.error.fix
    kept = machines[a.address]
    assert kept.reachable and kept.machine == "machine-a" and kept.error is None
    assert [r.rank for r in kept.ranks] == [0] and parked_threads(kept, 0) == 2
    assert snap.rank_to_machine() == {0: "machine-a"}
    assert b.proc.wait(timeout=10) == -signal.SIGKILL


async def test_a_dead_agent_is_marked_and_comes_back_when_restarted(procs: Processes, tmp_path: Path) -> None:
    token, token_file = make_token_file(tmp_path)
    rank_a = procs.rank(0, 2)
    rank_b = procs.rank(1, 2)
    a = procs.agent("machine-a", "--run-id", rank_a.run_id, token_file=token_file)
    b = procs.agent("machine-b", "--run-id", rank_b.run_id, token_file=token_file)
    async with JobClient([a.address, b.address], token, deadline_s=30) as client:
        first = await client.describe()
        assert [m.reachable for m in first.machines] == [True, True]
        assert first.rank_to_machine() == {0: "machine-a", 1: "machine-b"}
        assert first.machines[0].stacks == () and first.world_size == 2

        b.proc.send_signal(signal.SIGKILL)
        b.proc.wait(timeout=10)
        second = await client.capture(timeout_s=20)
        lost = by_address(second)[b.address]
        assert not lost.reachable and lost.error is not None and lost.error.kind is CaptureErrorKind.UNREACHABLE
        assert lost.machine == "machine-b"  # the name it last gave, so a restart is not a new machine
        assert parked_threads(by_address(second)[a.address], 0) == 2

        # A client opened once the agent is back reaches it at its first call, though this client's channel to
        # the same address is still in its reconnect back-off (a warm restart is back within that back-off, and
        # the action that follows it opens a new client: its channels must not inherit the old one's failure).
        procs.agent("machine-b", "--run-id", rank_b.run_id, "--port", str(b.port), token_file=token_file)
        async with JobClient([b.address], token, deadline_s=30) as fresh:
            back = await fresh.describe()
            assert back.machines[0].reachable, back.machines[0].error
            assert back.rank_to_machine() == {1: "machine-b"}
        # The same client (same channels) sees machine B again once an agent listens there.
        deadline = time.monotonic() + 60
        while not (polled := await client.poll()).machines[1].reachable:
            assert time.monotonic() < deadline, polled.machines[1].error
            await asyncio.sleep(0.2)
        assert polled.rank_to_machine() == {0: "machine-a", 1: "machine-b"}
        assert polled.job_id is None  # two run ids: no common job id


async def test_a_refused_token_is_reported_as_such(procs: Processes, tmp_path: Path) -> None:
    token, token_file = make_token_file(tmp_path, "token-a")
    _other, other_file = make_token_file(tmp_path, "token-b")
    rank = procs.rank(0, 1)
    a = procs.agent("machine-a", "--run-id", rank.run_id, token_file=token_file)
    b = procs.agent("machine-b", "--run-id", rank.run_id, token_file=other_file)
    async with JobClient([a.address, b.address], token) as client:
        snap = await client.describe()
    ok, refused = snap.machines
    assert ok.reachable and [r.rank for r in ok.ranks] == [0]
    assert snap.job_id == rank.run_id
    assert not refused.reachable and refused.error is not None
    assert refused.error.kind is CaptureErrorKind.PERMISSION
    assert "refused the token" in refused.error.message and "--token-file" in refused.error.fix


async def test_an_agent_that_never_answers_is_marked_at_the_deadline() -> None:
    # A socket that accepts TCP but never speaks gRPC: the call can only end by its deadline.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        async with JobClient([address, "127.0.0.1:1"], "0123456789abcdef0123", deadline_s=1.0) as client:
            snap = await client.describe()
    silent_m, refused_m = snap.machines
    assert silent_m.error is not None and silent_m.error.kind is CaptureErrorKind.UNREACHABLE
    assert "did not answer within 1.0 s" in silent_m.error.message
    assert refused_m.error is not None and "nothing listening at 127.0.0.1:1" in refused_m.error.message


def test_capture_once_and_a_bad_address_in_the_list(procs: Processes, tmp_path: Path) -> None:
    token, token_file = make_token_file(tmp_path)
    rank = procs.rank(0, 1)
    a = procs.agent("machine-a", "--run-id", rank.run_id, token_file=token_file)
    snap = capture_once([a.address, "no-such-host.invalid:50051"], token, deadline_s=20, timeout_s=10)
    good, bad = snap.machines
    assert good.reachable and parked_threads(good, 0) == 2
    assert not bad.reachable and bad.machine == "no-such-host.invalid:50051" and bad.error is not None


def test_snapshot_command_writes_a_bundle_and_marks_the_lost_machine(procs: Processes, tmp_path: Path) -> None:
    _token, token_file = make_token_file(tmp_path)
    rank = procs.rank(0, 2)
    a = procs.agent("machine-a", "--run-id", rank.run_id, token_file=token_file)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    out = tmp_path / "bundle.json"
    cmd = [sys.executable, "-m", "rankscope", "snapshot", "--agents", f"{a.address},{dead}",
           "--token-file", str(token_file), "--deadline", "30", "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=clean_env(), check=False)
    assert proc.returncode == 1, proc.stderr  # 1: some agent did not answer; the bundle is still written
    assert "machines: 1 of 2 answered" in proc.stdout
    assert f"{dead}: nothing listening at {dead} (connection refused)" in proc.stdout and "ranks: 1 of 2 seen; missing 1" in proc.stdout
    bundle = read_bundle(out)
    snap = bundle.latest
    assert [m.reachable for m in snap.machines] == [True, False]
    assert parked_threads(snap.machines[0], 0) == 2
    assert bundle.meta["agents"] == [a.address, dead]

    # --json: the bundle on stdout, the summary on stderr
    proc = subprocess.run([*cmd[:-2], "--json"], capture_output=True, text=True, timeout=120, env=clean_env(), check=False)
    assert proc.returncode == 1
    again = loads(proc.stdout)
    assert again.latest.rank_to_machine() == {0: "machine-a"}
    assert json.loads(proc.stdout)["format"] == "rankscope.bundle"
    assert "machines: 1 of 2 answered" in proc.stderr


def test_snapshot_command_rejects_bad_agent_lists_with_a_fix(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "rankscope", "snapshot", "--agents", "node[4-1]:5"],
                          capture_output=True, text=True, timeout=60, env=clean_env(), check=False)
    assert proc.returncode == 2 and "runs backwards" in proc.stderr and "fix:" in proc.stderr
    assert "Traceback" not in proc.stderr


def _http1_server() -> tuple[socket.socket, str]:
    """A port where something listens that is no gRPC agent (an HTTP/1 server): the handshake fails."""
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.recv(1024)
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                except OSError:
                    pass

    threading.Thread(target=serve, daemon=True).start()
    return server, f"127.0.0.1:{server.getsockname()[1]}"


async def test_each_way_of_not_reaching_an_agent_has_its_own_words_in_the_client_and_the_tui_header(
        procs: Processes, tmp_path: Path) -> None:
    from rankscope.tui import digest as dg
    from rankscope.tui import state as st
    from rankscope.tui.widgets.verdict import header_text

    token, token_file = make_token_file(tmp_path, "token-a")
    _other, other_file = make_token_file(tmp_path, "token-b")
    refusing = procs.agent("machine-r", "--run-id", "no-such-run-r", token_file=other_file)
    empty = procs.agent("machine-e", "--run-id", "no-such-run-e", token_file=token_file)  # up, no ranks of its job
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{s.getsockname()[1]}"
    server, http1 = _http1_server()
    try:
        async with JobClient([refusing.address, nobody, http1, "no-such-host.invalid:50051", empty.address],
                             token, deadline_s=10.0) as client:
            snap = await client.describe()
    finally:
        server.close()
    got = {m.address: m.error.message if m.error else None for m in snap.machines}
    assert got[refusing.address] is not None and got[refusing.address].startswith(
        f"token refused: the agent at {refusing.address} refused the token")
    assert got[nobody] == f"nothing listening at {nobody} (connection refused)"
    assert got[http1] is not None and got[http1].startswith(f"handshake failed with {http1}: something listens")
    assert got["no-such-host.invalid:50051"] is not None
    assert got["no-such-host.invalid:50051"].startswith("no such host: no-such-host.invalid does not resolve")
    assert got[empty.address] is None
    fixes = {m.error.fix for m in snap.machines if m.error}
    assert len(fixes) == 4  # each its own fix

    def header_of(machines: tuple[MachineSnapshot, ...]) -> str:
        one = JobSnapshot(snap.captured, machines)
        s = st.apply_snapshot(st.AppState(), dg.digest(one), snap.captured.wall)
        return header_text(s, "agents", True).plain.splitlines()[0]

    by = by_address(snap)
    # Only that agent: the header names what happened, not "no counters" or "healthy".
    assert header_of((by[nobody],)).startswith(f"no agent answers: nothing listening at {nobody} (connection refused)")
    assert header_of((by[refusing.address],)).startswith("no agent answers: token refused:")
    assert header_of((by[http1],)).startswith(f"no agent answers: handshake failed with {http1}")
    assert header_of((by[empty.address],)).startswith(
        "no ranks running: the agents answer but have seen none of the job's ranks")
    # No phantom ranks: a capture of a job with no rank seen misses none.
    from rankscope.tui.analysis import build_stack_view

    view = build_stack_view(JobSnapshot(snap.captured, (by[empty.address],)), None)
    assert view.missing_ranks == ()


async def test_an_action_is_split_over_its_agents_in_rank_order_whatever_order_they_were_listed_in() -> None:
    # The drill listed its agents in the order they came up (machine-3 before machine-1): the phrase to type read
    # "evict machine-3 machine-1" under plans shown machine-1 first.
    from rankscope.actions.model import ActionKind, ActionRequest, EvictArgs, Targets
    from rankscope.contract.snapshot import Instant, RankInfo

    def machine(name: str, port: int, ranks: tuple[int, ...]) -> MachineSnapshot:
        return MachineSnapshot(name, f"127.0.0.1:{port}", True, Instant(1.0, 1.0),
                               ranks=tuple(RankInfo(r, r % 2, 8, 100 + r) for r in ranks))

    client = JobClient(["127.0.0.1:5003", "127.0.0.1:5001"], None)
    listed = JobSnapshot(Instant(1.0, 1.0), (machine("machine-3", 5003, (6, 7)), machine("machine-1", 5001, (2, 3))))

    async def describe(*_args: object) -> JobSnapshot:
        return listed

    client._fan_out = describe  # type: ignore[method-assign]
    request = ActionRequest("evict-x", ActionKind.EVICT, Targets(("machine-3", "machine-1")), EvictArgs("hung"), "me")
    parts, errors = await client._split(request)
    assert errors == {}
    assert [p.targets.machines for p in parts.values()] == [("machine-1",), ("machine-3",)]
