"""The fail-slow scorecard: many live slow-fault drills and healthy baselines, scored.

``run_suite`` runs drills one after another (two cores cannot run two jobs at
once honestly). Each drill is a fresh real job (``DrillSession``) with one
slow fault at a seeded random rank, or none for a healthy baseline. While it
runs, this module watches it the way ``rankscope watch`` does: it polls every
agent about once a second (``JobClient.poll``), captures stacks every
``stack_interval_s`` for ByteRobust's aggregation rounds, and feeds the pure
``FailSlowDetector``. A drill ends at the first confident verdict, or
``time_limit_s`` after the fault's onset.

Onset is the drill's ground truth: the moment the faulty rank began its
faulty step, i.e. when it wrote "completed ``plan.step`` steps" to its
progress file (the rank's own wall clock, on the same host, converted to
this process's monotonic clock). The progress folder is read every 0.1 s
between polls, so a step is not missed.

Scoring (one record per drill, ``score_records`` aggregates):

- TP: a confident verdict on a faulty drill whose named machines include the
  faulty rank's machine and lie within the expected suspect's machines (for a
  rank or machine fault: exactly that machine; for a group fault such as
  slow-comm: machines of that group).
- FP + FN: a confident verdict on a faulty drill naming other machines (a
  wrong accusation, and the fault missed).
- FN: no confident verdict on a faulty drill within the time limit.
- FP: any confident verdict on a healthy baseline (a false alarm).

precision = TP / (TP + FP), recall = TP / (TP + FN), F1 = their harmonic
mean; a ratio with an empty denominator is reported as None.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from rankscope.analyzers.rounds import try_stack_round
from rankscope.drill.faults import DrillLayout, FaultPlan, GroundTruth, machine_name, make_plan
from rankscope.drill.launcher import TrainingOptions
from rankscope.drill.progress import ProgressWatcher
from rankscope.wire.sync_loop import run_sync

# The slow faults of the suite and their strength. slow-compute and thermal
# are factors of the faulty rank's own healthy step (the rank burns, or is
# stopped, until its steps take that many times as long; see
# injection.Injector and outside_fault._HealthyStep); a dataloader delay hides behind
# prefetching until it exceeds a step; cpu-contention is three spinning
# processes on the core the victim machine's ranks are confined to.
SUITE_KINDS: tuple[str, ...] = ("slow-compute", "slow-comm", "slow-dataloader", "cpu-contention", "thermal")
FAULT_KNOBS: dict[str, dict[str, float]] = {
    "slow-compute": {"factor": 1.5},
    "slow-comm": {"delay_ms": 50.0},
    "slow-dataloader": {"delay_ms": 500.0},
    "cpu-contention": {},
    "thermal": {"factor": 2.0},
}
ONSET_POLL_S = 0.1


@dataclass(frozen=True, slots=True)
class SuiteConfig:
    """What the suite runs and how it watches.

    ``stack_interval_s`` is ByteRobust's 10 s by default; ``rounds_needed``
    of them make the stack detector's answer (5, as in the paper).
    """

    layout: DrillLayout = field(default_factory=DrillLayout)
    faulty: int = 20
    baselines: int = 5
    seed: int = 0
    kinds: tuple[str, ...] = SUITE_KINDS
    fault_step: int = 10
    poll_interval_s: float = 1.0
    stack_interval_s: float = 10.0
    rounds_needed: int = 5
    window_s: float = 30.0  # Aegis T for the metric outliers
    continuity_s: float = 20.0  # Minder continuity, and how long step time must stay high
    time_limit_s: float = 90.0  # after onset; a baseline is watched as long
    start_timeout_s: float = 300.0
    # The drill model's size. At the default (hidden 64, 8 rows a micro-batch)
    # compute is a sliver of a step (gloo and Python dominate), so a 1.5x
    # slower compute barely lengthens the step; larger values give compute
    # a real share of the step, as on a GPU, at the cost of slower steps.
    hidden: int = 64
    micro_batch_size: int = 8
    run_root: Path | None = None
    record: bool = False  # keep every drill's polled series as RUN_DIR/watch.json (for failslow.replay)
    sample_hz: float = 5.0  # the agents sample every rank's main thread (0: off), as `rankscope watch` does
    # Which jobs each drill is run as: "prepared" (started with the CCL counters, as `rankscope run` does)
    # and/or "unprepared" (plain torchrun, no counters: a job already running when someone noticed).
    modes: tuple[str, ...] = ("prepared",)
    backend: str = "gloo"  # "nccl": the drills' ranks on GPUs (rankscope.drill.gpu)


@dataclass(frozen=True, slots=True)
class DrillPlan:
    """One drill of the suite: a fault plan (``none`` for a baseline)."""

    index: int
    plan: FaultPlan
    loader_workers: int


@dataclass(frozen=True, slots=True)
class DrillRecord:
    """What one drill showed. ``machine`` is the faulty rank's; None on a baseline."""

    index: int
    kind: str
    rank: int | None
    machine: str | None
    expected_machines: tuple[str, ...]
    detected: bool  # a confident verdict at all
    named_machines: tuple[str, ...] = ()  # of the first confident verdict
    named_ranks: tuple[int, ...] = ()  # its top suspect's ranks (a check graded per rank and GPU reads them)
    named_kind: str | None = None
    sources: tuple[str, ...] = ()
    confidence: float = 0.0
    right_machine: bool = False  # the verdict's first machine is the faulty rank's
    right_group: bool = False  # the faulty machine named, and nothing outside the expected suspect
    onset_to_verdict_s: float | None = None
    watched_after_onset_s: float | None = None
    polls: int = 0
    stack_rounds: int = 0
    peak_confidence: float = 0.0  # the highest confidence seen, confident or not (what a miss came close to)
    peak_machines: tuple[str, ...] = ()
    last_flags: tuple[str, ...] = ()  # every detector's last word: why a miss was a miss
    leftovers: tuple[int, ...] = ()  # pids the drill's final sweep had to kill
    error: str | None = None  # the drill could not run (start-up failed): counted as a miss
    run_dir: str | None = None
    summary: str | None = None
    unprepared: bool = False  # the job ran without counters (plain torchrun)
    # The plan `e` would execute for the confident verdict's top suspect (scoring.score_eviction): its default
    # (precise where the evidence pins a rank) and the over-eviction of the group, graded against the faulty machine.
    eviction: dict[str, Any] | None = None

    @property
    def baseline(self) -> bool:
        return self.kind == "none"

    @property
    def outcome(self) -> str:
        """tp, fp+fn (wrong machine), fn (missed), fp (false alarm on a baseline), tn."""
        if self.baseline:
            return "fp" if self.detected else "tn"
        if not self.detected:
            return "fn"
        return "tp" if self.right_group else "fp+fn"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["outcome"] = self.outcome
        return out


# --------------------------------------------------------------------------
# Aggregation (pure)
# --------------------------------------------------------------------------


def _ratio(num: int, den: int) -> float | None:
    return round(num / den, 4) if den else None


def prf(tp: int, fp: int, fn: int) -> dict[str, float | int | None]:
    precision = _ratio(tp, tp + fp)
    recall = _ratio(tp, tp + fn)
    f1 = round(2 * precision * recall / (precision + recall), 4) if precision and recall else (
        0.0 if precision is not None and recall is not None else None)
    return {"tp": tp, "fp": fp, "fn": fn, "precision": precision, "recall": recall, "f1": f1}


def _counts(records: Sequence[DrillRecord]) -> tuple[int, int, int]:
    tp = fp = fn = 0
    for r in records:
        o = r.outcome
        tp += o == "tp"
        fp += o in ("fp", "fp+fn")
        fn += o in ("fn", "fp+fn")
    return tp, fp, fn


def score_records(records: Sequence[DrillRecord], *, within_s: float = 60.0) -> dict[str, Any]:
    """Per fault kind and overall: detected, right machine/group, time to verdict, false alarms, P/R/F1.

    Drills of prepared jobs make the card; those of unprepared jobs (plain
    torchrun, no counters) are scored the same way under ``"unprepared"``,
    the scorecard's "unprepared job" column.
    """
    card = _score(tuple(r for r in records if not r.unprepared), within_s)
    plain = tuple(r for r in records if r.unprepared)
    if plain:
        card["unprepared"] = _score(plain, within_s)
    return card


def _score(records: Sequence[DrillRecord], within_s: float) -> dict[str, Any]:
    kinds: dict[str, Any] = {}
    for kind in sorted({r.kind for r in records if not r.baseline}):
        rs = [r for r in records if r.kind == kind]
        times = sorted(r.onset_to_verdict_s for r in rs if r.outcome == "tp" and r.onset_to_verdict_s is not None)
        kinds[kind] = {
            "drills": len(rs),
            "detected": sum(r.detected for r in rs),
            "right_machine": sum(r.right_machine for r in rs),
            "right_group": sum(r.right_group for r in rs),
            "named_within_s": sum(t <= within_s for t in times),
            "onset_to_verdict_s": {"min": times[0], "median": times[len(times) // 2], "max": times[-1]} if times else None,
            "errors": sum(r.error is not None for r in rs),
            **prf(*_counts(rs)),
        }
    base = [r for r in records if r.baseline]
    faulty = [r for r in records if not r.baseline]
    return {
        "kinds": kinds,
        "baselines": {"drills": len(base), "false_alarms": sum(r.detected for r in base),
                      "errors": sum(r.error is not None for r in base)},
        "overall": {"faulty_drills": len(faulty), "baselines": len(base), **prf(*_counts(records))},
        "within_s": within_s,
    }


# --------------------------------------------------------------------------
# Planning
# --------------------------------------------------------------------------


def plan_suite(config: SuiteConfig) -> list[DrillPlan]:
    """Faulty drills cycling through the kinds at seeded random ranks, baselines spread among them."""
    rng = random.Random(config.seed)
    layout = config.layout
    faulty = []
    for i in range(config.faulty):
        kind = config.kinds[i % len(config.kinds)]
        knobs = FAULT_KNOBS.get(kind, {})
        plan = make_plan(kind, layout, rank=rng.randrange(layout.world), step=config.fault_step,
                         factor=knobs.get("factor", 2.0), delay_ms=knobs.get("delay_ms", 50.0))
        faulty.append(plan)
    baseline = make_plan("none", layout, step=config.fault_step)
    plans: list[FaultPlan] = list(faulty)
    for b in range(config.baselines):
        # Spread the baselines through the run, so a machine getting busier
        # over the hours does not bunch all of them at one end.
        at = (b + 1) * (len(plans) + 1) // (config.baselines + 1) if config.faulty else b
        plans.insert(min(at, len(plans)), baseline)
    return [DrillPlan(index=i, plan=p, loader_workers=1 if p.name == "slow-dataloader" else 0)
            for i, p in enumerate(plans)]


# --------------------------------------------------------------------------
# One live drill
# --------------------------------------------------------------------------


class OnsetClock:
    """When a rank began step ``step``, read from its progress file, on this process's monotonic clock."""

    def __init__(self, watcher: ProgressWatcher, rank: int, step: int) -> None:
        self.watcher = watcher
        self.rank = rank
        self.step = step
        self.onset_mono: float | None = None
        self.exact = True  # False when the step was passed between two reads (onset is then an upper bound)

    def poll(self) -> float | None:
        if self.onset_mono is not None:
            return self.onset_mono
        latest = self.watcher.poll().get(self.rank)
        if latest is not None and latest.step >= self.step:
            self.exact = latest.step == self.step
            # The rank wrote its wall time; same host, so shift it onto our monotonic clock.
            self.onset_mono = latest.wall - (time.time() - time.monotonic())
        return self.onset_mono


async def _watch(session: Any, truth: GroundTruth, config: SuiteConfig, onset: OnsetClock,
                 say: Callable[[str], None]) -> dict[str, Any]:
    """Poll, capture and detect until a confident verdict or the time limit after onset."""
    from rankscope.analyzers.failslow import FailSlowDetector
    from rankscope.analyzers.failslow_config import FailSlowConfig
    from rankscope.wire.client import JobClient

    layout = session.layout.to_snapshot_layout()
    detector = FailSlowDetector(FailSlowConfig(window_s=config.window_s, continuity_s=config.continuity_s,
                                               step_window_s=min(config.window_s, config.continuity_s),
                                               rounds_needed=config.rounds_needed), layout)
    polls = rounds = 0
    peak: tuple[float, tuple[str, ...]] = (0.0, ())
    fs: Any = None
    series: list[Any] = []

    placement: dict[int, str] = {}

    def done(verdict: Any, at: float, error: str | None = None) -> dict[str, Any]:
        flags = tuple(f"{f.detector}@{f.machine}{' ALARM' if f.alarmed else ''} {f.score:.2f}: {f.evidence}"
                      for f in (fs.flags if fs is not None else ()))
        if config.record and series:
            from rankscope.contract.bundle import Bundle, write_bundle

            write_bundle(Bundle(snapshots=tuple(series), created_wall=time.time(), ground_truth=truth.to_dict(),
                                meta={"command": "drill --suite", "onset_mono": onset.onset_mono}),
                         session.run_dir / "watch.json")
        return {"fs": verdict, "polls": polls, "rounds": rounds, "at": at, "error": error, "peak": peak,
                "flags": flags, "placement": placement}

    next_stacks = time.monotonic()
    hard_end = time.monotonic() + config.start_timeout_s + config.time_limit_s  # onset must come at all
    async with JobClient(list(session.agents.values()), session.token()) as client:
        while True:
            tick = time.monotonic()
            started = onset.poll()
            if started is not None and tick - started >= config.time_limit_s:
                return done(None, tick)
            if tick >= hard_end or not any(session.launcher.nodes_alive().values()):
                return done(None, tick, "the job exited" if tick < hard_end else "the faulty step never came")
            stacks = config.stack_interval_s > 0 and tick >= next_stacks
            if stacks:
                next_stacks = tick + config.stack_interval_s
                snap = await client.capture(timeout_s=5.0, sample_hz=config.sample_hz)  # keeps the sampling
            else:
                snap = await client.poll(sample_hz=config.sample_hz)
            polls += 1
            if config.record:
                series.append(snap)
            analysis = try_stack_round(snap, layout)[0] if stacks else None
            rounds += analysis is not None
            fs = detector.update(snap, analysis)
            if fs.confidence > peak[0]:
                peak = (round(fs.confidence, 3), tuple(fs.machines))
            # A verdict before onset (a baseline's "onset" included) counts too:
            # it is an alarm on a healthy job.
            if fs.confident:
                from rankscope.analyzers.topology import placement_of

                placement.update(placement_of(snap))
                return done(fs, snap.captured.mono)
            wake = tick + config.poll_interval_s
            while (left := wake - time.monotonic()) > 0:
                onset.poll()
                await asyncio.sleep(min(ONSET_POLL_S, left))


def run_drill(item: DrillPlan, config: SuiteConfig, *, say: Callable[[str], None] = lambda _m: None,
              unprepared: bool = False) -> DrillRecord:
    """One live drill, watched to a verdict; every process it started is stopped before this returns.

    ``unprepared``: the job runs without the CCL counters (plain torchrun).
    """
    from rankscope.contract.errors import RankscopeError
    from rankscope.drill.faults import ground_truth
    from rankscope.drill.session import DrillConfig, DrillSession

    plan = item.plan
    layout = config.layout
    truth = ground_truth(plan, layout)
    suffix = "-unprepared" if unprepared else ""
    run_dir = config.run_root / f"drill-{item.index:02d}-{plan.name}{suffix}" if config.run_root is not None else None
    training = TrainingOptions(steps=1_000_000, seed=config.seed + item.index, loader_workers=item.loader_workers,
                               checkpoint_every=0, hidden=config.hidden, micro_batch_size=config.micro_batch_size,
                               backend=config.backend)  # runs until stopped; no checkpoint noise
    dconfig = DrillConfig(layout=layout, plan=plan, training=training, run_dir=run_dir,
                          start_timeout_s=config.start_timeout_s, counters=not unprepared)
    base = DrillRecord(index=item.index, kind=plan.name, rank=truth.rank, machine=truth.machine,
                       expected_machines=truth.suspect_machines, detected=False, unprepared=unprepared)
    try:
        with DrillSession(dconfig) as s:
            base = replace(base, run_dir=str(s.run_dir))
            s.wait_for_steps(1, config.start_timeout_s)
            if not s.agents:
                raise RankscopeError("the drill's agents did not start", f"read the logs in {s.run_dir / 'logs'}")
            # A baseline's "onset" is rank 0 reaching the same step: it is watched as long.
            onset = OnsetClock(ProgressWatcher(s.run_dir, layout.world), plan.rank if plan.rank >= 0 else 0,
                               plan.step if plan.name != "none" else config.fault_step)
            out = run_sync(_watch(s, truth, config, onset, say))
    except RankscopeError as exc:
        return replace(base, error=exc.message)
    base = replace(base, leftovers=tuple(s.leftovers))
    fs = out["fs"]
    started = onset.onset_mono
    rec = replace(base, polls=out["polls"], stack_rounds=out["rounds"], error=out["error"],
                  peak_confidence=out["peak"][0], peak_machines=out["peak"][1], last_flags=out["flags"],
                  watched_after_onset_s=round(out["at"] - started, 2) if started is not None else None)
    if fs is None:
        return rec
    from rankscope.drill.scoring import score_eviction

    named = tuple(fs.machines)
    top = fs.verdict.top
    right_group = bool(named) and truth.machine in named and set(named) <= set(truth.suspect_machines)
    return replace(
        rec, detected=True, named_machines=named, named_ranks=tuple(top.ranks) if top else (),
        named_kind=str(top.kind) if top else None,
        sources=tuple(top.sources) if top else (), confidence=round(fs.confidence, 3),
        right_machine=truth.machine is not None and fs.machine == truth.machine, right_group=right_group,
        onset_to_verdict_s=round(out["at"] - started, 2) if started is not None and truth.rank is not None else None,
        summary=fs.verdict.summary, eviction=score_eviction(top, truth.machine, out.get("placement") or {}),
    )


def run_suite(config: SuiteConfig, *, say: Callable[[str], None] = lambda _m: None,
              on_record: Callable[[DrillRecord], None] | None = None) -> dict[str, Any]:
    """Every drill of the suite, one after another, then the scorecard."""
    items = plan_suite(config)
    records: list[DrillRecord] = []
    started = time.monotonic()
    for item in items:
        p = item.plan
        where = f"rank {p.rank} ({truth_machine(config.layout, p)})" if p.rank >= 0 else "healthy baseline"
        for mode in config.modes:
            say(f"[{item.index + 1}/{len(items)}] {p.name} at {where}, {mode} job")
            rec = run_drill(item, config, say=say, unprepared=mode == "unprepared")
            records.append(rec)
            say(f"    -> {rec.outcome}: {rec.summary or rec.error or 'no confident verdict'}"
                + (f" after {rec.onset_to_verdict_s:.1f} s" if rec.onset_to_verdict_s is not None else ""))
            if on_record is not None:
                on_record(rec)
    return {
        "config": {"layout": asdict(config.layout), "faulty": config.faulty, "baselines": config.baselines,
                   "seed": config.seed, "kinds": list(config.kinds), "fault_step": config.fault_step,
                   "poll_interval_s": config.poll_interval_s, "stack_interval_s": config.stack_interval_s,
                   "rounds_needed": config.rounds_needed, "window_s": config.window_s,
                   "continuity_s": config.continuity_s, "time_limit_s": config.time_limit_s,
                   "hidden": config.hidden, "micro_batch_size": config.micro_batch_size,
                   "knobs": FAULT_KNOBS, "modes": list(config.modes), "sample_hz": config.sample_hz},
        "scorecard": score_records(records),
        "drills": [r.to_dict() for r in records],
        "wall_s": round(time.monotonic() - started, 1),
    }


def truth_machine(layout: DrillLayout, plan: FaultPlan) -> str:
    return machine_name(layout.machine_of(plan.rank))


def scorecard_lines(result: dict[str, Any]) -> list[str]:
    """The scorecard as text: one line per kind, the baselines, the overall figures.

    With unprepared-job drills the last column, "unprepared job", gives for
    each kind the same drills' right-group verdicts within the time limit on
    plain torchrun (no counters): ``right/drills``.
    """
    card = result["scorecard"]
    plain = card.get("unprepared")
    lines = [f"{'kind':<16}{'drills':>7}{'detect':>7}{'mach':>6}{'group':>6}{'<=60s':>6}{'median s':>10}"
             f"{'P':>7}{'R':>7}{'F1':>7}" + (f"{'unprepared job':>16}" if plain else "")]

    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    def column(kind: str) -> str:
        if not plain:
            return ""
        k = plain["kinds"].get(kind)
        text = f"{k['tp']}/{k['drills']} ({k['named_within_s']} <=60s)" if k else "-"
        return f"{text:>16}"

    kinds = list(card["kinds"]) + [k for k in (plain or {}).get("kinds", {}) if k not in card["kinds"]]
    for kind in kinds:
        k = card["kinds"].get(kind)
        if k is None:
            lines.append(f"{kind:<16}{'-':>7}{'':>56}{column(kind)}")
            continue
        t = k["onset_to_verdict_s"]
        lines.append(f"{kind:<16}{k['drills']:>7}{k['detected']:>7}{k['right_machine']:>6}{k['right_group']:>6}"
                     f"{k['named_within_s']:>6}{f(t['median'] if t else None):>10}"
                     f"{f(k['precision']):>7}{f(k['recall']):>7}{f(k['f1']):>7}{column(kind)}")
    b = card["baselines"]
    lines.append(f"healthy baselines: {b['drills']}, confident false alarms: {b['false_alarms']}")
    plans = [d["eviction"] for d in result.get("drills", ()) if d.get("eviction") and not d.get("unprepared")]
    if plans:
        # What `e` would take for each confident verdict, from the same plan the TUI executes.
        def mean(scope: str) -> float:
            return float(sum(e[scope]["extra_machines"] for e in plans)) / len(plans)
        lines.append(f"eviction plan (e) of {len(plans)} confident verdicts: default precise in "
                     f"{sum(e['default'] == 'precise' for e in plans)}; extra machines (mean) default {mean('precise'):.2f}, "
                     f"over-eviction {mean('group'):.2f}; faulty machine evicted by default in "
                     f"{sum(e['precise']['right'] for e in plans)}")
    o = card["overall"]
    lines.append(f"overall: TP {o['tp']} FP {o['fp']} FN {o['fn']}  precision {f(o['precision'])} "
                 f"recall {f(o['recall'])} F1 {f(o['f1'])}  ({result['wall_s']:.0f} s)")
    if plain:
        pb, po = plain["baselines"], plain["overall"]
        lines.append(f"unprepared jobs (plain torchrun, no counters): TP {po['tp']} FP {po['fp']} FN {po['fn']}  "
                     f"precision {f(po['precision'])} recall {f(po['recall'])} F1 {f(po['f1'])}; "
                     f"baselines {pb['drills']}, confident false alarms {pb['false_alarms']}")
    return lines
