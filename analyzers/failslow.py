"""The combined fail-slow detector: one verdict from every slow-machine signal.

Each detector answers "which machine is slow?" in its own way, and each needs
its evidence to last before it counts, so bursts and spikes never alarm:

- ``step_time`` (step_time.py): a machine's step time above its peers' for ``step_window_s``.
- ``metrics`` (metric_outliers.py, Aegis §5.1): a host or GPU metric beyond λ±2δ of the peers for ``window_s``.
- ``minder`` (minder.py): the most dissimilar machine on the first metric (by Minder's priority) for ``continuity_s``.
- ``stacks`` (ByteRobust §5): stack-aggregation rounds, each flagging one parallel
  group; over the last ``rounds_needed`` rounds the most flagged group is the
  degrader, once it holds a clear majority of them (``rounds.tally``, the rule
  ``rankscope analyze`` applies too).
- ``ccl`` (Aegis §5.2): per-call CCL degradation findings (TD < α·mean: the
  late arriver computes slowly; N > β·mean: slow communication), kept over a
  rank's last calls on each communicator (it must be the one flagged in most
  of them: in a healthy job someone is always last), slow links narrowed to
  their common end. In a pipeline the slow rank's whole data-parallel replica
  arrives late at the gradient all-reduce, so this names the replica.
- ``p2p_wait`` (Aegis §4.2's computation side, over time): the rank whose
  pipeline peers keep an open send/recv naming it, poll after poll, far more
  often than the same place in the other replicas: it narrows the replica to
  the machine holding it up.
- ``samples`` (stack_samples.py): every rank's main thread sampled a few
  times a second without pausing it; the rank that rarely waits for others
  while its peers wait, by a binomial test whose confidence grows with the
  samples. It needs no counters, so it also works on a job that was not
  started with ``rankscope run``, and it is the one detector besides a full
  majority of stack rounds that may be confident alone (its confidence is a
  p-value, not a count).

The detectors' flags are counted into one confidence per machine by the vote (``failslow_vote``: agreement
raises it, alarms on other machines lower it, a suspect's confidence fades with a half-life); the verdict's words
are ``failslow_words``'s; the thresholds are ``failslow_config``'s. The counters' tally over calls is
``late_arrivals`` (with ``call_tally``); the pipeline's waits over polls are ``peer_waits``.

Everything is pure: times come from the snapshots, and the stack and CCL
findings are handed in by the caller (the live watcher, the TUI, a replay),
who runs those analyzers on the captures it has.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

from rankscope.analyzers.failslow_config import FailSlowConfig
from rankscope.analyzers.failslow_vote import (
    HOST_DETECTORS,
    DetectorFlag,
    FailSlowVerdict,
    Vote,
    contribution,
    suspects_of,
)
from rankscope.analyzers.failslow_words import Scene, slow_kind, summary
from rankscope.analyzers.findings import Suspect, Verdict, VerdictStatus
from rankscope.analyzers.labels import group_name, suspect_label
from rankscope.analyzers.late_arrivals import Blame, LateArrivals
from rankscope.analyzers.metric_outliers import MetricOutlierDetector, OutlierFinding
from rankscope.analyzers.minder import MinderDetector
from rankscope.analyzers.peer_waits import PeerWait, PeerWaitTally
from rankscope.analyzers.rounds import StackRound, required_flags, tally, try_stack_round
from rankscope.analyzers.series import RunTracker, SeriesStore
from rankscope.analyzers.stack_samples import (
    SampledWaitDetector,
    SampledWaitResult,
    sampling_problems,
    waits_in_its_send,
)
from rankscope.analyzers.step_time import StepTimeDetector, StepTrend
from rankscope.contract.snapshot import JobSnapshot, Layout


class FailSlowDetector:
    """Feed snapshots in time order; each ``update`` returns the combined verdict.

    ``stack_round``: one capture's stack round (``rounds.round_of`` of its
    ``analyze_job``), passed only on updates where stacks were captured. The
    CCL counters of each snapshot go through Aegis §5.2
    (``analyzers.degradation``, α and β from the config) here.
    """

    def __init__(self, config: FailSlowConfig | None = None, layout: Layout | None = None) -> None:
        self.config = config or FailSlowConfig()
        self.layout = layout  # names the parallel groups of a rank the sampled waits point at
        c = self.config
        self.samples = SampledWaitDetector(horizon_s=c.samples_horizon_s, odds_margin=c.samples_odds_margin,
                                           min_gap=c.samples_min_gap, min_samples=c.samples_min)
        self.store = SeriesStore(max_age_s=c.max_age_s)
        self.outliers = MetricOutlierDetector(window_s=c.window_s, k_sigma=c.k_sigma, rel_floor=c.rel_floor)
        self.minder = MinderDetector(window_points=c.minder_window_points, continuity_s=c.continuity_s,
                                     similarity_threshold=c.similarity_threshold, separation=c.separation)
        self.step_time = StepTimeDetector(window_s=c.step_window_s, ratio_threshold=c.step_ratio)
        self._stack_rounds: deque[Suspect | None] = deque(maxlen=max(1, c.rounds_needed))
        self.late = LateArrivals(c)
        self._waits = PeerWaitTally(c.p2p_window)
        self._wait_runs = RunTracker()
        self._history: deque[FailSlowVerdict] = deque(maxlen=c.history_len)
        self._updates = 0
        self._last: FailSlowVerdict | None = None
        self._trend: StepTrend | None = None
        self._stack_degrader: Suspect | None = None  # the group the stack rounds name, once alarmed
        self.vote = Vote(c)
        # rank -> its GPU on its machine and whether NVML said so (else assumed from its local rank)
        self._gpu_of: dict[int, tuple[int, bool]] = {}
        self._sampled: SampledWaitResult | None = None  # the wait test's last reading of every rank's samples
        self.on_device = False  # the job's collectives run on an accelerator (a device backend's communicator seen)
        self.sampling_problems: tuple[str, ...] = ()  # the last update's ranks whose sampling failed, with the fix

    @property
    def history(self) -> tuple[FailSlowVerdict, ...]:
        """Every update's verdict, oldest first (bounded by ``history_len``): the round-by-round record."""
        return tuple(self._history)

    @property
    def latest(self) -> FailSlowVerdict | None:
        return self._last

    # ---- the update ------------------------------------------------------

    def update(self, snapshot: JobSnapshot, stack_round: StackRound | None = None) -> FailSlowVerdict:
        if not self.store.add(snapshot) and self._last is not None:
            return self._last  # an old or repeated snapshot changes nothing
        self._updates += 1
        now = snapshot.captured.mono
        self._learn_gpus(snapshot)
        self.on_device = self.on_device or snapshot.collectives_on_device()
        flags: list[DetectorFlag] = []
        notes: list[str] = []
        flags += self._step_flags()
        flags += self._metric_flags()
        flags += self._minder_flags(notes)
        flags += self._stack_flags(stack_round)
        flags += self._ccl_flags(snapshot, notes)
        flags += self._p2p_flags(snapshot)
        flags += self._sample_flags(snapshot, notes)
        verdict = self._combine(flags, notes, now)
        self._history.append(verdict)
        self._last = verdict
        return verdict

    def _learn_gpus(self, snapshot: JobSnapshot) -> None:
        """Each rank's GPU: the one NVML saw its process on; on a machine with GPUs whose NVML did not place the
        process, its local rank (the launcher's usual choice, said to be assumed); on a machine without GPUs, none."""
        for m in snapshot.machines:
            on_gpus = m.gpus is not None and m.gpus.available
            for ri in m.ranks:
                if ri.gpu is not None:
                    self._gpu_of[ri.rank] = (ri.gpu, True)
                elif on_gpus:
                    self._gpu_of[ri.rank] = (ri.local_rank, False)
                elif m.reachable:
                    self._gpu_of.pop(ri.rank, None)

    # ---- per detector ----------------------------------------------------

    def _w(self, detector: str) -> float:
        w = self.config.weights.get(detector, 0.5)
        if self.on_device and detector in HOST_DETECTORS:
            return min(w, self.config.host_weight_on_device)
        return w

    def _step_flags(self) -> list[DetectorFlag]:
        res = self.step_time.update(self.store)
        self._trend = res.trend
        req = self.step_time.window_s
        return [DetectorFlag("step_time", f.machine, f.ranks, "step_time_s",
                             contribution(self._w("step_time"), f.held_s, req), f.evidence(), f.alarmed,
                             f.held_s, req, f.since_mono) for f in res.findings]

    def _metric_flags(self) -> list[DetectorFlag]:
        found: tuple[OutlierFinding, ...] = self.outliers.update(self.store)
        req = self.outliers.window_s
        return [DetectorFlag("metrics", f.machine, self.store.ranks_of(f.machine), f.metric,
                             contribution(self._w("metrics"), f.held_s, req), f.evidence(), f.alarmed,
                             f.held_s, req, f.since_mono) for f in found]

    def _minder_flags(self, notes: list[str]) -> list[DetectorFlag]:
        res = self.minder.update(self.store)
        notes += res.notes
        req = self.minder.continuity_s
        out = []
        for f in res.findings:
            # Only the alarm Minder raises (the first metric by priority) counts;
            # other metrics' candidates are shown but not counted, as in §4.4.
            counted = res.alarm is f
            out.append(DetectorFlag("minder", f.machine, self.store.ranks_of(f.machine), f.metric,
                                    contribution(self._w("minder"), f.held_s, req), f.evidence(), counted,
                                    f.held_s, req, f.since_mono))
        return out

    def _stack_flags(self, stack_round: StackRound | None) -> list[DetectorFlag]:
        needed = max(1, self.config.rounds_needed)
        if stack_round is not None:
            self._stack_rounds.append(stack_round.flagged)
        self._stack_degrader = None
        # The one rounds rule (rounds.tally), as `rankscope analyze` applies it to a recording.
        t = tally(self._stack_rounds, needed, self.config.stack_majority)
        if not t.counts:
            return []
        suspect, n = t.counts[0]
        alarmed = t.named
        self._stack_degrader = suspect if alarmed else None
        name = suspect_label(suspect)
        evidence = f"{name} flagged in {n} of the last {t.window} stack rounds"
        score = min(self._w("stacks") * n / needed, self._w("stacks"))
        required = float(required_flags(needed, self.config.stack_majority))  # flags needed in a full window
        out = []
        for m in suspect.machines or (None,):
            mine = suspect.ranks if m is None else tuple(r for r in suspect.ranks if r in self.store.ranks_of(m))
            out.append(DetectorFlag("stacks", m, mine or suspect.ranks, None, score, evidence, alarmed, float(n),
                                    required, None))
        return out

    def _without_pipeline_victims(self, targets: dict[str, Blame], notes: list[str]) -> dict[str, Blame]:
        """Late arrivers whose lateness is their wait on a pipeline peer's machine, left out with a note.

        The late-arriver test reads "spent least time in the collective" as
        "computed slowly before it"; but a rank whose pipeline peer is slow
        also reaches the collective late, having waited in its recv for that
        peer (the drill's slow rank 4 made rank 1 arrive last on its own
        data-parallel all-reduce, and view 7 alarmed on healthy machine-0).
        Such a machine's ranks had an open send/recv naming the other
        machine's ranks in most polls, far more often than the other way
        round: the slow one is the one waited on.
        """
        cfg = self.config
        polls = self._waits.polls()
        if polls < cfg.p2p_min_polls or not targets:
            return targets
        kept = dict(targets)
        for m in targets:
            mine = self.store.ranks_of(m)
            for other in self.store.machines:
                if other == m:
                    continue
                theirs = self.store.ranks_of(other)
                waited = self._waits.waits_on(mine, theirs)
                back = self._waits.waits_on(theirs, mine)
                if waited >= cfg.p2p_min_share * polls and waited >= cfg.p2p_ratio * max(1, back):
                    del kept[m]
                    notes.append(f"{m} arrives late at its collectives because it waits on {other}: its ranks "
                                 f"waited on {other}'s (open send/recv) in {waited} of the last {polls} polls, "
                                 f"{other}'s on it in {back}; not counted as slow compute")
                    break
        return kept

    def _ccl_flags(self, snapshot: JobSnapshot, notes: list[str]) -> list[DetectorFlag]:
        if not snapshot.all_counters():
            return []
        # Persistence is counted in collective calls here (see _ccl_targets):
        # a target is already persistent when it is returned. Half the weight
        # at half the window's bar, so a full window of late calls gives ~0.66:
        # the late-arriver test alone names a whole data-parallel replica and
        # must not be confident without another detector narrowing it.
        req_calls = float(max(1, math.ceil(self.config.ccl_fraction * self.config.ccl_calls_window / 2)))
        return [DetectorFlag("ccl", m, tuple(sorted(b.ranks)), None,
                             contribution(self._w("ccl"), float(b.calls), req_calls), b.evidence[0][1], True,
                             float(b.calls), req_calls, None, b.evidence, b.link_ranks)
                for m, b in self._ccl_targets(snapshot, notes).items()]

    def _ccl_targets(self, snapshot: JobSnapshot, notes: list[str]) -> dict[str, Blame]:
        """The counters' late arrivers and slow links (``late_arrivals``), less the machines that only wait on a
        pipeline peer's."""
        step = self._trend.step_s if self._trend is not None else None
        targets = self.late.targets(snapshot, step, self.store.rank_machine(), notes)
        return self._without_pipeline_victims(targets, notes)

    def _p2p_flags(self, snapshot: JobSnapshot) -> list[DetectorFlag]:
        counters = snapshot.all_counters()
        if not counters:
            return []
        cfg = self.config
        self._waits.add(counters)
        rank_machine = self.store.rank_machine()
        per_machine: dict[str, list[PeerWait]] = {}
        for w in self._waits.blamed(cfg.p2p_min_polls, cfg.p2p_min_share, cfg.p2p_ratio):
            m = rank_machine.get(w.rank)
            if m is not None:
                per_machine.setdefault(m, []).append(w)
        runs = self._wait_runs.update(snapshot.captured.mono, per_machine)
        req = cfg.p2p_hold_s
        out = []
        for m, ws in per_machine.items():
            run = runs[m]
            out.append(DetectorFlag("p2p_wait", m, tuple(sorted(w.rank for w in ws)), None,
                                    contribution(self._w("p2p_wait"), run.held_s, req),
                                    "; ".join(w.evidence() for w in sorted(ws, key=lambda w: -w.waited)),
                                    run.held_s >= req * 0.98, run.held_s, req, run.since,
                                    tuple((w.rank, w.evidence()) for w in sorted(ws, key=lambda w: -w.waited))))
        return out

    def _groups_of(self, snapshot: JobSnapshot, rank: int) -> str:
        """' (TP group 1, PP group 0, ...)' for a rank when the layout is known, else ''."""
        layout = self.layout or snapshot.layout
        if layout is None:
            return ""
        from rankscope.analyzers.topology import topology_for

        try:
            topo = topology_for(snapshot, layout)
            names = [group_name(k, (topo.group_index(rank, k),)) for k in topo.kinds()]
        except ValueError:
            return ""
        return f" ({', '.join(names)})" if names else ""

    def _sample_flags(self, snapshot: JobSnapshot, notes: list[str]) -> list[DetectorFlag]:
        windows = snapshot.all_samples()
        # The ranks the wait test cannot speak for, and why: a note here, an error line of the watch.
        self.sampling_problems = sampling_problems(windows)
        notes += self.sampling_problems
        if windows:
            self.samples.add(windows)
        result = self.samples.result()
        self._sampled = result
        cfg = self.config
        rank_machine = self.store.rank_machine()
        out = []
        for s in result.stragglers:
            m = rank_machine.get(s.rank)
            if m is None or s.p_value >= 0.5:
                continue
            # The score is the test's own confidence: it grows with the samples, not with a count of rounds.
            out.append(DetectorFlag("samples", m, (s.rank,), None, self._w("samples") * s.confidence,
                                    f"{s.evidence()}{self._groups_of(snapshot, s.rank)}",
                                    s.p_value <= cfg.samples_alarm_p, round(s.confidence, 6),
                                    1.0 - cfg.samples_alarm_p, None))
        return out

    # ---- combining -------------------------------------------------------

    # ---- combining -------------------------------------------------------

    def _combine(self, flags: list[DetectorFlag], notes: list[str], now: float) -> FailSlowVerdict:
        cfg = self.config
        ballot = self.vote.count(flags, self.on_device, now)
        stacks = self._stack_degrader
        named = suspects_of(ballot, stacks, self.store.ranks_of)
        suspects = [s for s, _lead in named]
        # C4's slow kind of the first suspect, from its strongest evidence
        kind = None
        if named:
            top, lead = named[0]
            # Its pipeline peers wait on its send/recv, and it waits as much as they do, in its send/recv: that is
            # what is slow.
            # The host's samples tell where a rank's time goes only where the collectives run on the host: on a
            # device every host waits at the same synchronisation call, the slow GPU's too.
            slow_send = ("p2p_wait" in top.sources and not self.on_device and self._sampled is not None
                         and waits_in_its_send(self._sampled, top.ranks))
            kind = slow_kind(lead, top.ranks, stacks.diverging_frame if stacks is not None else None, slow_send)
        trend = self._trend
        if self.store.missing_machines:
            notes.append(f"unreachable: {', '.join(self.store.missing_machines)}")
        if trend is not None and trend.step_s is not None:
            notes.append(trend.evidence())
        top_conf = ballot.top_confidence
        scene = Scene(cfg, self.store.ranks_of, self._gpu_of, len(self.store.reachable_machines), len(self.store))
        words = summary(scene, suspects, flags, top_conf, trend, top_conf >= cfg.confident_at, kind)
        verdict = Verdict(tuple(suspects), words, self.store.missing_ranks, tuple(notes),
                          status=VerdictStatus.NAMED if suspects else VerdictStatus.NO_VERDICT)
        return FailSlowVerdict(verdict, round(top_conf, 4), top_conf >= cfg.confident_at, tuple(flags),
                               ballot.slow_since(), self._updates, now, trend)


def replay(snapshots: Iterable[JobSnapshot], config: FailSlowConfig | None = None,
           layout: Layout | None = None) -> tuple[FailSlowVerdict, ...]:
    """Run the detector over a recorded series (a bundle from ``rankscope watch --record``), oldest first.

    Snapshots that carry stacks (the watch's captures) also make a stack
    aggregation round, as they did live. Returns every update's verdict.
    """
    detector = FailSlowDetector(config)
    out = []
    for snap in sorted(snapshots, key=lambda s: s.captured.mono):
        out.append(detector.update(snap, try_stack_round(snap, layout)[0]))
    return tuple(out)

