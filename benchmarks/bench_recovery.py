"""Recovery time on the drill: `python benchmarks/bench_recovery.py [--repeat 1]`.

Side by side, on the same small job (TP=1, PP=2, DP=2 over 4 local machines,
hang-p2p in one pipeline, checkpoints every 4 steps), the time from the
confirmed eviction to training resumed (every rank has completed a step
after the restart):

- **evict + warm standby**: ``e`` through the agents (each stops its ranks and
  blocks its machine), the drill's recovery restarts the job on the remaining
  machines plus standbys that passed their self-check while they waited;
- **stop and relaunch** (the baseline, what one does without rankscope's
  actions): stop the whole drill -- every node and agent -- and launch it
  again from the checkpoint on the surviving machines plus spare ones,
  agents included.

Both resume from the same checkpoint step. The analysis before the confirm is
not timed. ByteRobust (§6, Table 6) reports 10.87x for eviction with warm
standbys against a full requeue on a cluster, where a requeue waits for the
scheduler and for fresh pods; on one host there is no scheduler to wait for,
so the figure here shows what is left: process start-up.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from rankscope.analyzers.verdict import analyze_snapshot
from rankscope.drill.control import evict_machines
from rankscope.drill.faults import DrillLayout, make_plan
from rankscope.drill.launcher import TrainingOptions
from rankscope.drill.progress import read_progress
from rankscope.drill.session import DrillConfig, DrillSession
from rankscope.drill.worker import latest_checkpoint
from rankscope.errors import RankscopeError

LAYOUT = DrillLayout(tp=1, pp=2, dp=2, machines=4)
TRAINING = TrainingOptions(steps=40, checkpoint_every=4, micro_batches=2, loader_workers=0)
FAULT_STEP = 6


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
        resume = min(latest_checkpoint(run_dir, r) for r in range(LAYOUT.world))
        launcher.start_nodes([*survivors, *(f"spare-{i}" for i in range(len(machines)))], resume=True)
        launcher.start_agents()
        relaunched = time.monotonic()
        deadline = time.monotonic() + 300
        while not _resumed(run_dir, started_wall, resume):
            if time.monotonic() > deadline:
                raise SystemExit("the relaunched job did not resume")
            time.sleep(0.1)
        ended = time.monotonic()
        return ended - started, {"stop everything": stopped - started,
                                 "relaunch (nodes+agents up)": relaunched - stopped, "relaunched -> resumed": ended - relaunched}


def _parts(parts: dict[str, float]) -> str:
    return ", ".join(f"{name} {seconds:.2f} s" for name, seconds in parts.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=1, help="runs of each (default 1; each is a real drill)")
    args = parser.parse_args()
    ours: list[float] = []
    base: list[float] = []
    with tempfile.TemporaryDirectory(prefix="rankscope-bench-recovery-") as tmp:
        for i in range(args.repeat):  # interleaved, so load on the shared host hits both alike
            total, parts = evict_with_standby(Path(tmp) / f"evict-{i}")
            ours.append(total)
            print(f"run {i + 1}: evict+standby {total:.2f} s ({_parts(parts)})", flush=True)
            total, parts = stop_and_relaunch(Path(tmp) / f"relaunch-{i}")
            base.append(total)
            print(f"run {i + 1}: stop+relaunch {total:.2f} s ({_parts(parts)})", flush=True)
    a, b = statistics.median(ours), statistics.median(base)
    print(f"confirm -> training resumed (median of {args.repeat}, {LAYOUT.world} ranks on {LAYOUT.machines} machines):")
    print(f"  evict + warm standby : {a:7.2f} s")
    print(f"  stop + relaunch      : {b:7.2f} s")
    print(f"  ratio (relaunch / evict): {b / a:.2f}x")


if __name__ == "__main__":
    try:
        main()
    except RankscopeError as exc:
        raise SystemExit(f"bench_recovery: {exc.message}\nfix: {exc.fix}") from None
