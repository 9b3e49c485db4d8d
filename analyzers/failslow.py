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

Confidence. A detector that has alarmed on a machine contributes
``w·(1 − ½^(held/required))``: half its weight when it first alarms, more the
longer it lasts. Contributions of different detectors on the same machine
combine as independent evidence, ``1 − Π(1 − c)``, so agreement raises the
confidence faster than any one detector can. Detectors that alarm on *other*
machines lower it (``× (1 − ½·c_other)``). One detector alone tops out at its
weight (below ``confident_at`` for the weaker ones); two agreeing pass it.

While a machine stays a suspect, its confidence fades with a half-life
(``confidence_half_life_s``) rather than dropping with one weaker round; a
machine no detector alarms on any more stops being a suspect at once.

Everything is pure: times come from the snapshots, and the stack and CCL
findings are handed in by the caller (the live watcher, the TUI, a replay),
who runs those analyzers on the captures it has.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from rankscope.analyzers.degradation import compared_ops, degradation_findings, inverse_throughput
from rankscope.analyzers.findings import Suspect, SuspectKind, Verdict, VerdictStatus
from rankscope.analyzers.labels import group_name, suspect_label
from rankscope.analyzers.metric_outliers import MetricOutlierDetector, OutlierFinding
from rankscope.analyzers.minder import MinderDetector
from rankscope.analyzers.rounds import DEFAULT_MAJORITY, StackRound, required_flags, tally, try_stack_round
from rankscope.analyzers.series import RunTracker, SeriesStore
from rankscope.analyzers.stack_samples import MIN_GAP, ODDS_MARGIN, SampledWaitDetector, sampling_problems
from rankscope.analyzers.step_time import StepTimeDetector, StepTrend
from rankscope.analyzers.topology import joined_counters
from rankscope.contract.frames import is_communication
from rankscope.contract.ranks import compact_ranks
from rankscope.contract.snapshot import JobSnapshot, Layout, RankCounters
from rankscope.contract.vocabulary import is_point_to_point

DETECTORS: tuple[str, ...] = ("step_time", "metrics", "minder", "stacks", "ccl", "p2p_wait", "samples")

# How much one detector alone is trusted. Step time, stacks and the CCL
# counters watch the training itself; host/GPU metrics only correlate with it.
DEFAULT_WEIGHTS: dict[str, float] = {"step_time": 0.75, "metrics": 0.6, "minder": 0.6, "stacks": 0.8, "ccl": 0.8,
                                     "p2p_wait": 0.6, "samples": 0.9}


@dataclass(frozen=True, slots=True)
class FailSlowConfig:
    """Thresholds, in drill-sized defaults (the papers' production values in comments)."""

    window_s: float = 30.0  # Aegis T (10 min in production)
    continuity_s: float = 20.0  # Minder continuity (4 min in production)
    step_window_s: float = 20.0  # how long a machine's step time must stay above its peers'
    k_sigma: float = 2.0  # Aegis λ + kδ
    rel_floor: float = 0.05  # smallest δ as a fraction of λ
    minder_window_points: int = 8  # Minder w
    similarity_threshold: float = 0.10  # Minder: smallest relative distance that makes a candidate
    separation: float = 1.5  # Minder: candidate's distance over the runner-up's
    step_ratio: float = 1.2  # step time this many times the peers' is "slow"
    alpha: float = 0.8  # Aegis §5.2 TD < α·mean: the late arriver (the plugin keeps N over the last L=5 requests)
    beta: float = 1.5  # Aegis §5.2 N > β·mean: a slow link
    rounds_needed: int = 5  # ByteRobust: rounds of stack aggregation before naming the degrader
    stack_majority: float = DEFAULT_MAJORITY  # the degrader is flagged in more than this share of the rounds (rounds.tally)
    ccl_calls_window: int = 20  # a rank's last collective calls (per communicator) that are tallied
    ccl_min_calls: int = 15  # calls seen before a rank can be blamed
    ccl_fraction: float = 0.8  # share of its calls in which a rank must be flagged
    ccl_min_lateness_s: float = 0.005  # a late arrival counts only if this much later than the mean...
    ccl_min_lateness_share: float = 0.05  # ...and this share of the job's step time, when known
    ccl_waited_share: float = 0.2  # a blamed rank late in this share of its calls on a group another waited in
    p2p_window: int = 30  # polls over which pipeline peers' waits are counted
    p2p_min_polls: int = 20  # polls seen before a rank can be blamed for its peers' waits
    p2p_min_share: float = 0.5  # share of those polls in which some peer waited on it
    p2p_ratio: float = 2.5  # ...and this many times as often as on its data-parallel peers
    p2p_hold_s: float = 10.0  # how long that must last before it alarms (one flickering poll must not)
    samples_horizon_s: float = 45.0  # sampled windows kept for the wait test (the agents' clocks)
    samples_odds_margin: float = ODDS_MARGIN  # the null: a rank's odds of waiting at least this share of its peers'...
    samples_min_gap: float = MIN_GAP  # ...and its waiting share no more than this far below theirs
    samples_min: int = 20  # samples of a rank before it is tested
    samples_alarm_p: float = 0.001  # corrected p-value below which the wait test alarms
    confident_at: float = 0.7
    # On a job whose collectives run on an accelerator every host waits at the same synchronisation call and a
    # pipeline's last stage always stands apart: the host's stacks (rounds and samples) are one vote, held below
    # ``confident_at``, that the device's evidence (the counters' TD and N) or the step time must confirm.
    host_weight_on_device: float = 0.6
    confidence_half_life_s: float = 30.0  # how fast a suspect's confidence fades while weaker evidence still names it
    history_len: int = 600
    max_age_s: float = 900.0  # how much series history to keep
    weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))


def config_for(window_s: float, continuity_s: float, rounds_needed: int) -> FailSlowConfig:
    """The detectors' config from the three knobs a person sets (``watch`` and ``attach``): Aegis T, Minder's
    continuity and ByteRobust's rounds; a machine's step time must stay slow for the shorter of the first two."""
    return FailSlowConfig(window_s=window_s, continuity_s=continuity_s, step_window_s=min(window_s, continuity_s),
                          rounds_needed=rounds_needed)


@dataclass(frozen=True, slots=True)
class DetectorFlag:
    """One detector's view of one machine in one update.

    ``score`` is that detector's confidence, 0..1; it counts toward the verdict
    only once ``alarmed`` (the evidence has lasted long enough). A flag that is
    not alarmed is a candidate the TUI can show as "watching".
    """

    detector: str
    machine: str | None
    ranks: tuple[int, ...]
    metric: str | None
    score: float
    evidence: str
    alarmed: bool = False
    held: float = 0.0  # how long the evidence has lasted: seconds; for "stacks" rounds flagged, for "ccl" calls flagged
    required: float = 0.0  # how much it must last to alarm, same unit
    since_mono: float | None = None


@dataclass(frozen=True, slots=True)
class FailSlowVerdict:
    """The combined answer after one update, with every detector's flags."""

    verdict: Verdict
    confidence: float  # 0..1, for the top suspect
    confident: bool
    flags: tuple[DetectorFlag, ...]
    slow_since_mono: float | None  # when the top suspect's earliest alarmed evidence began
    rounds: int  # updates (snapshots) taken in so far
    at_mono: float | None = None  # the snapshot time this verdict is for
    trend: StepTrend | None = None

    @property
    def machine(self) -> str | None:
        """The first machine of the top suspect (the best supported one of its group)."""
        top = self.verdict.top
        return top.machines[0] if top is not None and top.machines else None

    @property
    def machines(self) -> tuple[str, ...]:
        """All machines of the top suspect: one, or a whole flagged group to over-evict."""
        top = self.verdict.top
        return top.machines if top is not None else ()

    def key(self) -> tuple[object, ...]:
        """What a watcher compares to tell a *change* of verdict from the same one repeated."""
        top = self.verdict.top
        return (top.machines if top else None, top.sources if top else None, self.confident,
                round(self.confidence, 1), self.verdict.missing_ranks)


def _contribution(weight: float, held: float, required: float) -> float:
    if required <= 0:
        return weight
    return float(weight * (1.0 - math.pow(0.5, held / required)))


def narrow_to_common_end(groups: Sequence[Iterable[int]]) -> tuple[int, ...]:
    """The ranks present in more of the slow groups (links, communicators) than any other.

    Aegis §5.2 narrows the GPUs that suffer slow communication to the source or
    destination they share, like RootDiag in its Algorithm 1: if G is the
    culprit, every slow link touches G. Returns () when no rank is in two of
    the groups, which points at the network rather than a host.
    """
    sets = [set(g) for g in groups if g]
    if len(sets) < 2:
        return tuple(sorted(sets[0])) if sets else ()
    counts = Counter(r for s in sets for r in s)
    best = max(counts.values())
    if best < 2:
        return ()
    return tuple(sorted(r for r, c in counts.items() if c == best))


K = TypeVar("K", bound=Hashable)


class _CallTally(Generic[K]):
    """Per key (a rank, a rank on a communicator): was it flagged, in each of its last calls?

    A call is counted once, however many polls still show it as the latest.
    """

    def __init__(self, window: int, remember: int = 4096) -> None:
        self.window = window
        self._marks: dict[K, deque[bool]] = {}
        self._seen: dict[tuple[object, ...], None] = {}  # insertion-ordered, bounded
        self._remember = remember

    def add(self, call: tuple[object, ...], members: Iterable[K], flagged: set[K]) -> None:
        if call in self._seen:
            return
        self._seen[call] = None
        if len(self._seen) > self._remember:
            del self._seen[next(iter(self._seen))]
        for k in members:
            self._marks.setdefault(k, deque(maxlen=self.window)).append(k in flagged)

    def hits(self, key: K) -> tuple[int, int]:
        """(flagged, seen) over the key's last calls; (0, 0) for a key never seen."""
        marks = self._marks.get(key)
        return (sum(marks), len(marks)) if marks else (0, 0)

    def tallied(self) -> Iterable[K]:
        """Every key seen."""
        return self._marks.keys()

    def persistent(self, min_calls: int, fraction: float) -> dict[K, tuple[int, int]]:
        """Keys flagged in at least ``fraction`` of their last calls (at least ``min_calls`` seen): (hits, calls)."""
        out: dict[K, tuple[int, int]] = {}
        for k, marks in self._marks.items():
            hits = sum(marks)
            if len(marks) >= min_calls and hits >= fraction * len(marks):
                out[k] = (hits, len(marks))
        return out


def collective_calls(counters: Mapping[int, RankCounters]) -> dict[tuple[str, str], tuple[int, list[int], list[int]]]:
    """Per (communicator, collective op): the call most members last completed, and who has TD / N for it.

    The same ops as ``degradation.degradation_findings`` (``compared_ops``:
    members compared on one call), so the ranks tallied are the ranks that
    analysis compared.
    """
    rows: dict[tuple[str, str], dict[int, tuple[int, bool, bool]]] = {}
    for r, o in compared_ops(counters):
        has_td = o.last_duration_s is not None and o.last_duration_s > 0
        has_n = inverse_throughput(o.recent_throughput) is not None
        rows.setdefault((o.comm_id, o.op), {})[r] = (o.wc, has_td, has_n)
    out: dict[tuple[str, str], tuple[int, list[int], list[int]]] = {}
    for key, per_rank in rows.items():
        counts = Counter(v[0] for v in per_rank.values())
        call = max(counts, key=lambda c: (counts[c], c))
        same = {r: v for r, v in per_rank.items() if v[0] == call}
        out[key] = (call, sorted(r for r, v in same.items() if v[1]), sorted(r for r, v in same.items() if v[2]))
    return out


@dataclass(frozen=True, slots=True)
class PeerWait:
    """A rank its pipeline peers keep waiting on, against its data-parallel peers."""

    rank: int
    waited: int  # polls in which some peer had an open send/recv naming it
    polls: int
    peers_mean: float  # the same count, averaged over its data-parallel peers
    peers: tuple[int, ...]

    @property
    def ratio(self) -> float:
        return self.waited / self.peers_mean if self.peers_mean > 0 else math.inf

    def evidence(self) -> str:
        against = (f"{self.ratio:.1f}× its data-parallel peers (rank {_ranges(self.peers)}: "
                   f"{self.peers_mean:.0f})" if self.peers_mean > 0 else
                   f"never its data-parallel peers (rank {_ranges(self.peers)})")
        return f"peers waited on rank {self.rank} (open send/recv) in {self.waited} of the last {self.polls} polls, {against}"


class PeerWaitTally:
    """Who the pipeline keeps waiting on, poll after poll (Aegis §4.2's computation side, over time).

    An open point-to-point request on rank A naming peer B means A is waiting
    for B's side of the transfer: B has not launched it yet. In a healthy
    pipeline every stage waits on its neighbours part of the time, and the
    ranks at the same place of the other data-parallel replicas (its
    ``DATA_PARALLEL_GROUP``) are waited on about as often. A rank that
    computes, sends or is fed slowly is waited on far more often than they
    are: its own replica's other stage stalls on it step after step. Counting
    this per poll narrows a slow replica (which the collectives' late-arriver
    test sees as a whole) to the rank holding it up. Without recorded
    data-parallel groups, all other ranks are the peers; with one recorded
    but no replica (DP=1) nobody is compared and nobody blamed.
    """

    def __init__(self, window: int) -> None:
        self._polls: deque[set[int]] = deque(maxlen=max(1, window))
        self._pairs: deque[set[tuple[int, int]]] = deque(maxlen=max(1, window))  # (waiter, waited on) per poll
        self._dp: dict[int, tuple[int, ...]] = {}
        self._ranks: set[int] = set()

    def add(self, counters: Mapping[int, RankCounters]) -> None:
        waited: set[int] = set()
        pairs: set[tuple[int, int]] = set()
        for r, rc in counters.items():
            if rc.error is not None or rc.stale:
                continue
            self._ranks.add(r)
            for c in rc.communicators:
                if "DATA_PARALLEL" in c.description.upper() and r in c.ranks:
                    self._dp[r] = tuple(x for x in c.ranks if x != r)
            for o in rc.ops:
                if is_point_to_point(o.op):
                    waited.update(p for p in o.open_peers if p != r)
                    pairs.update((r, p) for p in o.open_peers if p != r)
        self._polls.append(waited)
        self._pairs.append(pairs)

    def polls(self) -> int:
        return len(self._polls)

    def waits_on(self, waiters: Collection[int], waited: Collection[int]) -> int:
        """Polls in which some rank of ``waiters`` had an open send/recv naming a rank of ``waited``."""
        return sum(1 for pairs in self._pairs if any(a in waiters and b in waited for a, b in pairs))

    def blamed(self, min_polls: int, min_share: float, ratio: float) -> list[PeerWait]:
        polls = len(self._polls)
        if polls < min_polls:
            return []
        counts = Counter(r for waited in self._polls for r in waited)
        # It must still be so now: a burst early in the window must not carry
        # a rank over the bar after the burst is over.
        recent = list(self._polls)[-max(5, polls // 3):]
        now = Counter(r for waited in recent for r in waited)
        out = []
        for r in sorted(self._ranks):
            # A recorded data-parallel group without other members (DP=1) has no replica to compare with: in a
            # pipeline one stage's ranks are always waited on more than the other's (on a GPU job a recv posted
            # ahead stays open on the device), which compared with all ranks blamed a healthy first stage.
            peers = self._dp[r] if r in self._dp else tuple(x for x in sorted(self._ranks) if x != r)
            if not peers:
                continue
            mean = sum(counts.get(p, 0) for p in peers) / len(peers)
            n = counts.get(r, 0)
            if n >= min_share * polls and n >= ratio * mean and now.get(r, 0) >= min_share * len(recent):
                out.append(PeerWait(r, n, polls, mean, peers))
        return out


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
        self._late: _CallTally[tuple[str, int]] = _CallTally(c.ccl_calls_window)
        self._links: _CallTally[tuple[str, int]] = _CallTally(c.ccl_calls_window)
        self._late_example: dict[int, str] = {}
        self._waits = PeerWaitTally(c.p2p_window)
        self._wait_runs = RunTracker()
        self._history: deque[FailSlowVerdict] = deque(maxlen=c.history_len)
        self._updates = 0
        self._last: FailSlowVerdict | None = None
        self._trend: StepTrend | None = None
        self._stack_degrader: Suspect | None = None  # the group the stack rounds name, once alarmed
        self._confidence: dict[str, tuple[float, float]] = {}  # machine -> (confidence, at), for the hysteresis
        # rank -> its GPU on its machine and whether NVML said so (else assumed from its local rank)
        self._gpu_of: dict[int, tuple[int, bool]] = {}
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
        if self.on_device and detector in _HOST_DETECTORS:
            return min(w, self.config.host_weight_on_device)
        return w

    def _step_flags(self) -> list[DetectorFlag]:
        res = self.step_time.update(self.store)
        self._trend = res.trend
        req = self.step_time.window_s
        return [DetectorFlag("step_time", f.machine, f.ranks, "step_time_s",
                             _contribution(self._w("step_time"), f.held_s, req), f.evidence(), f.alarmed,
                             f.held_s, req, f.since_mono) for f in res.findings]

    def _metric_flags(self) -> list[DetectorFlag]:
        found: tuple[OutlierFinding, ...] = self.outliers.update(self.store)
        req = self.outliers.window_s
        return [DetectorFlag("metrics", f.machine, self.store.ranks_of(f.machine), f.metric,
                             _contribution(self._w("metrics"), f.held_s, req), f.evidence(), f.alarmed,
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
                                    _contribution(self._w("minder"), f.held_s, req), f.evidence(), counted,
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

    def _ccl_targets(self, snapshot: JobSnapshot, notes: list[str]) -> dict[str, tuple[tuple[int, ...], str, int]]:
        """Aegis §5.2 on the counters, kept over calls: machine -> (ranks, evidence, flagged calls).

        In a healthy job *someone* arrives last at every collective; what marks
        a slow computer is being the late arriver (TD < α·mean) call after call.
        So each distinct call (seen once, however many polls show it) is
        tallied per communicator and member, and a rank is blamed once it was
        flagged in at least ``ccl_fraction`` of its last ``ccl_calls_window``
        calls on one communicator (and ``ccl_min_calls`` of them). Per
        communicator, because a rank's communicators tell different stories:
        the slow rank's whole data-parallel replica arrives late at the
        gradient all-reduce every step, while inside its tensor-parallel
        group only the calls right after its slow compute are late; mixed
        together, neither would reach the bar.

        Slow links (N > β·mean) are tallied the same way per communicator, then
        narrowed to the rank the slow communicators share, the source or
        destination every slow link touches (RootDiag's idea); links that
        share no rank point at the network and only make a note. N here is
        measured per request including any wait for the peers, so on a call
        where some member arrived late the others' low throughput is that
        wait, not their link: such calls are not counted as slow links.
        """
        # one row per collective: the plugin's NCCL communicators joined into the shim's groups
        counters = joined_counters(snapshot.all_counters())
        if not counters:
            return {}
        cfg = self.config
        found = degradation_findings(counters, cfg.alpha, cfg.beta)
        # Lateness that is a sliver of a step (a millisecond on a tiny
        # collective) is scheduling noise, not a slow computer.
        step = self._trend.step_s if self._trend is not None else None
        floor = max(cfg.ccl_min_lateness_s, cfg.ccl_min_lateness_share * step if step else 0.0)
        late = {(f.comm_id, f.op, f.rank): f for f in found if f.kind == "slow_compute" and f.mean - f.value >= floor}
        waited = {(f.comm_id, f.op) for f in found if f.kind == "slow_compute"}
        slow = {(f.comm_id, f.op, f.rank) for f in found if f.kind == "slow_link" and (f.comm_id, f.op) not in waited}
        for (comm, op), (call, with_td, with_n) in collective_calls(counters).items():
            self._late.add((comm, op, call), [(comm, r) for r in with_td],
                           {(comm, r) for r in with_td if (comm, op, r) in late})
            self._links.add((comm, op, call), [(comm, r) for r in with_n],
                            {(comm, r) for r in with_n if (comm, op, r) in slow})
        for f in late.values():
            self._late_example[f.rank] = f.evidence()
        rank_machine = self.store.rank_machine()
        targets: dict[str, tuple[tuple[int, ...], str, int]] = {}

        def blame(rank: int, evidence: str, calls: int) -> None:
            m = rank_machine.get(rank)
            if m is None:
                return
            ranks, first, most = targets.get(m, ((), evidence, 0))
            if rank not in ranks:
                targets[m] = ((*ranks, rank), first, max(most, calls))

        persistent = self._late.persistent(cfg.ccl_min_calls, cfg.ccl_fraction)
        victims = self._late_victims({rank for _comm, rank in persistent})
        for (comm, rank), (hits, seen) in sorted(persistent.items(), key=lambda kv: (-kv[1][0], kv[0])):
            why = victims.get(rank)
            if why is not None:
                if why not in notes:
                    notes.append(why)
                continue
            blame(rank, f"rank {rank} arrived last in {hits} of its last {seen} collectives on comm {comm} "
                        f"(TD < {cfg.alpha:g}·mean); latest: {self._late_example.get(rank, '-')}", hits)
        links: dict[str, set[int]] = {}
        hits_of: dict[int, int] = {}
        for (comm, rank), (hits, _seen) in self._links.persistent(cfg.ccl_min_calls, cfg.ccl_fraction).items():
            links.setdefault(comm, set()).add(rank)
            hits_of[rank] = max(hits_of.get(rank, 0), hits)
        if links:
            ends = narrow_to_common_end(list(links.values()))
            if ends:
                for r in ends:
                    blame(r, f"slow links (N > {cfg.beta:g}·mean) on {len(links)} communicator(s) share rank "
                             f"{_ranges(ends)}", hits_of.get(r, 0))
            else:
                notes.append(f"slow links on {len(links)} communicators share no rank: look at the network")
        return self._without_pipeline_victims(targets, notes)

    def _late_victims(self, blamed: set[int]) -> dict[int, str]:
        """Late arrivers whose lateness is their wait on another blamed rank in a group they share: rank -> note.

        A rank that waits on a slow peer in one collective reaches its next collective late too: with rank 5
        slow, its TP peer rank 4 waits in their TP all-reduce (its TD there is long, rank 5's short) and then both
        come last to their own data-parallel all-reduces, so the tally blamed rank 4 beside rank 5. Rank r is such
        a victim of rank s when, over their last calls on a communicator both belong to, s arrived last in at
        least ``ccl_waited_share`` of its calls and r in fewer than half as many as s (r waited there). Two
        ranks each the other's victim on different groups stay blamed: nothing says which one waited first.
        """
        cfg = self.config
        members: dict[str, list[int]] = {}
        for comm, rank in self._late.tallied():
            members.setdefault(comm, []).append(rank)
        waited: dict[int, list[tuple[int, str, int, int, int]]] = {}  # r -> (s, comm, s's hits, s's calls, r's hits)
        for comm, ranks in sorted(members.items()):
            for s in ranks:
                s_hits, s_calls = self._late.hits((comm, s))
                if s not in blamed or s_hits < max(2, cfg.ccl_waited_share * s_calls):
                    continue
                for r in ranks:
                    r_hits = self._late.hits((comm, r))[0]
                    if r != s and r in blamed and 2 * r_hits < s_hits:
                        waited.setdefault(r, []).append((s, comm, s_hits, s_calls, r_hits))
        out: dict[int, str] = {}
        for r, edges in sorted(waited.items()):
            for s, comm, s_hits, s_calls, r_hits in edges:
                if any(back[0] == r for back in waited.get(s, ())):
                    continue  # each waited on the other somewhere
                out[r] = (f"rank {r} arrives late at its collectives because it waits on rank {s}: on comm {comm} "
                          f"rank {s} arrived last in {s_hits} of its last {s_calls} calls, rank {r} in {r_hits}; "
                          "not counted as slow compute")
                break
        return out

    def _without_pipeline_victims(self, targets: dict[str, tuple[tuple[int, ...], str, int]],
                                  notes: list[str]) -> dict[str, tuple[tuple[int, ...], str, int]]:
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
        return [DetectorFlag("ccl", m, tuple(sorted(ranks)), None,
                             _contribution(self._w("ccl"), float(calls), req_calls), ev, True, float(calls),
                             req_calls, None)
                for m, (ranks, ev, calls) in self._ccl_targets(snapshot, notes).items()]

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
                                    _contribution(self._w("p2p_wait"), run.held_s, req),
                                    "; ".join(w.evidence() for w in sorted(ws, key=lambda w: -w.waited)),
                                    run.held_s >= req * 0.98, run.held_s, req, run.since))
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

    def _combine(self, flags: list[DetectorFlag], notes: list[str], now: float) -> FailSlowVerdict:
        cfg = self.config
        alarmed = [f for f in flags if f.alarmed and f.machine is not None]
        per_machine: dict[str, dict[str, DetectorFlag]] = {}
        for f in alarmed:
            assert f.machine is not None
            best = per_machine.setdefault(f.machine, {})
            if f.detector not in best or f.score > best[f.detector].score:
                best[f.detector] = f  # one vote per detector: its strongest metric
        if self.on_device:  # the host's stacks are one vote there (see host_weight_on_device)
            for by_det in per_machine.values():
                host = sorted((by_det[d] for d in _HOST_DETECTORS if d in by_det), key=lambda f: -f.score)
                for weaker in host[1:]:
                    del by_det[weaker.detector]
        confidence: dict[str, float] = {}
        for m, by_det in per_machine.items():
            miss = 1.0
            for f in by_det.values():
                miss *= 1.0 - f.score
            conf = 1.0 - miss
            for det in DETECTORS:
                if det in by_det:
                    continue
                against = max((o[det].score for om, o in per_machine.items() if om != m and det in o), default=0.0)
                conf *= 1.0 - 0.5 * against
            # Hysteresis: while a machine stays a suspect its confidence fades with
            # a half-life instead of dropping when one round is weaker (a stack
            # round at 2 of 3, a metric dipping back for a sample).
            prev = self._confidence.get(m)
            if prev is not None and cfg.confidence_half_life_s > 0:
                conf = max(conf, prev[0] * 0.5 ** ((now - prev[1]) / cfg.confidence_half_life_s))
            confidence[m] = conf
        self._confidence = {m: (c, now) for m, c in confidence.items()}
        # Ties (the machines of one flagged parallel group) go to the machine
        # with more evidence still building up (candidates of other detectors).
        support: dict[str, float] = {}
        for f in flags:
            if not f.alarmed and f.machine is not None and f.required > 0:
                support[f.machine] = support.get(f.machine, 0.0) + min(1.0, f.held / f.required)
        order = sorted(confidence, key=lambda m: (-round(confidence[m], 6), -support.get(m, 0.0), m))
        # Machines with the very same evidence (one stack group, one communicator)
        # are one suspect: ByteRobust evicts the group, not one of its machines.
        merged: list[list[str]] = []
        index: dict[tuple[object, ...], int] = {}
        for m in order:
            key = (round(confidence[m], 6), tuple(sorted((d, f.evidence) for d, f in per_machine[m].items())))
            if key in index:
                merged[index[key]].append(m)
            else:
                index[key] = len(merged)
                merged.append([m])
        suspects = []
        kinds: list[str] = []  # C4's slow kind of each suspect, from its strongest evidence
        for ms in merged:
            by_det = per_machine[ms[0]]
            ranked = sorted(by_det.values(), key=lambda f: -f.score)
            ranks = _narrowest([f.ranks for m in ms for f in per_machine[m].values()]) or tuple(
                r for m in ms for r in self.store.ranks_of(m))
            evidence = tuple(f"[{f.detector}] {f.evidence}" for f in ranked)
            sources = tuple(f.detector for f in ranked)
            group = self._stack_degrader
            if len(ms) > 1 and group is not None and "stacks" in by_det and set(ms) <= set(group.machines):
                suspects.append(Suspect(group.kind, group.ranks, tuple(ms), round(confidence[ms[0]], 4), evidence,
                                        sources, group.group_index, group.diverging_frame, roots=group.roots))
                kinds.append(slow_kind(ranked[0], group.diverging_frame))
            else:
                suspects.append(Suspect(SuspectKind.MACHINE, ranks, tuple(ms), round(confidence[ms[0]], 4), evidence,
                                        sources))
                stacks = self._stack_degrader
                kinds.append(slow_kind(ranked[0], stacks.diverging_frame if stacks is not None else None))
        trend = self._trend
        if self.store.missing_machines:
            notes.append(f"unreachable: {', '.join(self.store.missing_machines)}")
        if trend is not None and trend.step_s is not None:
            notes.append(trend.evidence())
        top_conf = confidence[order[0]] if order else 0.0
        slow_since = None
        if order:
            starts = [f.since_mono for f in per_machine[order[0]].values() if f.since_mono is not None]
            slow_since = min(starts) if starts else None
        summary = self._summary(suspects, flags, top_conf, trend, top_conf >= cfg.confident_at,
                                kinds[0] if kinds else None)
        verdict = Verdict(tuple(suspects), summary, self.store.missing_ranks, tuple(notes),
                          status=VerdictStatus.NAMED if suspects else VerdictStatus.NO_VERDICT)
        return FailSlowVerdict(verdict, round(top_conf, 4), top_conf >= cfg.confident_at, tuple(flags), slow_since,
                               self._updates, now, trend)

    def _gpu_words(self, top: Suspect) -> str:
        """The counters' unit is the rank and its GPU: ``rank 5 (GPU 5) on m0`` when their evidence names fewer
        ranks than the machine holds (several GPUs of one machine, or a one-machine job); "" otherwise."""
        if not set(top.sources) & _DEVICE_DETECTORS or len(top.machines) != 1:
            return ""
        if set(top.ranks) >= set(self.store.ranks_of(top.machines[0])):
            return ""
        return f"{', '.join(self._rank_gpu(r) for r in top.ranks)} on {top.machines[0]}"

    def _rank_gpu(self, rank: int) -> str:
        """``rank 5 (GPU 2)`` where NVML placed its process, ``rank 5 (GPU 5, assumed from its local rank)`` on a
        machine with GPUs where it did not, ``rank 5`` without GPUs."""
        gpu = self._gpu_of.get(rank)
        if gpu is None:
            return f"rank {rank}"
        return f"rank {rank} (GPU {gpu[0]})" if gpu[1] else f"rank {rank} (GPU {gpu[0]}, assumed from its local rank)"

    def _summary(self, suspects: list[Suspect], flags: list[DetectorFlag], conf: float, trend: StepTrend | None,
                 confident: bool = True, c4_kind: str | None = None) -> str:
        if suspects:
            top = suspects[0]
            lead = top.evidence[0] if top.evidence else ""
            where = "" if top.kind is SuspectKind.MACHINE else f" on {', '.join(top.machines)}"
            name = self._gpu_words(top) or f"{suspect_label(top)}{where}"
            kind = f" ({c4_kind})" if c4_kind else ""
            if not confident:
                # below the bar it is a suspicion, worded as one: never a verdict line
                return (f"suspect, not a verdict: {name}{kind} — {lead}; confidence {conf:.2f} from "
                        f"{'+'.join(top.sources)}, below the {self.config.confident_at:.2f} bar")
            return (f"fail-slow: {name}{kind} — {lead}; "
                    f"confidence {conf:.2f} from {'+'.join(top.sources)}")
        if flags:
            f = max(flags, key=lambda x: x.held / x.required if x.required else 0.0)
            unit = {"stacks": f" of {self.config.rounds_needed} rounds", "ccl": " calls",
                    "samples": " confidence"}.get(f.detector, "s")
            return f"watching: {f.machine} [{f.detector}] {f.evidence} (alarms at {f.required:g}{unit})"
        n = len(self.store.reachable_machines)
        if len(self.store) == 0 or n == 0:
            return "no fail-slow verdict: no machine answered"
        if trend is not None and trend.ratio is not None and trend.ratio >= self.config.step_ratio:
            return f"job slower ({trend.evidence()}) but no machine stands out among {n}"
        if n == 1:
            return "no fail-slow: 1 machine answered, no peers to compare it with"
        return f"no fail-slow: {n} machines alike"


_DEVICE_DETECTORS = frozenset({"ccl", "p2p_wait"})  # the counters': they name ranks, not machines
_HOST_DETECTORS = frozenset({"stacks", "samples"})  # what the host's Python stacks show


def _narrowest(rank_sets: Iterable[Iterable[int]]) -> tuple[int, ...]:
    """The ranks every detector on a suspect names, when they share any (the stacks' group and the counters' late
    arriver in it: the rank); else all they name (they disagree, and none is dropped)."""
    sets = [set(rs) for rs in rank_sets if rs]
    if not sets:
        return ()
    common = set.intersection(*sets)
    return tuple(sorted(common or set.union(*sets)))


# Interconnect throughput: a host or GPU metric whose outlier is a link's, not a computer's
_LINK_METRICS = frozenset({"gpu_pcie_kbps", "gpu_nvlink_kbps"})


def slow_kind(lead: DetectorFlag, frame: str | None = None) -> str:
    """Which of C4's two slow kinds a suspect's strongest evidence (``lead``) shows, from the device or the host.

    Communication slow: a slow link (the counters' N > β·mean), an interconnect metric (PCIe, NVLink) beyond its
    peers, or stack rounds whose outliers part from the others in a communication call (``frame``: they sit in a
    send, a recv or a collective while the others have moved on). Non-communication slow otherwise: a late arriver,
    peers waiting on a rank's sends, a slow step, a busy host or GPU, a rank's sampled stacks in its own work (the
    rank computes slowly and the others wait for it).
    """
    if lead.detector == "ccl" and "slow links" in lead.evidence:
        return "communication slow"
    if lead.detector in ("metrics", "minder") and lead.metric in _LINK_METRICS:
        return "communication slow"
    if lead.detector == "stacks" and frame is not None and is_communication(frame):
        return "communication slow"
    return "non-communication slow"


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


def _ranges(ranks: Iterable[int]) -> str:
    """1,2,3,5 -> '1-3,5'; '-' for none."""
    return compact_ranks(ranks) or "-"
