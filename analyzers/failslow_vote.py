"""The fail-slow vote: every detector's flags (``DetectorFlag``) counted into one confidence per machine.

A detector that has alarmed on a machine contributes ``w·(1 − ½^(held/required))`` (``contribution``): half its
weight when it first alarms, more the longer it lasts. Contributions of different detectors on the same machine
combine as independent evidence, ``1 − Π(1 − c)``, so agreement raises the confidence faster than any one detector
can. Detectors that alarm on *other* machines lower it (``× (1 − ½·c_other)``). While a machine stays a suspect, its
confidence fades with a half-life rather than dropping with one weaker round. Machines with the very same evidence
are one suspect (``suspects_of``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from rankscope.analyzers.failslow_config import DETECTORS, FailSlowConfig
from rankscope.analyzers.findings import Suspect, SuspectKind, Verdict
from rankscope.analyzers.step_time import StepTrend

# What the host's Python stacks show: on a job whose collectives run on a device they are one vote
# (``FailSlowConfig.host_weight_on_device``).
HOST_DETECTORS: tuple[str, ...] = ("stacks", "samples")
# The counters': they name ranks, not machines.
DEVICE_DETECTORS: tuple[str, ...] = ("ccl", "p2p_wait")


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
    # A flag on several ranks of its machine: each rank's own evidence (``evidence`` is the first's, or all of it)
    rank_evidence: tuple[tuple[int, str], ...] = ()
    link_ranks: tuple[int, ...] = ()  # the ranks it blames as the common end of slow links, not as late

    def about(self, ranks: Collection[int]) -> str:
        """The evidence about ``ranks``: the lines of those of its ranks among them when it names others too (a
        suspect narrowed to the rank every detector names is told that rank's evidence, not a neighbour's)."""
        mine = [e for r, e in self.rank_evidence if r in ranks]
        return "; ".join(mine) if mine and len(mine) < len(self.rank_evidence) else self.evidence


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


def contribution(weight: float, held: float, required: float) -> float:
    """What one alarmed detector adds: half its weight when it first alarms, more the longer its evidence lasts."""
    if required <= 0:
        return weight
    return float(weight * (1.0 - math.pow(0.5, held / required)))


@dataclass(frozen=True, slots=True)
class Ballot:
    """The alarmed flags counted: each machine's strongest flag per detector, its confidence, the machines most
    confident first, and those machines grouped where their evidence is the very same."""

    per_machine: dict[str, dict[str, DetectorFlag]]
    confidence: dict[str, float]
    order: list[str]
    merged: list[list[str]]

    @property
    def top_confidence(self) -> float:
        return self.confidence[self.order[0]] if self.order else 0.0

    def slow_since(self) -> float | None:
        """When the most confident machine's earliest alarmed evidence began."""
        if not self.order:
            return None
        starts = [f.since_mono for f in self.per_machine[self.order[0]].values() if f.since_mono is not None]
        return min(starts) if starts else None


class Vote:
    """Counts each update's flags, remembering each suspect's confidence for the hysteresis."""

    def __init__(self, config: FailSlowConfig) -> None:
        self.config = config
        self._confidence: dict[str, tuple[float, float]] = {}  # machine -> (confidence, at), for the hysteresis

    def count(self, flags: list[DetectorFlag], on_device: bool, now: float) -> Ballot:
        cfg = self.config
        alarmed = [f for f in flags if f.alarmed and f.machine is not None]
        per_machine: dict[str, dict[str, DetectorFlag]] = {}
        for f in alarmed:
            assert f.machine is not None
            best = per_machine.setdefault(f.machine, {})
            if f.detector not in best or f.score > best[f.detector].score:
                best[f.detector] = f  # one vote per detector: its strongest metric
        if on_device:  # the host's stacks are one vote there (see host_weight_on_device)
            for by_det in per_machine.values():
                host = sorted((by_det[d] for d in HOST_DETECTORS if d in by_det), key=lambda f: -f.score)
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
        return Ballot(per_machine, confidence, order, merged)


def suspects_of(ballot: Ballot, stack_degrader: Suspect | None,
                ranks_of: Callable[[str], tuple[int, ...]]) -> list[tuple[Suspect, DetectorFlag]]:
    """One suspect per group of machines with the same evidence, most confident first, each with its strongest flag.

    Machines of the group the stack rounds name (``stack_degrader``) are that group: ByteRobust evicts the group,
    not one of its machines. Otherwise a suspect is its machines, narrowed to the ranks every detector names.
    """
    out = []
    for ms in ballot.merged:
        by_det = ballot.per_machine[ms[0]]
        ranked = sorted(by_det.values(), key=lambda f: -f.score)
        ranks = narrowest([f.ranks for m in ms for f in ballot.per_machine[m].values()]) or tuple(
            r for m in ms for r in ranks_of(m))
        sources = tuple(f.detector for f in ranked)
        conf = round(ballot.confidence[ms[0]], 4)
        group = stack_degrader
        if len(ms) > 1 and group is not None and "stacks" in by_det and set(ms) <= set(group.machines):
            evidence = tuple(f"[{f.detector}] {f.about(group.ranks)}" for f in ranked)
            out.append((Suspect(group.kind, group.ranks, tuple(ms), conf, evidence, sources, group.group_index,
                                group.diverging_frame, roots=group.roots), ranked[0]))
        else:
            evidence = tuple(f"[{f.detector}] {f.about(ranks)}" for f in ranked)
            out.append((Suspect(SuspectKind.MACHINE, ranks, tuple(ms), conf, evidence, sources), ranked[0]))
    return out


def narrowest(rank_sets: Iterable[Iterable[int]]) -> tuple[int, ...]:
    """The ranks every detector on a suspect names, when they share any (the stacks' group and the counters' late
    arriver in it: the rank); else all they name (they disagree, and none is dropped)."""
    sets = [set(rs) for rs in rank_sets if rs]
    if not sets:
        return ()
    common = set.intersection(*sets)
    return tuple(sorted(common or set.union(*sets)))

