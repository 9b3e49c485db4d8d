"""Per-operation timing traces as a fail-slow source: a slow worker, a slow stage, or nobody.

The input is one row per operation of each recorded worker (the schema of
ByteDance-Seed/StragglerAnalysis: ``dp_rank, stage, rank, step, optype,
start_ts, duration, …``). Three questions are asked of it, in the spirit of
that paper's what-if analysis (how much faster would the job be if this
worker, or this stage, were as fast as its peers?):

- *Is one worker slow, and in which op?* Per step, each worker's total time
  in one kind of op is compared with the median of the workers of its own
  pipeline stage (who run the same layers on other data). A worker whose
  ratio stays at or above ``worker_ratio`` in at least ``persistence`` of the
  steps is slow in that op. Compute ops (forward, backward, optimizer) are
  its own work. Of the communication ops only the sends are compared: a
  receive or a collective lasts as long as the worker waited for its peers,
  so long ones mark the victims of a slow worker, not the culprit.
- *Is a stage slow?* Per step, a stage's compute time (forward + backward of
  a worker) is compared with the median of the other stages. A stage whose
  *fastest* worker is at or above ``stage_ratio`` times the other stages in
  most steps is slow as a whole: the model is partitioned unevenly (a heavy
  embedding or loss head), and no machine is to blame; evicting one would
  not help.
- *Otherwise* no single worker is to blame; the verdict says how much the
  work varies per micro-batch and how often the slowest worker changes, the
  two things that rule out one bad machine.

Pure: the caller reads the file (``rankscope.formats.optrace_io``) and hands the
columns in as sequences of equal length.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

REQUIRED_COLUMNS: tuple[str, ...] = ("dp_rank", "stage", "rank", "step", "optype", "duration")
COMPUTE_OPS: tuple[str, ...] = ("forward-compute", "backward-compute", "optimizer")
SEND_OPS: tuple[str, ...] = ("forward-send", "backward-send")
STAGE_OPS: tuple[str, ...] = ("forward-compute", "backward-compute")
WAIT_OPS: tuple[str, ...] = ("forward-recv", "backward-recv", "grads-reduce-scatter", "params-all-gather",
                             "layernorm-grads-all-reduce", "embedding-grads-all-reduce")


class TraceError(ValueError):
    """The trace cannot be analysed (a missing column, no rows); the message says which."""


@dataclass(frozen=True, slots=True)
class SlowWorker:
    rank: int
    stage: int
    dp_rank: int
    op: str
    kind: str  # "compute" or "communication"
    ratio: float  # median over steps of its time / its stage peers' median
    steps_slow: int
    steps: int

    def evidence(self) -> str:
        return (f"rank {self.rank} (stage {self.stage}, dp rank {self.dp_rank}) spends {self.ratio:.2f}× its stage "
                f"peers' time in {self.op} ({self.kind}), in {self.steps_slow} of {self.steps} steps")


@dataclass(frozen=True, slots=True)
class SlowStage:
    stage: int
    ratio: float  # its fastest worker's compute / the other stages' median, median over steps
    spread: float  # its slowest worker over its fastest (1.0: all alike)
    steps_slow: int
    steps: int

    def evidence(self) -> str:
        return (f"stage {self.stage} computes {self.ratio:.2f}× the other stages (even its fastest worker) in "
                f"{self.steps_slow} of {self.steps} steps, its workers within {100 * (self.spread - 1):.1f} % of "
                f"each other: a partition imbalance, not a machine")


@dataclass(frozen=True, slots=True)
class TraceVerdict:
    workers: int
    stages: int
    steps: int
    slow_workers: tuple[SlowWorker, ...]
    slow_stages: tuple[SlowStage, ...]
    compute_cv: float  # median per-worker coefficient of variation of forward-compute durations
    slowest_changes: float  # share of (stage, step) pairs whose slowest worker is not the stage's usual one
    waits: tuple[tuple[str, float], ...]  # per waiting op: median per-step time over all workers
    summary: str
    victims: tuple[int, ...] = ()  # workers whose long sends wait for a slow worker of their replica

    @property
    def no_single_worker(self) -> bool:
        return not self.slow_workers


def _column(columns: Mapping[str, Sequence[object]], name: str) -> np.ndarray:
    if name not in columns:
        raise TraceError(f"the trace has no column {name!r} (needs {', '.join(REQUIRED_COLUMNS)})")
    return np.asarray(columns[name])


def analyze_trace(columns: Mapping[str, Sequence[object]], *, worker_ratio: float = 1.2, stage_ratio: float = 1.2,
                  persistence: float = 0.8) -> TraceVerdict:
    """The verdict of the module docstring over the trace's columns."""
    cols = {name: _column(columns, name) for name in REQUIRED_COLUMNS}
    n = len(cols["rank"])
    if n == 0:
        raise TraceError("the trace has no rows")
    if any(len(c) != n for c in cols.values()):
        raise TraceError("the trace's columns differ in length")
    try:
        rank = cols["rank"].astype(np.int64)
        stage = cols["stage"].astype(np.int64)
        dp = cols["dp_rank"].astype(np.int64)
        step = cols["step"].astype(np.int64)
        duration = cols["duration"].astype(np.float64)
    except (TypeError, ValueError) as exc:
        raise TraceError(f"a numeric column holds something else: {exc}") from None
    optype = cols["optype"].astype(str)
    if not np.all(np.isfinite(duration)) or np.any(duration < 0):
        raise TraceError("durations must be finite and not negative")

    workers = sorted({(int(r), int(s), int(d)) for r, s, d in zip(rank, stage, dp, strict=True)})
    dp_of = {r: d for r, _, d in workers}
    steps = np.unique(step)
    step_index = {int(s): i for i, s in enumerate(steps)}
    worker_index = {r: i for i, (r, _, _) in enumerate(workers)}
    ri = np.array([worker_index[int(r)] for r in rank])
    si = np.array([step_index[int(s)] for s in step])

    def per_step(mask: np.ndarray) -> np.ndarray:
        """(workers, steps) total duration of the masked rows; NaN where a worker has none in a step."""
        out = np.zeros((len(workers), len(steps)))
        seen = np.zeros((len(workers), len(steps)), dtype=bool)
        np.add.at(out, (ri[mask], si[mask]), duration[mask])
        seen[ri[mask], si[mask]] = True
        out[~seen] = np.nan
        return out

    stage_ids = sorted({s for _, s, _ in workers})
    members = {s: [worker_index[r] for r, st, _ in workers if st == s] for s in stage_ids}

    slow_workers: list[SlowWorker] = []
    for op in (*COMPUTE_OPS, *SEND_OPS):
        mask = optype == op
        if not mask.any():
            continue
        table = per_step(mask)
        for s, idx in members.items():
            if len(idx) < 2:
                continue  # a worker alone at its stage has no peers to compare with
            sub = table[idx]
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # a step where no peer ran the op
                med = np.nanmedian(sub, axis=0)
                ratio = sub / med
            for j, wi in enumerate(idx):
                row = ratio[j][np.isfinite(ratio[j])]
                if row.size == 0:
                    continue
                slow = int(np.sum(row >= worker_ratio))
                if slow >= persistence * row.size and float(np.median(row)) >= worker_ratio:
                    r = workers[wi][0]
                    slow_workers.append(SlowWorker(r, s, dp_of[r], op, "compute" if op in COMPUTE_OPS else
                                                   "communication", round(float(np.median(row)), 3), slow,
                                                   int(row.size)))

    # A send lasts until the receiver takes it: in the data-parallel replica of a
    # worker slow in its own compute, the other stages' sends wait for it. Those
    # are its victims, not slow links, and are named as such.
    culprits = {(w.rank, dp_of[w.rank]) for w in slow_workers if w.kind == "compute"}
    victims = tuple(sorted({w.rank for w in slow_workers if w.kind == "communication"
                            and any(d == dp_of[w.rank] and r != w.rank for r, d in culprits)}))
    slow_workers = [w for w in slow_workers if w.rank not in victims]

    compute = per_step(np.isin(optype, STAGE_OPS))
    slow_stages: list[SlowStage] = []
    if len(stage_ids) > 1:
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            typical = {s: np.nanmedian(compute[idx], axis=0) for s, idx in members.items()}
            fastest = {s: np.nanmin(compute[idx], axis=0) for s, idx in members.items()}
            slowest = {s: np.nanmax(compute[idx], axis=0) for s, idx in members.items()}
            for s in stage_ids:
                others = np.nanmedian(np.vstack([typical[o] for o in stage_ids if o != s]), axis=0)
                ratio = fastest[s] / others
                row = ratio[np.isfinite(ratio)]
                if row.size == 0:
                    continue
                n_slow = int(np.sum(row >= stage_ratio))
                if n_slow >= persistence * row.size and float(np.median(row)) >= stage_ratio:
                    spread = float(np.nanmedian(slowest[s] / fastest[s]))
                    slow_stages.append(SlowStage(s, round(float(np.median(row)), 3), round(spread, 4), n_slow,
                                                 int(row.size)))

    # How much the work itself varies, and whether the slowest worker of a stage is always the same one.
    fwd = optype == "forward-compute"
    cvs = []
    for wi in range(len(workers)):
        d = duration[fwd & (ri == wi)]
        if d.size > 1 and d.mean() > 0:
            cvs.append(float(d.std() / d.mean()))
    changes, pairs = 0, 0
    for idx in members.values():
        if len(idx) < 2:
            continue
        sub = compute[idx]
        ok = np.all(np.isfinite(sub), axis=0)
        if not ok.any():
            continue
        who = np.argmax(sub[:, ok], axis=0)
        usual = np.bincount(who).argmax()
        changes += int(np.sum(who != usual))
        pairs += int(who.size)
    waits = []
    for op in WAIT_OPS:
        mask = optype == op
        if mask.any():
            waits.append((op, round(float(np.nanmedian(per_step(mask))), 4)))

    slow_workers.sort(key=lambda w: -w.ratio)
    slow_stages.sort(key=lambda s: -s.ratio)
    cv = round(float(np.median(cvs)), 4) if cvs else math.nan
    change_share = round(changes / pairs, 4) if pairs else math.nan
    if slow_workers:
        summary = "slow worker: " + "; ".join(w.evidence() for w in slow_workers)
        if victims:
            summary += (f"; the sends of rank(s) {', '.join(map(str, victims))} in its data-parallel replica wait "
                        "for it (victims, not slow links)")
    else:
        summary = (f"no single worker is to blame: no worker is ≥ {worker_ratio:g}× its stage peers in "
                   f"{100 * persistence:.0f} % of steps; the slowest worker of a stage changes in "
                   f"{100 * change_share:.0f} % of steps and forward compute varies {100 * cv:.0f} % per micro-batch")
    if slow_stages:
        summary += "; slow stage: " + "; ".join(s.evidence() for s in slow_stages)
    return TraceVerdict(len(workers), len(stage_ids), len(steps), tuple(slow_workers), tuple(slow_stages), cv,
                        change_share, tuple(waits), summary, victims)
