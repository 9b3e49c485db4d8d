"""One ranking from several detectors, where agreement counts for more.

Stack aggregation, CCL counters and fail-slow rounds each return a Verdict
with their own score scale. To merge, each detector's scores are first
scaled so its best suspect is 1.0; then a suspect's merged score is its own
scaled score times (1 + the support it gets from every *other* detector),
where support is the best scaled score among that detector's suspects that
share a rank with it. Two detectors naming the same ranks thus outrank one
detector alone, however sure it is.

Suspects with the same kind and ranks are folded into one entry, their
evidence and sources joined. On equal merged scores the suspect with more
agreeing sources goes first, then the one with more ranks: ByteRobust
over-evicts a whole group rather than gamble on one rank of it.

How a merged suspect is named is ``rankscope.analyzers.labels``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from rankscope.analyzers.findings import Finding, Side, Suspect, Verdict, VerdictStatus, kind_order
from rankscope.analyzers.labels import headline_parts, joined, summary_parts, suspect_label
from rankscope.contract.ranks import compact_ranks


@dataclass(slots=True)
class _Entry:
    suspect: Suspect
    detector: int
    scaled: float
    sources: list[str]
    evidence: list[str]
    roots: tuple[int, ...] = ()  # the first pinned by any detector naming these ranks
    sides: frozenset[Side] = frozenset()  # the sides every detector's evidence of these ranks shows


def _scaled(verdict: Verdict) -> list[float]:
    top = max((s.score for s in verdict.suspects), default=0.0)
    if top <= 0:
        return [0.0 for _ in verdict.suspects]
    return [max(s.score, 0.0) / top for s in verdict.suspects]


def merge_verdicts(*verdicts: Verdict) -> Verdict:
    """Merge detectors' verdicts into one ranking (see the module docstring)."""
    if not verdicts:
        return Verdict(suspects=(), summary="no verdict: no detector ran", status=VerdictStatus.NO_VERDICT)
    if len(verdicts) == 1:
        return _folded(verdicts[0])
    entries: dict[tuple[str, tuple[int, ...]], _Entry] = {}
    per_detector: list[list[tuple[frozenset[int], float]]] = []
    for d, verdict in enumerate(verdicts):
        scaled = _scaled(verdict)
        per_detector.append([(frozenset(s.ranks), sc) for s, sc in zip(verdict.suspects, scaled, strict=True)])
        for s, sc in zip(verdict.suspects, scaled, strict=True):
            key = (str(s.kind), tuple(sorted(s.ranks)))
            sources = list(s.sources) or [f"detector{d}"]
            got = entries.get(key)
            if got is None:
                entries[key] = _Entry(s, d, sc, sources, list(s.evidence), s.roots, s.sides)
            else:
                got.roots = got.roots or s.roots
                got.sides |= s.sides
                got.sources += [x for x in sources if x not in got.sources]
                got.evidence += [e for e in s.evidence if e not in got.evidence]
                if sc > got.scaled:
                    got.scaled, got.detector, got.suspect = sc, d, s

    merged: list[_Ranked] = []
    for entry in entries.values():
        ranks = frozenset(entry.suspect.ranks)
        support = 0.0
        agreeing: list[str] = []
        for d, suspects in enumerate(per_detector):
            if d == entry.detector:
                continue
            best = max((sc for r, sc in suspects if r & ranks), default=0.0)
            if best > 0:
                support += best
                agreeing += [src for src in verdicts[d].suspects[0].sources or (f"detector{d}",)]
        sources = entry.sources + [s for s in agreeing if s not in entry.sources]
        evidence = list(entry.evidence)
        agreement = f"agreement: {', '.join(sorted(set(agreeing)))} also point at these ranks" if support > 0 else ""
        if agreement:
            evidence.append(agreement)
        s = entry.suspect
        merged.append((Suspect(
            kind=s.kind, ranks=s.ranks, machines=s.machines, score=round(entry.scaled * (1.0 + support), 6),
            evidence=tuple(evidence), sources=tuple(sources), group_index=s.group_index, groups=s.groups,
            diverging_frame=s.diverging_frame, victims=s.victims, state=s.state, roots=entry.roots, title=s.title,
            state_side=s.state_side, sides=entry.sides,
        ), tuple(entry.sources), agreement))
    # A pair of ranks a detector names for one fact (a send one never matched) whose pinned rank another detector
    # names alone, the other rank of the pair among its waiters, is that suspect told twice: the one rank goes first
    # and the pair folds into it as its victim (a layout group is kept whole: it is what over-eviction takes).
    alone = {s.ranks: set(s.victims) for s, *_ in merged if len(s.ranks) == 1 and s.victims}

    def told_twice(s: Suspect) -> bool:
        return (str(s.kind) == "rank" and len(s.roots) == 1 and len(s.ranks) > 1
                and set(s.ranks) - set(s.roots) <= alone.get(s.roots, set()))

    merged.sort(key=lambda m: (-m[0].score, told_twice(m[0]), -len(m[0].sources), -len(m[0].ranks),
                               kind_order(str(m[0].kind)),
                               min(m[0].ranks, default=0)))
    folded = _fold_contained(merged)
    missing = tuple(sorted({r for v in verdicts for r in v.missing_ranks}))
    notes = tuple(dict.fromkeys(n for v in verdicts for n in v.notes))
    head = root = ""
    if folded:
        top = folded[0]
        head, root = headline_parts(top)
        said_by = f" ({' + '.join(top.sources)})"
        root = root and root + said_by
        summary, status = joined(head, root) if root else head + said_by, VerdictStatus.NAMED
    else:
        said = next((v for v in verdicts if v.summary), None)
        summary, status = (said.summary, said.status) if said is not None else ("no verdict", VerdictStatus.NO_VERDICT)
        head, root = (said.summary_head, said.summary_root) if said is not None else ("", "")
    return Verdict(suspects=tuple(folded), summary=summary, missing_ranks=missing, notes=notes,
                   findings=merge_findings(*verdicts), status=status, summary_root=root, summary_head=head if root else "")


def _folded(verdict: Verdict) -> Verdict:
    """One detector's verdict with its suspects folded the same way (a stack verdict names a rank, its TP
    group and its DP group, each holding the same root)."""
    kept = _fold_contained([(s, s.sources, "") for s in verdict.suspects])
    if len(kept) == len(verdict.suspects):
        return verdict
    summary, head, root, named = verdict.summary, verdict.summary_head, verdict.summary_root, verdict.named
    if named:
        # The summary named suspects now folded into another: name those that are left.
        apart = {(s.kind, s.ranks) for s in named}
        left = [s for s in kept if (s.kind, s.ranks) in apart]
        if left:
            head, root = summary_parts(left)
            summary, named = joined(head, root), tuple(left) if len(left) > 1 else ()
    return replace(verdict, suspects=tuple(kept), summary=summary, named=named, summary_root=root,
                   summary_head=head if root else "")


@dataclass(slots=True)
class _Kept:
    """A suspect of the merged ranking while lower-ranked ones are folded into it."""

    suspect: Suspect
    named_by: tuple[str, ...]  # the detectors that named it themselves
    finer: int = 0  # cuts of its own ranks by its own detectors, folded quietly
    waiting: set[int] = field(default_factory=set)  # ranks of folded suspects that only wait on it


# A suspect of a ranking: the detectors that named it themselves, and the agreement line the merge added to its
# evidence ("" when none did).
_Ranked = tuple[Suspect, tuple[str, ...], str]


def _fold_contained(ranked: list[_Ranked]) -> list[Suspect]:
    """Each suspect whose ranks all lie inside a higher-ranked suspect, or among its victims, becomes its evidence.

    Detectors name one fault at several sizes (the stacks a PP group and its TP
    groups and ranks; the counters ranks 2 and 3 of it), and the counters name
    ranks that only wait on the root the chain found (rank 4 in a recv the root
    never sent to): listed apart they read as separate faults, and an engineer
    would evict twice for one chain. What another detector pinpoints inside the
    suspect is kept as evidence ("within it: rank 30 named by ccl" and its
    facts); cuts by the suspect's own detectors, and suspects made only of its
    victims, add nothing and are only counted. A desync is never folded into,
    nor folds, a suspect of another kind: its remedy (fix the program) differs.
    ``ranked``: each suspect, best first, with the detectors that named it themselves.
    """
    kept: list[_Kept] = []
    for s, named_by, agreement in ranked:
        ranks = set(s.ranks)
        host = next((k for k in kept
                     if ranks and ranks <= set(k.suspect.ranks) | set(k.suspect.victims)
                     and (str(s.kind) == "desync") == (str(k.suspect.kind) == "desync")), None)
        if host is None:
            kept.append(_Kept(s, named_by))
            continue
        k = host.suspect
        if not k.roots and s.roots and ranks <= set(k.ranks):
            k = replace(k, roots=s.roots)  # a finer cut inside it pins the cause: the group's precise answer
        extra: list[str] = []
        if not ranks <= set(k.ranks):
            host.waiting |= ranks - set(k.ranks)
        elif set(named_by) - set(host.named_by):
            own = [f"  {e}" for e in s.evidence if e not in k.evidence and e != agreement]
            extra = [f"within it: {suspect_label(s)} named by {' + '.join(named_by)}", *own[:3]]
            k = replace(k, sides=k.sides | s.sides)  # what it pinpoints inside the suspect is the suspect's too
        else:
            host.finer += 1
        # Its victims stay the chain's: widening them here could make a suspect kept above a victim too.
        host.suspect = replace(k, evidence=(*k.evidence, *extra),
                               sources=(*k.sources, *(x for x in s.sources if x not in k.sources)))
    out: list[Suspect] = []
    for folded in kept:
        notes: list[str] = []
        if folded.finer:
            notes.append(f"{folded.finer} finer grouping{'s' if folded.finer > 1 else ''} of these ranks by "
                         f"{' + '.join(folded.named_by)} folded in")
        if folded.waiting:
            notes.append("also named, folded in as its victims (they wait on it): "
                         f"ranks {compact_ranks(folded.waiting)}")
        out.append(replace(folded.suspect, evidence=(*folded.suspect.evidence, *notes)) if notes else folded.suspect)
    return out


def merge_findings(*verdicts: Verdict) -> tuple[Finding, ...]:
    """Every detector's findings, each fact once (the same kind, ranks and communicator from two detectors)."""
    out: dict[tuple[str, tuple[int, ...], str | None], Finding] = {}
    for v in verdicts:
        for f in v.findings:
            out.setdefault((f.kind, f.ranks, f.communicator), f)
    return tuple(out.values())

