"""Recovery time on the drill: `python benchmarks/bench_recovery.py [--repeat 1]`.

Side by side, on the same small job (TP=1, PP=2, DP=2 over 4 local machines,
checkpoints every 4 steps), the time from the confirm to training resumed
(every rank has completed a step after the restart). First an eviction
(hang-p2p in one pipeline):

- **evict + warm standby**: ``e`` through the agents (each stops its ranks and
  blocks its machine), the drill's recovery restarts the job on the remaining
  machines plus standbys that passed their self-check while they waited;
- **stop and relaunch** (the baseline, what one does without rankscope's
  actions): stop the whole drill -- every node and agent -- and launch it
  again from the checkpoint on the surviving machines plus spare ones,
  agents included.

Then a code change (no fault, the job running):

- **hot-update in place**: ``u`` to git tag ``v2`` (immediate) through the
  agents, as the TUI sends it (each switches its machine's code link and asks
  for a restart); the drill's recovery restarts the job on the same machines;
- **stop and relaunch** (the baseline): stop the whole drill, switch every
  machine's code to ``v2`` by hand (the same worktree checkout), launch it
  again from the checkpoint, agents included.

Both pairs resume from the same checkpoint step. The analysis before the
confirm is not timed. ByteRobust (§8, Fig. 12 and Table 7) reports 10.87x
for eviction with warm standbys and 11.04x for hot-update against a full
requeue on a cluster, where a requeue waits for the scheduler and for fresh
pods; on one host there is no scheduler to wait for, so the figures here
show what is left: process start-up and the agents' round trip.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from rankscope.actions.model import (
    ActionKind,
    ActionRequest,
    ActionResult,
    HotUpdateArgs,
    Targets,
    UpdateMode,
    VersionSource,
)
from rankscope.analyzers.verdict import analyze_snapshot
from rankscope.contract.errors import RankscopeError
from rankscope.drill.control import DrillMachines, Recovery, evict_machines
from rankscope.drill.faults import DrillLayout, make_plan
from rankscope.drill.launcher import Launcher, TrainingOptions
from rankscope.drill.progress import read_progress
from rankscope.drill.session import DrillConfig, DrillSession
from rankscope.drill.worker import latest_checkpoint

LAYOUT = DrillLayout(tp=1, pp=2, dp=2, machines=4)
TRAINING = TrainingOptions(steps=40, checkpoint_every=4, micro_batches=2, loader_workers=0)
FAULT_STEP = 6
# The hot-update pair runs a job that outlasts the measurement (it is stopped afterwards).
LONG_TRAINING = TrainingOptions(steps=100_000, checkpoint_every=4, micro_batches=2, loader_workers=0)
WARM_STEPS = 8  # steps done before the update is confirmed


def _config(run_dir: Path, standbys: int) -> DrillConfig:
    return DrillConfig(layout=LAYOUT, plan=make_plan("hang-p2p", LAYOUT, rank=2, step=FAULT_STEP), training=TRAINING,
                       run_dir=run_dir, stall_seconds=3.0, standbys=standbys)


def _suspects(s: DrillSession) -> tuple[str, ...]:
    s.wait_for_steps(1, 300)
    stall = s.wait_until_stalled()
    if stall.reason != "stalled":
        raise SystemExit(f"the drill did not stall: {stall}")
    top = analyze_snapshot(s.capture()).top
    if top is None:
        raise SystemExit("no suspect named")
    return top.machines


def _resumed(run_dir: Path, since_wall: float, step: int) -> bool:
    progress = read_progress(run_dir)
    return len(progress) >= LAYOUT.world and all(p.wall >= since_wall and p.step > step for p in progress.values())


def _wait_resumed(run_dir: Path, since_wall: float, step: int, what: str) -> float:
    """Block until every rank completed a step after ``step`` since ``since_wall``; the monotonic time then."""
    deadline = time.monotonic() + 300
    while not _resumed(run_dir, since_wall, step):
        if time.monotonic() > deadline:
            raise SystemExit(f"the {what} job did not resume")
        time.sleep(0.1)
    return time.monotonic()


def _relaunch(launcher: Launcher, machines: list[str] | tuple[str, ...], since_wall: float) -> tuple[float, float]:
    """Start the job again from the newest common checkpoint; (nodes+agents up, resumed), monotonic."""
    resume = min(latest_checkpoint(launcher.run_dir, r) for r in range(LAYOUT.world))
    launcher.start_nodes(machines, resume=True)
    launcher.start_agents()
    relaunched = time.monotonic()
    return relaunched, _wait_resumed(launcher.run_dir, since_wall, resume, "relaunched")


def evict_with_standby(run_dir: Path) -> tuple[float, dict[str, float]]:
    with DrillSession(_config(run_dir, standbys=2)) as s:
        machines = _suspects(s)
        s.standbys_checked(120)  # the standbys are warm: checked while they waited
        started = time.monotonic()
        results = asyncio.run(evict_machines(list(s.agents.values()), s.token(), machines, "bench: hang-p2p"))
        if not all(r.state == "succeeded" for r in results):
            raise SystemExit(f"eviction failed: {[r.message for r in results]}")
        agents_done = time.monotonic()
        event = s.wait_for_recovery(1, 300)
        if not event.ok:
            raise SystemExit(f"recovery failed: {event.message}")
        s.wait_until_resumed(event, 300)
        ended = time.monotonic()
        return ended - started, {"agents stop+block": agents_done - started,
                                 "seen -> restarted (nodes+agents up)": event.restarted_mono - event.evicted_mono,
                                 "restarted -> resumed": ended - event.restarted_mono}


def stop_and_relaunch(run_dir: Path) -> tuple[float, dict[str, float]]:
    with DrillSession(_config(run_dir, standbys=0)) as s:
        machines = _suspects(s)
        started, started_wall = time.monotonic(), time.time()
        launcher = s.launcher
        survivors = [m for m in launcher.machines() if m not in machines]
        launcher.stop()  # every node and agent
        stopped = time.monotonic()
        relaunched, ended = _relaunch(launcher, [*survivors, *(f"spare-{i}" for i in range(len(machines)))],
                                      started_wall)
        return ended - started, {"stop everything": stopped - started,
                                 "relaunch (nodes+agents up)": relaunched - stopped, "relaunched -> resumed": ended - relaunched}


def _running_job(run_dir: Path) -> Launcher:
    """The job with agents serving actions (every machine runs its code from its own link, at v1)."""
    launcher = Launcher(run_dir, LAYOUT, LONG_TRAINING, counters=False, actions=True)
    launcher.start_nodes()
    launcher.start_agents()
    deadline = time.monotonic() + 300
    while not _resumed(run_dir, 0.0, WARM_STEPS - 1):
        if time.monotonic() > deadline:
            raise SystemExit("the job did not start")
        time.sleep(0.1)
    return launcher


async def _hot_update(launcher: Launcher, version: str) -> list[ActionResult]:
    """Plan, confirm (a yes naming every machine) and run ``u`` to ``version``, as the TUI sends it."""
    from rankscope.actions.agent_protocol import confirmation_for
    from rankscope.actions.model import ActionPlan
    from rankscope.wire.client import JobClient

    request = ActionRequest(f"bench-hu-{time.time_ns()}", ActionKind.HOT_UPDATE, Targets(),
                            HotUpdateArgs(VersionSource.GIT, version, UpdateMode.IMMEDIATE), "bench")
    async with JobClient(list(launcher.addresses().values()), launcher.token(), acting=True) as client:
        plans = [p for p in (await client.plan_action(request)).values() if isinstance(p, ActionPlan)]
        return [u.event async for u in client.run_action(request, confirmation_for(plans))
                if isinstance(u.event, ActionResult)]


def hot_update_in_place(run_dir: Path) -> tuple[float, dict[str, float]]:
    launcher = _running_job(run_dir)
    recovery = Recovery(launcher, DrillMachines(launcher))
    recovery.start()
    try:
        started = time.monotonic()
        results = _check(asyncio.run(_hot_update(launcher, "v2")))
        agents_done = time.monotonic()
        event = recovery.wait(1, 300)
        if not event.ok:
            raise SystemExit(f"the restart failed: {event.message}")
        ended = _wait_resumed(run_dir, event.restart_began_wall, event.resume_step, "hot-updated")
        if len(results) != LAYOUT.machines:
            raise SystemExit(f"{len(results)} agents answered, not {LAYOUT.machines}")
        seen_wall = time.time() - (time.monotonic() - event.evicted_mono)
        stopped = event.restart_began_wall - seen_wall  # the launcher notes when the old processes were gone
        return ended - started, {"agents switch code": agents_done - started,
                                 "agents done -> seen": event.evicted_mono - agents_done,
                                 "stop old processes": stopped,
                                 "start nodes+agents": event.restarted_mono - event.evicted_mono - stopped,
                                 "restarted -> resumed": ended - event.restarted_mono}
    finally:
        recovery.stop()
        launcher.stop()


def relaunch_with_new_code(run_dir: Path) -> tuple[float, dict[str, float]]:
    from rankscope.actions.hot_update import CodeVersions

    launcher = _running_job(run_dir)
    try:
        machines = launcher.machines()
        started = time.monotonic()
        launcher.stop()  # every node and agent
        stopped, stopped_wall = time.monotonic(), time.time()
        for m in machines:  # what a person does by hand: check out the new version on every machine
            versions = CodeVersions(launcher.code_link(m), launcher.code_versions(m), launcher.code_repo)
            versions.switch(versions.checkout("v2"))
        switched = time.monotonic()
        relaunched, ended = _relaunch(launcher, machines, stopped_wall)
        return ended - started, {"stop everything": stopped - started, "check out v2": switched - stopped,
                                 "relaunch (nodes+agents up)": relaunched - switched,
                                 "relaunched -> resumed": ended - relaunched}
    finally:
        launcher.stop()


def _check(results: list[ActionResult]) -> list[ActionResult]:
    if not results or not all(r.state == "succeeded" for r in results):
        raise SystemExit(f"the hot-update failed: {[r.message for r in results]}")
    return results


def _parts(parts: dict[str, float]) -> str:
    return ", ".join(f"{name} {seconds:.2f} s" for name, seconds in parts.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=1, help="runs of each (default 1; each is a real drill)")
    parser.add_argument("--only", choices=("evict", "hot-update"), help="run one pair only")
    args = parser.parse_args()
    cases = CASES if args.only is None else CASES[:2] if args.only == "evict" else CASES[2:]
    runs: dict[str, list[float]] = {name: [] for name, _ in cases}
    with tempfile.TemporaryDirectory(prefix="rankscope-bench-recovery-") as tmp:
        for i in range(args.repeat):  # interleaved, so load on the shared host hits all alike
            for name, case in cases:
                total, parts = case(Path(tmp) / f"{name.replace(' ', '-')}-{i}")
                runs[name].append(total)
                print(f"run {i + 1}: {name} {total:.2f} s ({_parts(parts)})", flush=True)
    m = {name: statistics.median(times) for name, times in runs.items()}
    print(f"confirm -> training resumed (median of {args.repeat}, {LAYOUT.world} ranks on {LAYOUT.machines} machines):")
    for name, _ in cases:
        print(f"  {name:28s}: {m[name]:7.2f} s")
    if "evict+standby" in m:
        print(f"  ratio (relaunch / evict+standby): {m['stop+relaunch (evict)'] / m['evict+standby']:.2f}x"
              "   (ByteRobust: 10.87x against a requeue)")
    if "hot-update" in m:
        print(f"  ratio (relaunch / hot-update)   : {m['stop+relaunch (new code)'] / m['hot-update']:.2f}x"
              "   (ByteRobust: 11.04x against a requeue)")


CASES = (("evict+standby", evict_with_standby), ("stop+relaunch (evict)", stop_and_relaunch),
         ("hot-update", hot_update_in_place), ("stop+relaunch (new code)", relaunch_with_new_code))


if __name__ == "__main__":
    try:
        main()
    except RankscopeError as exc:
        raise SystemExit(f"bench_recovery: {exc.message}\nfix: {exc.fix}") from None
