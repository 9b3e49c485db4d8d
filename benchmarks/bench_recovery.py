"""Recovery time on the drill: `python benchmarks/bench_recovery.py [--repeat 1]`.

Three paths, in one run, on the same small job (TP=1, PP=2, DP=2 over 4 local
machines, checkpoints every 4 steps), each timed from the confirm to training
resumed (every rank has completed a step after the restart):

- **cold relaunch** (the baseline, what users do today): a pipeline hangs
  (hang-p2p), the analysis names it; stop the whole drill -- every node and
  agent -- and launch it again with torchrun from the checkpoint on the
  surviving machines plus spare ones: torchrun and every rank import torch,
  meet, load (the agents start once the job is back, as on the warm paths);
- **evict + warm standby**: the same hang; ``e`` through the agents (each stops
  its ranks and blocks its machine), the drill's recovery restarts the job on
  the survivors plus standbys that passed their self-check while they waited,
  every node from its parked interpreters (``rankscope.drill.warm``: torch
  already imported);
- **hot-update in place**: no fault, ``u`` to git tag ``v2`` (immediate)
  through the agents, as the TUI sends it; the recovery restarts the job on
  the same machines from their parked interpreters, on the new code.

Each is broken down from the ranks' own phase records (``phases/``) and the
orchestrator's clocks: detect (last progress -> verdict) and plan (the agents'
plans, which the TUI shows before anyone confirms) come before the confirm
and are printed apart, not in the total; stop (confirm -> every old
process frozen and the restart begun; they end once the job has resumed),
join (-> every rank through the rendezvous; for the cold path this holds torchrun's and the ranks' imports),
load (-> every rank loaded its checkpoint), first step (-> every rank
completed a step). ByteRobust (§8, Fig. 12 and Table 7) reports 10.87x for
eviction with warm standbys and 11.04x for hot-update against a full requeue
on a cluster, where a requeue also waits for the scheduler and fresh pods.

The runs happen in a child process; at the end the benchmark reads everything
that child printed (to its exit) and the logs of every agent, and prints
"shutdown: clean" or each line of traceback or gRPC error found
(``rankscope.drill.processes.shutdown_noise``); then the same for the nodes'
logs (torchrun's and parked nodes', the ranks' own output).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from rankscope.actions.model import (
    ActionKind,
    ActionPlan,
    ActionRequest,
    ActionResult,
    EvictArgs,
    HotUpdateArgs,
    Targets,
    UpdateMode,
    VersionSource,
)
from rankscope.analyzers.analysis import analyze_snapshot
from rankscope.contract.errors import RankscopeError
from rankscope.drill.checkpoints import latest_checkpoint
from rankscope.drill.control import DrillMachines, Recovery
from rankscope.drill.faults import DrillLayout, make_plan
from rankscope.drill.launcher import NODE_LOG_SUFFIXES, Launcher, TrainingOptions
from rankscope.drill.processes import shutdown_noise
from rankscope.drill.progress import read_phases, stepped_past
from rankscope.drill.session import DrillConfig, DrillSession
from rankscope.wire.sync_loop import run_sync

LAYOUT = DrillLayout(tp=1, pp=2, dp=2, machines=4)
TRAINING = TrainingOptions(steps=40, checkpoint_every=4, micro_batches=2, loader_workers=0)
FAULT_STEP = 6
# The hot-update runs a job that outlasts the measurement (it is stopped afterwards).
LONG_TRAINING = TrainingOptions(steps=100_000, checkpoint_every=4, micro_batches=2, loader_workers=0)
WARM_STEPS = 8  # steps done before the update is confirmed
PARK_TIMEOUT_S = 600.0
PHASES = ("stop", "join", "load", "first step")  # confirm -> resumed; detect and plan come before it


@dataclass
class Run:
    """One path's figures (seconds): confirm -> resumed, and where the time went."""

    total: float = 0.0
    detect: float | None = None  # before the confirm: not in the total
    plan: float | None = None  # the agents' plans, shown before the confirm: not in the total
    parts: dict[str, float] = field(default_factory=dict)
    warm: str = ""  # how many ranks started from an interpreter that had already imported torch


def _config(run_dir: Path, standbys: int) -> DrillConfig:
    return DrillConfig(layout=LAYOUT, plan=make_plan("hang-p2p", LAYOUT, rank=2, step=FAULT_STEP), training=TRAINING,
                       run_dir=run_dir, stall_seconds=3.0, standbys=standbys)


def _suspects(s: DrillSession) -> tuple[tuple[str, ...], float]:
    """The suspect machines of the hang, and detect: seconds from the last progress to the verdict."""
    stall = s.wait_until_stalled()
    if stall.reason != "stalled":
        raise SystemExit(f"the drill did not stall: {stall}")
    last_progress = s.watcher.last_change
    top = analyze_snapshot(s.capture()).top
    if top is None:
        raise SystemExit("no suspect named")
    return top.machines, time.monotonic() - last_progress


def _wait_resumed(run_dir: Path, since_wall: float, step: int, what: str) -> float:
    """Block until every rank completed a step after ``step`` since ``since_wall``; the wall clock then."""
    deadline = time.monotonic() + 600
    while not stepped_past(run_dir, LAYOUT.world, since_wall, step):
        if time.monotonic() > deadline:
            raise SystemExit(f"the {what} job did not resume")
        time.sleep(0.05)
    return time.time()


def _breakdown(run: Run, run_dir: Path, confirm: float, began: float, resumed: float) -> Run:
    """Fill ``run`` from wall clocks: confirm, restart begun; joined/loaded/stepped from the ranks."""
    phases = read_phases(run_dir, began)
    joined = max(phases.get("joined", {}).values(), default=began)
    loaded = max(phases.get("loaded", {}).values(), default=joined)
    # When the ranks did it, not when this process looked: a drill's restart returns only once the new agents
    # are up, which may be after the job resumed.
    stepped = phases.get("stepped", {})
    if len(stepped) >= LAYOUT.world:
        resumed = max(stepped.values())
    run.total = resumed - confirm
    run.parts = {"stop": began - confirm, "join": joined - began, "load": loaded - joined,
                 "first step": resumed - loaded}
    return run


async def _act(addresses: list[str], token: str, request: ActionRequest) -> tuple[float, float, list[ActionResult]]:
    """Plan ``request``, then confirm it, as the TUI does (the plans are on screen before anyone confirms), over
    one client; (seconds the plans took, wall clock of the confirm, final results)."""
    from rankscope.actions.agent_protocol import combined_phrase, confirmation_for
    from rankscope.wire.client import JobClient

    async with JobClient(addresses, token, acting=True) as client:
        asked = time.perf_counter()
        plans = [p for p in (await client.plan_action(request)).values() if isinstance(p, ActionPlan)]
        planning = time.perf_counter() - asked
        typed = combined_phrase(request.kind, plans) if request.kind == ActionKind.EVICT else None
        confirmation = confirmation_for(plans, typed=typed or "")
        confirm = time.time()
        results = [u.event async for u in client.run_action(request, confirmation) if isinstance(u.event, ActionResult)]
    if not results or not all(r.state == "succeeded" for r in results):
        raise SystemExit(f"{request.kind.value} failed: {[r.message for r in results]}")
    return planning, confirm, results


def _warm_of(launcher: Launcher, machines: tuple[str, ...]) -> str:
    starts = launcher.warm_starts[-len(machines):]
    ranks = [w for s in starts for w in s.warm]
    return f"{sum(ranks)}/{len(ranks)} ranks warm"


def evict_with_standby(run_dir: Path) -> Run:
    with DrillSession(_config(run_dir, standbys=2)) as s:
        s.wait_for_steps(1, 600)
        slots = (*s.launcher.machines(), *s.launcher.standbys)
        if not s.launcher.wait_parked(slots, PARK_TIMEOUT_S):
            raise SystemExit("the parked nodes were not ready")
        # The standbys are warm: checked while they waited. A check still running would be redone at join,
        # in the measured path (its two processes import torch: minutes at load 80).
        if not s.standbys_checked(PARK_TIMEOUT_S):
            raise SystemExit("the standbys' self-checks did not finish")
        machines, detect = _suspects(s)
        request = ActionRequest(f"bench-evict-{time.time_ns()}", ActionKind.EVICT, Targets(machines),
                                EvictArgs("bench: hang-p2p"), "bench")
        planning, confirm, _ = run_sync(_act(list(s.agents.values()), s.token(), request))
        event = s.wait_for_recovery(1, 600)
        if not event.ok:
            raise SystemExit(f"recovery failed: {event.message}")
        began = s.launcher.last_restart[0] if s.launcher.last_restart else event.restart_began_wall
        resumed = _wait_resumed(run_dir, began, event.resume_step, "evicted")
        return _breakdown(Run(detect=detect, plan=planning, warm=_warm_of(s.launcher, event.machines)), run_dir,
                          confirm, began, resumed)


def cold_relaunch(run_dir: Path) -> Run:
    with DrillSession(_config(run_dir, standbys=0)) as s:
        s.wait_for_steps(1, 600)
        machines, detect = _suspects(s)
        confirm = time.time()
        launcher = s.launcher
        survivors = [m for m in launcher.machines() if m not in machines]
        launcher.stop()  # every node and agent
        began = time.time()
        resume = min(latest_checkpoint(run_dir, r) for r in range(LAYOUT.world))
        launcher.start_nodes([*survivors, *(f"spare-{i}" for i in range(len(machines)))], resume=True)
        # As on the warm paths (Launcher.restart), the agents start once the job is back, not beside its start.
        resumed = _wait_resumed(run_dir, began, resume, "relaunched")
        launcher.start_agents()
        return _breakdown(Run(detect=detect, warm="torchrun: 0 ranks warm"), run_dir, confirm, began, resumed)


def hot_update_in_place(run_dir: Path) -> Run:
    launcher = Launcher(run_dir, LAYOUT, LONG_TRAINING, counters=False, actions=True, warm=True)
    recovery = Recovery(launcher, DrillMachines(launcher))
    try:
        launcher.start_nodes()
        launcher.start_agents()
        deadline = time.monotonic() + 600
        while not stepped_past(run_dir, LAYOUT.world, 0.0, WARM_STEPS - 1):
            if time.monotonic() > deadline:
                raise SystemExit("the job did not start")
            time.sleep(0.1)
        if not launcher.wait_parked(launcher.machines(), PARK_TIMEOUT_S):
            raise SystemExit("the parked nodes were not ready")
        recovery.start()
        request = ActionRequest(f"bench-hu-{time.time_ns()}", ActionKind.HOT_UPDATE, Targets(),
                                HotUpdateArgs(VersionSource.GIT, "v2", UpdateMode.IMMEDIATE), "bench")
        planning, confirm, results = run_sync(_act(list(launcher.addresses().values()), launcher.token(), request))
        if len(results) != LAYOUT.machines:
            raise SystemExit(f"{len(results)} agents answered, not {LAYOUT.machines}")
        event = recovery.wait(1, 600)
        if not event.ok:
            raise SystemExit(f"the restart failed: {event.message}")
        resumed = _wait_resumed(run_dir, event.restart_began_wall, event.resume_step, "hot-updated")
        return _breakdown(Run(plan=planning, warm=_warm_of(launcher, event.machines)), run_dir, confirm,
                          event.restart_began_wall, resumed)
    finally:
        recovery.stop()
        launcher.stop()


CASES = (("cold relaunch", cold_relaunch), ("evict + warm standby", evict_with_standby),
         ("hot-update in place", hot_update_in_place))


def _cell(values: list[float | None]) -> str:
    got = [v for v in values if v is not None]
    return f"{statistics.median(got):6.2f}" if got else "     -"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=1, help="runs of each (default 1; each is a real drill)")
    parser.add_argument("--runs-in", type=Path, help=argparse.SUPPRESS)  # the child: measure, with its runs there
    args = parser.parse_args()
    if args.runs_in is not None:
        measure(args.repeat, args.runs_in)
        return
    # The runs happen in a child process so that everything it prints -- up to its interpreter's exit, when
    # channels and loops left open would show -- can be checked here, beside the logs of every process it started.
    with tempfile.TemporaryDirectory(prefix="rankscope-bench-recovery-") as tmp:
        child = subprocess.Popen([sys.executable, __file__, "--repeat", str(args.repeat), "--runs-in", tmp],
                                 stderr=subprocess.PIPE, text=True, errors="replace")
        printed = _pass_through(child)
        noisy = [f"bench_recovery (its own output): {line}" for line in shutdown_noise(printed)]
        noisy += _shutdown_noise(Path(tmp), nodes=False)
        job = _shutdown_noise(Path(tmp), nodes=True)
    print("\nshutdown: clean (no traceback or gRPC error in this benchmark's output to its exit, nor in its agents' "
          "logs)" if not noisy else
          f"\nshutdown: {len(noisy)} line(s) of traceback or gRPC error" + "".join(f"\n  {line}" for line in noisy[:20]))
    # The nodes' logs hold the ranks' own output: a rank whose peer was evicted fails its collective (gloo:
    # "Connection closed by peer") before the restart stops it, as a real job's would. Shown, but not rankscope's.
    print("the job's nodes (torchrun's and parked nodes' logs, the ranks' output): "
          + (f"{len(job)} line(s) of traceback" + "".join(f"\n  {line}" for line in job[:10]) if job else "clean"))
    if child.returncode != 0:
        raise SystemExit(child.returncode)


def _pass_through(child: subprocess.Popen[str]) -> str:
    """Copy the child's stderr to ours as it comes; all of it once the child has ended."""
    assert child.stderr is not None
    lines: list[str] = []

    def copy() -> None:
        assert child.stderr is not None
        for line in child.stderr:
            lines.append(line)
            sys.stderr.write(line)
            sys.stderr.flush()

    copier = threading.Thread(target=copy, name="stderr")
    copier.start()
    child.wait()
    copier.join()
    return "".join(lines)


def measure(repeat: int, root: Path) -> None:
    """Every path ``repeat`` times, run folders under ``root``; prints each run and the table."""
    runs: dict[str, list[Run]] = {name: [] for name, _ in CASES}
    loads = [os.getloadavg()[0]]
    for i in range(repeat):  # interleaved, so load on the shared host hits all alike
        for name, case in CASES:
            run = case(root / f"{name.replace(' ', '-')}-{i}")
            runs[name].append(run)
            loads.append(os.getloadavg()[0])
            parts = ", ".join(f"{k} {v:.2f} s" for k, v in run.parts.items())
            parts += f"; planned before the confirm in {run.plan:.2f} s" if run.plan is not None else ""
            print(f"run {i + 1}: {name}: {run.total:.2f} s ({parts}; {run.warm}; load {loads[-1]:.1f})",
                  flush=True)
    print(f"\nconfirm -> training resumed, seconds (median of {repeat}; {LAYOUT.world} ranks on "
          f"{LAYOUT.machines} machines; {os.cpu_count()} CPUs, 1-min load average {min(loads):.1f}-{max(loads):.1f})")
    print(f"  {'path':22s} {'total':>6s} | {'detect':>6s} | {'plan':>6s} | " + " | ".join(f"{p:>6s}" for p in PHASES))
    for name, _ in CASES:
        rs = runs[name]
        cells = " | ".join(_cell([r.parts.get(p) for r in rs]) for p in PHASES)
        print(f"  {name:22s} {_cell([r.total for r in rs])} | {_cell([r.detect for r in rs])} | "
              f"{_cell([r.plan for r in rs])} | {cells}")
    cold = statistics.median(r.total for r in runs["cold relaunch"])
    for name, paper in (("evict + warm standby", 10.87), ("hot-update in place", 11.04)):
        warm = statistics.median(r.total for r in runs[name])
        planned = statistics.median(r.total + (r.plan or 0.0) for r in runs[name])
        print(f"  cold relaunch / {name}: {cold / warm:.2f}x   (ByteRobust: {paper}x against a requeue; "
              f"{cold / planned:.2f}x counting the plan made before the confirm)", flush=True)


def _shutdown_noise(root: Path, *, nodes: bool) -> list[str]:
    """Every traceback or gRPC error line in the runs' agents' logs, or (``nodes``) in their nodes' logs (torchrun's
    and parked nodes', with their ranks' output), named by log; torchrun's report of the SIGTERM that stopped it
    aside (``TORCHRUN_STOPPED``)."""
    return [f"{log.relative_to(root)}: {line}" for log in sorted(root.glob("*/logs/*.log"))
            if log.name.endswith(NODE_LOG_SUFFIXES) == nodes for line in shutdown_noise(log.read_text(errors="replace"))]


if __name__ == "__main__":
    try:
        main()
    except RankscopeError as exc:
        raise SystemExit(f"bench_recovery: {exc.message}" + (f"\nfix: {exc.fix}" if exc.fix else "")) from None
