"""Fail-slow on a job nobody prepared: plain torchrun, no counters, agents started with no names.

The usual case: a job already running when someone notices it is slow. The
job is the drill's (TP=2 PP=2 DP=2, 8 ranks over 2 torchrun nodes) started
without the CCL plugin (``counters=False``: no ``rankscope run``, no counter
files), with one rank made ~1.5× slower, or healthy. Two agents are
started the plain way (no ``--machine-name``, each scoped to one node's
torchrun), and ``rankscope watch`` runs for a bounded time. Without counters
there is no step time and no late arriver: the verdict must come from the
sampled stacks (and the other detectors must not invent one on the healthy
job). One job per case, shared by the assertions on it; a slow case's watch
ends at its first confident verdict (``--until-confident``), so only the
healthy case costs the whole 45 s.

The 1.5x case used to be missed on a loaded 2-core machine: the watch's
stack rounds (py-spy dumps of every rank, 6-16 s each at load 45-65) ran
back to back and only polls renewed the agents' sampling lease, so sampling
lapsed for part of the minute. Captures now ask for sampling too. It was
missed once more in CI, where the slow rank waited as often as its peers: the
drill's fault steered its CPU burn by the steps it took, and steps made long
by the observers on a loaded machine steered the burn to nothing. The burn
now follows the steps the rank takes while it is watched (``Injector``), so
the fault stays half a step however long observers make the steps; and the
test's margins (``analyzers.stack_samples``) were set for a rank that waited
25 points less than its peers, while a 1.5x one waits 33 points less
(``1 - 1/f``) whatever their share, which left too few samples in a minute
for confidence. With 20 points the case passed every run at load 6-30.
It was missed once more in CI (2026-11-24), with no sign of why: a slow case
now has up to 150 s (it still ends at its first confident verdict, 25-40 s
here), and a miss prints every rank's sampled waits from the watch's record.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_helpers import START_TIMEOUT_S, clean_env, kill_group, make_token_file, wait_for

pytestmark = pytest.mark.drill

WATCH_S = 45  # the healthy case watches this long for a false alarm: longer than a slow case needs (25-40 s)
SLOW_WATCH_S = 150  # a slow case's bound: it ends at its first confident verdict
# case -> (fault, rank, factor). Only the subtle 1.5x: a 3x rank is named by the same sampled waits sooner
# (test_watch.py names a 3x rank with counters), and each case is a whole 8-rank job on the suite's budget.
CASES = {"slow-1.5x": ("slow-compute", 2, 1.5), "healthy": ("none", -1, 1.0)}


def start_plain_agent(folder: Path, label: str, launcher_pid: int, token_file: Path) -> tuple[subprocess.Popen[bytes], int]:
    port_file = folder / f"{label}.port"
    log = folder / f"{label}.log"
    cmd = [sys.executable, "-m", "rankscope", "agent", "--port", "0", "--port-file", str(port_file),
           "--token-file", str(token_file), "--launcher-pid", str(launcher_pid)]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=clean_env(), start_new_session=True)

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"agent {label} exited with {proc.returncode}:\n{log.read_text()}")
        return port_file.exists()

    wait_for(ready, START_TIMEOUT_S, f"agent {label} to write its port file")
    return proc, int(port_file.read_text())


@pytest.fixture(params=list(CASES))
def watched(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, Any]]:
    from rankscope.drill.faults import DrillLayout, make_plan
    from rankscope.drill.launcher import TrainingOptions
    from rankscope.drill.session import DrillConfig, DrillSession

    fault, rank, factor = CASES[request.param]
    layout = DrillLayout(tp=2, pp=2, dp=2, machines=2)
    plan = make_plan(fault, layout, rank=rank if rank >= 0 else None, step=5, factor=factor)
    config = DrillConfig(layout=layout, plan=plan, counters=False, agents=False, run_dir=tmp_path / "run",
                         training=TrainingOptions(steps=1_000_000, checkpoint_every=0, loader_workers=0))
    _, token_file = make_token_file(tmp_path)
    duration = SLOW_WATCH_S if rank >= 0 else WATCH_S
    record = tmp_path / "watch-record.json"
    agents: list[subprocess.Popen[bytes]] = []
    with DrillSession(config) as s:
        try:
            s.wait_for_steps(plan.step + 1, 300)  # the fault is on before the watch starts
            addresses = []
            for label, node in sorted(s.launcher.nodes.items()):
                proc, port = start_plain_agent(tmp_path, label, node.proc.pid, token_file)
                agents.append(proc)
                addresses.append(f"127.0.0.1:{port}")
            out = subprocess.run(
                [sys.executable, "-m", "rankscope", "watch", "--agents", ",".join(addresses), "--token-file",
                 str(token_file), "--duration", str(duration), "--json", "--record", str(record), "--tp", "2", "--pp", "2", "--dp", "2",
                 "--order", "tp-dp-pp",
                 # A shared 2-core machine can be loaded 20× over: an agent's reply may take longer than the
                 # default 5 s there, and a poll that times out is a poll without samples.
                 "--deadline", "20", "--timeout", "10",
                 # A slow case ends at its first confident verdict (the healthy one watches the whole WATCH_S).
                 *(["--until-confident"] if rank >= 0 else [])],
                capture_output=True, text=True, timeout=duration + 240, env=clean_env())
        finally:
            for proc in agents:
                kill_group(proc)
    events = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    yield {"case": request.param, "rank": rank, "events": events, "stderr": out.stderr, "code": out.returncode,
           "node": layout.machine_of(rank) if rank >= 0 else None, "duration": duration, "record": record}


def sampled_waits(record: Path) -> str:
    """Every rank's sampled waits over the whole watch, from its record: what a miss is diagnosed with."""
    from rankscope.analyzers.stack_samples import rank_waits, sampling_problems
    from rankscope.contract.bundle import read_bundle

    if not record.is_file():
        return "no record written"
    windows = {(w.rank, w.pid, w.start_wall): w for s in read_bundle(record).snapshots for w in s.all_samples()}
    waits = rank_waits(windows.values())
    return " ".join(f"{r}:{w.waiting}/{w.samples}" for r, w in sorted(waits.items())) + " " + \
        "; ".join(sampling_problems(windows.values()))


def test_watch_on_an_unprepared_job(watched: dict[str, Any]) -> None:
    events = watched["events"]
    assert events and events[-1]["event"] == "end", watched["stderr"][-2000:]
    verdicts = [e for e in events if e["event"] == "verdict"]
    assert verdicts, "no verdict line at all"
    host = socket.gethostname()
    # Machine identity: two agents on one host without --machine-name are two machines, by node rank.
    seen = {m for v in verdicts for m in v["machines"]}
    assert seen == {f"{host}-node0", f"{host}-node1"}, seen
    confident = [v for v in verdicts if v["confident"]]
    if watched["rank"] < 0:
        assert not confident, confident[0]["summary"]
        assert events[-1]["exit"] == 0 and watched["code"] == 0
        return
    answered = sum(bool(v["machines"]) for v in verdicts)
    assert confident, f"no confident verdict in {watched['duration']} s ({answered} of {len(verdicts)} lines with " \
                      f"answers); last: {verdicts[-1]['summary']}; sampled waits (rank:waiting/samples): " \
                      f"{sampled_waits(watched['record'])}"
    first = confident[0]
    assert verdicts[-1] is first, "--until-confident ends the watch at the first confident verdict"
    expected = f"{host}-node{watched['node']}"
    assert first["suspect_machines"] == [expected], first["summary"]
    sampled = [f for f in first["flags"] if f["detector"] == "samples" and f["alarmed"]]
    assert [f["ranks"] for f in sampled] == [[watched["rank"]]], first["flags"]
    assert f"rank {watched['rank']} waited" in sampled[0]["evidence"] and "PP group" in sampled[0]["evidence"]
    assert events[-1]["confident"] and events[-1]["suspect_machines"] == [expected]
    assert events[-1]["exit"] == 1 and watched["code"] == 1
    # Without counters nothing else could have named it: no step time, no CCL, no p2p waits.
    assert not {f["detector"] for v in verdicts for f in v["flags"]} & {"step_time", "ccl", "p2p_wait"}
