"""Fail-slow mode's state: the detectors fed with every snapshot, digested for drawing.

``FailSlowTracker`` owns one ``FailSlowDetector`` (stateful, not thread-safe)
and is driven by exactly one worker at a time: the app hands it every poll and
every capture (with its stack analysis) in arrival order, the tracker updates
the detector off the UI thread and returns an immutable ``FailSlowView`` that
holds everything the view draws. The view is built from the detector's own
series store, so the heat map shows the step times the detectors judged.

Times shown are relative to the newest snapshot's monotonic time (``at_mono``),
never the real clock: a recorded series draws the same screen on every run.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np
from rankscope.analyzers.failslow import FailSlowDetector
from rankscope.analyzers.failslow_config import DETECTORS, FailSlowConfig
from rankscope.analyzers.failslow_vote import FailSlowVerdict
from rankscope.contract.snapshot import JobSnapshot
from rankscope.tui.analysis import StackView
from textual.app import App
from textual.message import Message

ROUNDS_KEPT = 60  # rounds of history the view can show (one per snapshot)
SPARK_POINTS = 60  # step-time samples behind the sparklines


@dataclass(frozen=True, slots=True)
class HeatRow:
    """One machine of the heat map: its ranks' step times relative to the job median."""

    machine: str
    ranks: tuple[int, ...]
    ratios: tuple[float | None, ...]  # per rank: step time / job median (None: not known)
    ratio: float | None  # the machine's median step time / job median
    step_s: float | None  # the machine's median step time
    reachable: bool


@dataclass(frozen=True, slots=True)
class RoundFlags:
    """One update of the detector: which detector flagged which machine, and the verdict's standing."""

    at_mono: float | None
    flags: tuple[tuple[str, str | None, bool], ...]  # (detector, machine, alarmed)
    suspect: str | None
    confident: bool
    confidence: float


@dataclass(frozen=True, slots=True)
class FailSlowView:
    verdict: FailSlowVerdict | None
    heat: tuple[HeatRow, ...]
    job_step_s: float | None  # the job's median step time now
    rounds: tuple[RoundFlags, ...]  # oldest first
    suspect: str | None  # the machine the sparklines follow (the top suspect, else the slowest machine)
    suspect_steps: tuple[float, ...]  # its step time, oldest first (NaN where unknown)
    peer_steps: tuple[float, ...]  # the median of the other machines, same times
    updates: int
    errors: tuple[str, ...] = ()
    skipped: int = 0  # live polls left out because the detectors were still busy with older ones

    @property
    def slow_for_s(self) -> float | None:
        """How long the slowdown has lasted, in the snapshots' own time."""
        v = self.verdict
        if v is None or v.slow_since_mono is None or v.at_mono is None:
            return None
        return max(0.0, v.at_mono - v.slow_since_mono)


EMPTY = FailSlowView(None, (), None, (), None, (), (), 0)


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


class FailSlowTracker:
    """Feeds a ``FailSlowDetector`` and digests its state; call from one thread at a time."""

    def __init__(self, config: FailSlowConfig | None = None) -> None:
        self.detector = FailSlowDetector(config)
        self._rounds: list[RoundFlags] = []
        self._errors: list[str] = []

    def feed_series(self, items: Iterable[tuple[JobSnapshot, StackView | None]]) -> FailSlowView:
        """A recorded series, oldest first (the bundle a watch recorded): replayed as it happened live."""
        for snap, analysis in sorted(items, key=lambda it: it[0].captured.mono):
            self._update(snap, analysis)
        return self.view()  # drawn once, for the newest state

    def _update(self, snapshot: JobSnapshot, stack_analysis: StackView | None) -> None:
        before = self.detector.latest
        try:
            verdict = self.detector.update(snapshot, stack_analysis.round if stack_analysis is not None else None)
        except Exception as exc:  # a detector bug costs this snapshot, not the session
            self._errors = [*self._errors, f"fail-slow update failed: {type(exc).__name__}: {exc}"][-5:]
            return
        if verdict is not before:  # an old or repeated snapshot gives back the last verdict: no new round
            flags = tuple((f.detector, f.machine, f.alarmed) for f in verdict.flags)
            self._rounds.append(RoundFlags(verdict.at_mono, flags, verdict.machine, verdict.confident,
                                           verdict.confidence))
            del self._rounds[:-ROUNDS_KEPT]

    def view(self) -> FailSlowView:
        store = self.detector.store
        verdict = self.detector.latest
        if verdict is None or len(store) == 0:
            return FailSlowView(None, (), None, tuple(self._rounds), None, (), (), 0, tuple(self._errors))
        rank_steps = store.latest_rank_steps()
        job_step = float(np.median(list(rank_steps.values()))) if rank_steps else math.nan
        latest_machine = store.latest("step_time_s")
        missing = set(store.missing_machines)
        heat: list[HeatRow] = []
        for name in store.machines:
            ranks = store.ranks_of(name)
            ratios = tuple(rank_steps[r] / job_step if r in rank_steps and job_step > 0 else None for r in ranks)
            step = _finite(latest_machine.get(name, math.nan))
            ratio = step / job_step if step is not None and job_step > 0 else None
            heat.append(HeatRow(name, ranks, ratios, ratio, step, name not in missing))
        suspect = verdict.machine
        if suspect is None:
            known = [h for h in heat if h.ratio is not None]
            suspect = max(known, key=lambda h: h.ratio or 0.0).machine if known else None
        suspect_steps: tuple[float, ...] = ()
        peer_steps: tuple[float, ...] = ()
        _, machines, values = store.matrix("step_time_s", last=SPARK_POINTS)
        if suspect is not None and suspect in machines and values.size:
            col = machines.index(suspect)
            suspect_steps = tuple(float(x) for x in values[:, col])
            others = np.delete(values, col, axis=1)
            peers = [float(np.median(row[~np.isnan(row)])) if (~np.isnan(row)).any() else math.nan for row in others]
            peer_steps = tuple(peers)
        return FailSlowView(verdict, tuple(heat), _finite(job_step), tuple(self._rounds), suspect, suspect_steps,
                            peer_steps, verdict.rounds, tuple(self._errors))


def detectors_seen(rounds: Sequence[RoundFlags]) -> tuple[str, ...]:
    """The detectors in their fixed order, then any other name a round carried."""
    extra = sorted({d for r in rounds for d, _, _ in r.flags} - set(DETECTORS))
    return (*DETECTORS, *extra)


class FailSlowUpdated(Message):
    """The detectors took in new snapshots; a newer view replaces an undelivered older one."""

    def __init__(self, view: FailSlowView) -> None:
        super().__init__()
        self.view = view

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, FailSlowUpdated)


class FailSlowFeeder:
    """The app's side: queue snapshots in arrival order, one worker feeds them to the tracker in a thread.

    A recorded series is fed whole (``feed_series``): every snapshot is a
    round. Live (``feed``), the detectors may be slower than the polls (about
    2 s a snapshot at 16k ranks): then, of the polls that piled up, only the
    newest is taken in (captures always are: each is a stack-aggregation
    round), and the worker rests as long as its last batch took, so the
    detectors hold at most about half of the interpreter and the screen stays
    responsive. Skipped polls are counted and shown. ``idle`` is set whenever
    everything queued has been taken in (tests wait on it).
    """

    def __init__(self, app: App[object] | App[int], config: FailSlowConfig | None = None) -> None:
        self.app = app
        self.config = config
        self.tracker = FailSlowTracker(config)
        self._series = 0  # bumped by ``restart``: a batch taken in before it draws nothing
        self._pending: list[tuple[JobSnapshot, StackView | None, bool]] = []  # (snapshot, analysis, may be skipped)
        self._wake = asyncio.Event()
        self.idle = asyncio.Event()
        self.idle.set()
        self._started = False
        self.skipped = 0

    def feed(self, snapshot: JobSnapshot, stack_analysis: StackView | None = None) -> None:
        """A live poll (or capture, with its analysis)."""
        self._push([(snapshot, stack_analysis, stack_analysis is None)])

    def feed_series(self, items: Iterable[tuple[JobSnapshot, StackView | None]]) -> None:
        """A recorded series: every snapshot is taken in, as it was live.

        A lone snapshot (a hang bundle, a live job's first description) is
        left out: no detector can judge slowness from one point, and at 16k
        ranks it would cost seconds of work at the moment the screen opens.
        """
        batch = [(s, a, False) for s, a in items]
        if len(batch) > 1:
            self._push(batch)

    def restart(self) -> None:
        """The job restarted (an eviction, a hot-update): the detectors start a new series.

        What was queued belongs to the old processes and is dropped; a batch being taken in right now finishes
        on the old tracker and its view is not drawn."""
        self._series += 1
        self._pending = []
        self.tracker = FailSlowTracker(self.config)
        self.app.post_message(FailSlowUpdated(self.tracker.view()))  # view 7 and the header forget the old verdict

    def _push(self, batch: list[tuple[JobSnapshot, StackView | None, bool]]) -> None:
        if not batch:
            return
        self._pending.extend(batch)
        self.idle.clear()
        self._wake.set()
        if not self._started:
            self._started = True
            self.app.run_worker(self._run(), name="fail-slow detectors", group="failslow", exit_on_error=False)

    def _take(self) -> list[tuple[JobSnapshot, StackView | None]]:
        """What is pending, less the skippable polls that a newer snapshot makes stale."""
        batch, self._pending = self._pending, []
        keep: list[tuple[JobSnapshot, StackView | None]] = []
        for i, (snap, analysis, skippable) in enumerate(batch):
            if skippable and i < len(batch) - 1:
                self.skipped += 1
                continue
            keep.append((snap, analysis))
        return keep

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch = self._take()
            if batch:
                started = loop.time()
                series = self._series
                view = await asyncio.to_thread(self.tracker.feed_series, batch)
                if self.skipped:
                    view = replace(view, skipped=self.skipped)
                if series == self._series:
                    self.app.post_message(FailSlowUpdated(view))
                else:
                    # The old series' last view: drawn, it would bring back the old machines. The new series
                    # has nothing yet: an empty view, so view 7 shows the new start rather than the old verdict.
                    self.app.post_message(FailSlowUpdated(self.tracker.view()))
                took = loop.time() - started
                if took > 0.2:  # busy (a big job): rest as long, so the detectors take at most half the time
                    await asyncio.sleep(took)
            if not self._pending:
                self.idle.set()
