"""How a suspect is named, the one place: verdict lines, headlines, fail-slow evidence, the TUI's titles.

Every consumer (the merged verdict, the stack aggregation's summary, the
fail-slow detector, ``rankscope analyze``, the TUI's verdict panel and
action titles) names a suspect through these functions, so one suspect
reads the same everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rankscope.analyzers.findings import NOT_A_RANK, Side, Suspect, SuspectKind, Verdict
from rankscope.contract.ranks import compact_machines, compact_ranks


def suspect_label(s: Suspect) -> str:
    """A suspect's name without where it runs: ``PP group #1 (ranks 4-7)``, ``rank 5``, ``machine m2 (ranks 4-5)``.

    The one way a suspect is named (verdict lines, fail-slow evidence, the
    TUI's action titles and evict reasons).
    """
    ranks = compact_ranks(s.ranks) or "-"
    kind = str(s.kind)
    if kind == "rank":
        return f"rank {ranks}"
    which = f"rank {ranks}" if len(s.ranks) == 1 else f"ranks {ranks}"
    if kind == "machine":
        return f"machine {','.join(s.machines)} ({which})"
    if kind == "comm":
        number = group_numbers(s)
        return f"communicator{' ' + number if number else ''} ({which})"
    numbers = s.groups if len(s.groups) > 1 else (s.group_index,) if s.group_index is not None else ()
    return f"{group_name(kind, numbers)} ({which})"


def group_name(kind: str, groups: Sequence[int]) -> str:
    """Layout groups of one kind by their numbers: ``PP group #3``, ``PP groups #6 and #7``, ``TP group`` (unknown)."""
    if len(set(groups)) > 1:
        return f"{kind.upper()} groups {numbered(groups)}"
    return f"{kind.upper()} group{f' {numbered(groups)}' if groups else ''}"


def numbered(groups: Sequence[int]) -> str:
    """Group numbers marked as numbers, so they cannot be read as ranks beside a rank range (``PP groups 2-3 (ranks
    2-3,6-7)`` read as ranks): ``#6``, ``#6 and #7``, ``#2-#5, #9``."""
    distinct = sorted(set(groups))
    if len(distinct) == 2:
        return f"#{distinct[0]} and #{distinct[1]}"
    runs: list[list[int]] = []
    for n in distinct:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ", ".join(f"#{r[0]}" if len(r) == 1 else f"#{r[0]}-#{r[-1]}" for r in runs)


def group_numbers(s: Suspect) -> str:
    """Which groups of its kind a suspect is: ``#6``, ``#6 and #7`` when it spans several, empty when unknown."""
    if len(s.groups) > 1:
        return numbered(s.groups)
    return numbered((s.group_index,)) if s.group_index is not None else ""


def joined(head: str, root: str) -> str:
    """A headline from its parts: ``PP group #3 (ranks 4-7) on m2, root rank 5 (computing; 3 ranks wait on it)``."""
    return f"{head}, {root}" if root else head


def headline_parts(s: Suspect, *, own_words: bool = False) -> tuple[str, str]:
    """One line naming a suspect and its machines, in two parts (``joined`` makes the line): the suspect and where
    it runs (``rank 5 on machine-2``, ``PP group #3 (ranks 6,14) on m3, m7``), and its one root rank when the suspect
    is a larger set the root sits in (``root rank 5 (computing; 3 ranks wait on it)``; empty otherwise), which the
    verdict panel puts on a line of its own.

    ``own_words``: a group is named by its detector's own ``title`` (the stack
    aggregation's ``PP groups #6 and #7 on machine-12..15``, which knows several
    groups share the suspects), as one detector's own verdict does; a merged
    verdict names it by ``suspect_label``. A desync is named by its title
    (which peers it differs from) either way.
    """
    where = compact_machines(s.machines) or "unknown machines"
    kind = str(s.kind)
    if kind == "desync":
        if s.title:
            return s.title, ""
        return f"desync: ranks {compact_ranks(s.ranks)} on {where} are in a different collective from their peers", ""
    if kind == "rank" and len(s.ranks) == 1 and s.victims:
        state = f"{s.state}; " if s.state else ""  # (the counters tell who waits, not what the root does)
        return f"rank {s.ranks[0]} on {where} ({state}{waiting_words(len(s.victims))} on it)", ""
    if kind == "rank" and len(s.ranks) == 1:
        return f"rank {s.ranks[0]} on {where}", ""
    root = ""
    if len(s.roots) == 1 and s.victims and s.ranks != s.roots:
        state = f"{s.state}; " if s.state else ""
        root = f"root rank {s.roots[0]} ({state}{waiting_words(len(s.victims))} on it)"
    if kind == "machine":
        return f"machine {where}", root
    if own_words and s.title:
        return s.title, root
    return f"{suspect_label(s)} on {where}", root


def waiting_words(n: int) -> str:
    """``1 rank waits`` / ``7 ranks wait``."""
    return f"{n} rank waits" if n == 1 else f"{n} ranks wait"


def summary_parts(named: Sequence[Suspect]) -> tuple[str, str]:
    """A detector's headline over the suspects it names (one's own words, or ``N separate suspects: a; b``) in two
    parts, cut where the first root rank it names begins (``headline_parts``); the second is empty when it names
    none."""
    parts = [headline_parts(s, own_words=True) for s in named]
    lead = "" if len(named) == 1 else f"{len(named)} separate suspects: "
    at = next((i for i, (_, root) in enumerate(parts) if root), None)
    if at is None:
        return lead + "; ".join(head for head, _ in parts), ""
    before = "".join(f"{joined(*p)}; " for p in parts[:at])
    after = "".join(f"; {joined(*p)}" for p in parts[at + 1:])
    return f"{lead}{before}{parts[at][0]}", f"{parts[at][1]}{after}"


def stacks_headline(named: Sequence[Suspect], seen: int, groups: int, majority: bool) -> tuple[str, str]:
    """The stacks' headline in two parts (``summary_parts``) over the suspects it ``named``; with none, why there
    is no verdict: ``seen`` ranks' stacks read, in ``groups`` stack groups, ``majority`` when one group is healthy."""
    if named:
        return summary_parts(named)
    if seen == 0:
        return "no verdict: no rank's stacks could be read", ""
    if groups == 1:
        return f"no verdict: all {seen} ranks show the same stacks", ""
    if not majority:
        return f"no verdict: no two of the {seen} ranks show the same stacks", ""
    return "no verdict: the outliers fit no group smaller than the whole job", ""


def reason_digest(missing: Mapping[int, str]) -> str:
    """Why ranks could not be seen, each reason with its ranks (the first four): `` — py-spy timed out (ranks 3-4)``."""
    reasons: dict[str, list[int]] = {}
    for rank, why in missing.items():
        reasons.setdefault(why, []).append(rank)
    parts = [f"{why} (ranks {compact_ranks(r)})" for why, r in sorted(reasons.items(), key=lambda kv: min(kv[1]))]
    return " — " + "; ".join(parts[:4]) + ("; ..." if len(parts) > 4 else "")


# Alibaba's C4 sorts what goes wrong in a job into four kinds; a verdict says which (C4D's words).
COMMUNICATION_HANG = "communication hang"
NON_COMMUNICATION_HANG = "non-communication hang"


def hang_kind(v: Verdict) -> str | None:
    """Which of C4's hang kinds a hang verdict names: the root stuck in its own work (computing, loading data,
    stopped, unreadable; ``Side.OWN_WORK``) is a non-communication hang; a root in a send/recv or a collective, a
    desync (ranks at different calls) or a symmetric stall (every member in one call, "not a rank") is a
    communication hang. The state its detector named decides first (a state with no side is a wait on others: a
    log's "behind in the collective"), then the sides its evidence shows. None when the verdict names nothing or
    does not say (the slow kinds are the fail-slow detector's)."""
    top = v.top
    if top is None:
        return COMMUNICATION_HANG if any(f.kind == NOT_A_RANK for f in v.findings) else None
    if top.kind == SuspectKind.DESYNC:
        return COMMUNICATION_HANG
    if top.state:
        return NON_COMMUNICATION_HANG if top.state_side is Side.OWN_WORK else COMMUNICATION_HANG
    if Side.OWN_WORK in top.sides:
        return NON_COMMUNICATION_HANG
    if Side.COMMUNICATION in top.sides:
        return COMMUNICATION_HANG
    return None
