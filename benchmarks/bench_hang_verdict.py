"""Hang to verdict on the drill: `python benchmarks/bench_hang_verdict.py [--kinds hang-p2p,hang-compute]
[--healthy 1] [--no-baseline]`.

Each run is a real drill (8 ranks, TP=2 PP=2 DP=2 on 4 local machines, gloo) with the TUI's app attached headless
through the agents, as `rankscope drill` attaches it (``RankscopeApp`` over ``LiveSource``): the app's own polls,
hang rule, automatic capture and analysis. Measured:

- **hang to verdict**, per hang kind: from the faulty rank's last completed step (its own progress record) to the
  app's first verdict naming suspects; median and worst over the kinds;
- **false HUNG**: healthy runs whose steps are uneven (checkpoint saves every 5 steps, and on every 6th step one
  rank's data loader 0.7 s late a batch: short steps and a few seconds' ones), each watched for ``--healthy-s``
  seconds; a run counts when the app called the job hung.

Both with the hang judged by the job's own rhythm (``analyzers.progress.hang_threshold``) and, as the baseline,
with the fixed 30 s threshold it replaced (the first kind only, and the healthy runs, unless --no-baseline). NCCL
RAS reports a stuck collective in about 5 s, Mycroft within 15 s. Slow: each drill starts torch on 8 ranks; keep
the default (two kinds, one healthy run) on the shared 2-core machine.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rankscope.analyzers.progress import HangThreshold
from rankscope.drill.faults import HANG_FAULTS, DrillLayout, make_plan
from rankscope.drill.launcher import TrainingOptions
from rankscope.drill.session import DrillConfig, DrillSession
from rankscope.tui import health as hl
from rankscope.tui.app import AppOptions, RankscopeApp
from rankscope.tui.sources import LiveSource

LAYOUT = DrillLayout(tp=2, pp=2, dp=2, machines=4)
FAULT_STEP = 15


@dataclass
class Run:
    kind: str
    rule: str  # "rhythm" or "fixed 30 s"
    to_verdict_s: float | None = None  # hang runs: faulty rank's last step -> first verdict naming suspects
    hung: bool = False  # healthy runs: the app called the job hung
    threshold_s: float | None = None  # the hang threshold the app used when it judged
    error: str = ""


def fixed_rule(fixed: bool) -> Callable[[], None]:
    """The baseline: the hang threshold the app had before, --hang-after (30 s) whatever the job's rhythm."""
    original = hl.hang_threshold
    if fixed:
        hl.hang_threshold = lambda step_s, settled, ceiling_s: HangThreshold(ceiling_s, None, False)  # type: ignore[assignment]

    def restore() -> None:
        hl.hang_threshold = original  # type: ignore[assignment]

    return restore


def judged_at(app: RankscopeApp, seen: list[float]) -> bool:
    """Keep the hang threshold the app judged by, the first time it called the job hung; whether it has."""
    if not seen and any(e.kind == "hung" for e in app.state.events):
        seen.append(app.state.hang_threshold_s)
        print(f"    judged hung at {seen[0]:.1f} s: {app.state.hang.basis()}, the ranks' last step "
              f"{app.state.rhythm_step_s or 0:.2f} s, collectives settled: {app.state.collectives_settled}", flush=True)
    return bool(seen)


async def watch(session: DrillSession, until: Callable[[RankscopeApp], bool], timeout_s: float,
                on_verdict: Callable[..., None] | None = None) -> RankscopeApp:
    source = LiveSource(list(session.agents.values()), session.token())
    app = RankscopeApp(source, AppOptions(layout=LAYOUT.to_snapshot_layout(), on_verdict=on_verdict))
    task = asyncio.create_task(app.run_async(headless=True, size=(160, 48)))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not task.done() and not until(app):
        await asyncio.sleep(0.2)
    app.exit()
    await task
    return app


def hang_run(kind: str, fixed: bool, seed: int) -> Run:
    from rankscope.cli.commands.drill import fault_onset_wall

    run = Run(kind, "fixed 30 s" if fixed else "rhythm")
    plan = make_plan(kind, LAYOUT, step=FAULT_STEP, seed=seed)
    config = DrillConfig(layout=LAYOUT, plan=plan, training=TrainingOptions(steps=FAULT_STEP + 400, seed=seed))
    restore = fixed_rule(fixed)
    try:
        with DrillSession(config) as s:
            s.wait_for_steps(1, config.start_timeout_s)
            seen: list[tuple[float, float | None]] = []

            def on_verdict(verdict: Any, wall: float, placement: dict[int, str]) -> None:
                if not seen:
                    seen.append((time.time(), fault_onset_wall(s)))

            threshold: list[float] = []
            asyncio.run(watch(s, lambda app: judged_at(app, threshold) and bool(seen), 150.0, on_verdict))
            run.threshold_s = threshold[0] if threshold else None
            if not seen:
                run.error = "no verdict named suspects within 150 s"
            elif seen[0][1] is None:
                run.error = "the faulty rank's last step is unknown"
            else:
                run.to_verdict_s = seen[0][0] - seen[0][1]  # type: ignore[operator]
    except Exception as exc:  # one broken drill is a row, not the end of the benchmark
        run.error = f"{type(exc).__name__}: {exc}"
    finally:
        restore()
    return run


def healthy_run(fixed: bool, seed: int, watch_s: float) -> Run:
    run = Run("healthy, uneven steps", "fixed 30 s" if fixed else "rhythm")
    # One rank's loader is 0.7 s late a batch every 6th step: the job's steps are uneven (its peers wait), never stuck.
    plan = make_plan("slow-dataloader", LAYOUT, step=3, delay_ms=700.0, on_steps=1, off_steps=5, seed=seed)
    config = DrillConfig(layout=LAYOUT, plan=plan, training=TrainingOptions(steps=5000, seed=seed))
    restore = fixed_rule(fixed)
    try:
        with DrillSession(config) as s:
            s.wait_for_steps(1, config.start_timeout_s)
            threshold: list[float] = []
            app = asyncio.run(watch(s, lambda a: judged_at(a, threshold), watch_s))
            run.hung = bool(threshold)
            run.threshold_s = threshold[0] if threshold else app.state.hang_threshold_s
    except Exception as exc:
        run.error = f"{type(exc).__name__}: {exc}"
    finally:
        restore()
    return run


def summary(runs: list[Run], rule: str) -> str:
    times = [r.to_verdict_s for r in runs if r.rule == rule and r.to_verdict_s is not None]
    healthy = [r for r in runs if r.rule == rule and r.kind.startswith("healthy") and not r.error]
    false = sum(r.hung for r in healthy)
    t = f"median {statistics.median(times):5.1f} s, worst {max(times):5.1f} s over {len(times)}" if times else "-"
    return f"{rule:<11} hang to verdict: {t:<38} false HUNG: {false} of {len(healthy)} healthy runs"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--kinds", default="hang-p2p,hang-compute",
                   help=f"hang kinds to run, or 'all' ({','.join(HANG_FAULTS)})")
    p.add_argument("--healthy", type=int, default=1, help="healthy runs with uneven steps")
    p.add_argument("--healthy-s", type=float, default=60.0, help="how long each healthy run is watched")
    p.add_argument("--no-baseline", action="store_true", help="skip the fixed-threshold runs")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    kinds = [k for k in HANG_FAULTS if k != "crash"] if args.kinds == "all" else args.kinds.split(",")
    runs: list[Run] = []
    for i, kind in enumerate(kinds):
        runs.append(hang_run(kind, False, args.seed + i))
        print(f"  {kind:<20} rhythm     {runs[-1].to_verdict_s or 0:6.1f} s  (threshold {runs[-1].threshold_s} s) "
              f"{runs[-1].error}", flush=True)
    if not args.no_baseline:
        runs.append(hang_run(kinds[0], True, args.seed))
        print(f"  {kinds[0]:<20} fixed 30 s {runs[-1].to_verdict_s or 0:6.1f} s  {runs[-1].error}", flush=True)
    for i in range(args.healthy):
        for fixed in (False, True) if not args.no_baseline else (False,):
            runs.append(healthy_run(fixed, args.seed + 100 + i, args.healthy_s))
            r = runs[-1]
            print(f"  healthy uneven #{i}    {r.rule:<10} {'HUNG' if r.hung else 'never hung'} over {args.healthy_s:.0f} s "
                  f"(threshold {r.threshold_s} s) {r.error}", flush=True)
    print(summary(runs, "rhythm"))
    if not args.no_baseline:
        print(summary(runs, "fixed 30 s"))
        rhythm = [r.to_verdict_s for r in runs if r.rule == "rhythm" and r.kind == kinds[0] and r.to_verdict_s]
        fixed = [r.to_verdict_s for r in runs if r.rule != "rhythm" and r.to_verdict_s]
        if rhythm and fixed:
            print(f"{kinds[0]}: rhythm {rhythm[0]:.1f} s vs fixed {fixed[0]:.1f} s: {fixed[0] / rhythm[0]:.2f}x sooner")


if __name__ == "__main__":
    main()
