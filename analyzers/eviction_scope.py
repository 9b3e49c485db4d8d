"""What an eviction of the verdict's top suspect takes: the machines the evidence names, or the whole group.

ByteRobust (§5) over-evicts a whole suspect group when stacks cannot
pinpoint the fault: rapid isolation over precise localization, "their
necessity diminishes as diagnostic tools mature". When the evidence does pin
the cause -- ``Suspect.roots``: the rank the others wait on, a rank that never
posted what its peers wait for, a rank stuck in its own code -- evicting its
machine alone is the right default and the group is the offered
alternative. When the evidence cannot tell the group's members apart, or
points at the link between them, the group is the default and the plan says
why.

One plan for every consumer: the TUI's `e` (its dialog and the request it
sends) and the drill's scorer read the same ``EvictionScope``, so what the
scorecard grades is what `e` executes. Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from rankscope.analyzers.findings import Suspect, SuspectKind
from rankscope.analyzers.labels import group_name
from rankscope.analyzers.topology import Topology
from rankscope.contract.ranks import compact_ranks, natural_key

PRECISE = "precise"
GROUP = "group"

REASON_ROOTS = "the evidence pins rank{s} {ranks}: {waiting}"
REASON_MEMBERS = "the evidence cannot tell the group's members apart"
REASON_LINK = "the evidence points at the link between the group's members (both sides posted, requests stuck)"
REASON_SINGLE = "the suspect is one {kind}"
REASON_UNPLACED = "no machine is known for rank{s} {ranks} the evidence pins"
REASON_SLOW = "the fail-slow detectors name {machines}; the rest of {group} waits on it (ByteRobust's degrader group)"

# What a fail-slow suspect's state reads: it marks the suspect ``degrader_suspect`` built.
SLOW_STATE = "slower than its peers"
# The parallel groups whose peers a slow machine holds up, in the order tried: a slow pipeline stage stalls its
# pipeline first, then the data-parallel peers waiting in the gradient all-reduce.
DEGRADER_KINDS = ("pp", "dp", "cp", "ep", "tp")

# Words of a suspect's evidence that say the stall sits between ranks, not in one of them.
_LINK_WORDS = ("both sides posted", "link", "in flight", "network")


@dataclass(frozen=True, slots=True)
class EvictionOption:
    """One way to evict: exactly these machines (each one a warm standby replaces)."""

    scope: str  # PRECISE or GROUP
    machines: tuple[str, ...]
    ranks: tuple[int, ...]  # the ranks the evidence names (precise) or the whole group

    @property
    def standbys(self) -> int:
        """Standbys it uses: each evicted machine is replaced by one (ByteRobust §6.2)."""
        return len(self.machines)


@dataclass(frozen=True, slots=True)
class EvictionScope:
    """The default eviction, and the other one offered beside it (None when both take the same machines)."""

    default: EvictionOption
    other: EvictionOption | None
    reason: str  # why the default is what it is, in words a person reads in the plan

    @property
    def precise(self) -> EvictionOption:
        if self.default.scope == PRECISE or self.other is None:
            return self.default
        return self.other

    @property
    def group(self) -> EvictionOption:
        if self.default.scope == GROUP or self.other is None:
            return self.default
        return self.other

    @property
    def extra_of_group(self) -> tuple[str, ...]:
        """Machines over-eviction takes beyond the precise plan (healthy ones, as far as the evidence tells)."""
        precise = set(self.precise.machines)
        return tuple(m for m in self.group.machines if m not in precise)

    def option(self, scope: str) -> EvictionOption:
        return self.group if scope == GROUP else self.precise


def _points_at_link(suspect: Suspect) -> bool:
    if suspect.kind is SuspectKind.COMM:
        return True
    text = " ".join(suspect.evidence).lower()
    return any(w in text for w in _LINK_WORDS)


def _sorted_machines(names: set[str]) -> tuple[str, ...]:
    return tuple(sorted(names, key=natural_key))


def eviction_scope(suspect: Suspect, placement: Mapping[int, str]) -> EvictionScope:
    """The precise and the over-eviction plans of ``suspect``; ``placement`` maps rank -> machine.

    The group's machines are the suspect's own (what the verdict names); the
    roots' machines come from ``placement``, falling back to the group when a
    root is placed nowhere (a plan must never evict a machine nobody named).
    """
    group = EvictionOption(GROUP, _sorted_machines(set(suspect.machines)), tuple(sorted(suspect.ranks)))
    roots = tuple(sorted(set(suspect.roots)))
    s = "s" if len(roots) > 1 else ""
    if not roots:
        if suspect.kind in (SuspectKind.RANK, SuspectKind.MACHINE):
            return EvictionScope(group, None, REASON_SINGLE.format(kind=str(suspect.kind)))
        reason = REASON_LINK if _points_at_link(suspect) else REASON_MEMBERS
        return EvictionScope(group, None, reason)
    placed = {placement.get(r) for r in roots}
    if None in placed:
        return EvictionScope(group, None, REASON_UNPLACED.format(s=s, ranks=compact_ranks(roots)))
    machines = _sorted_machines({m for m in placed if m is not None})
    precise = EvictionOption(PRECISE, machines, roots)
    waiting = f"{len(suspect.victims)} rank{'s' if len(suspect.victims) != 1 else ''} wait on it" \
        if suspect.victims else "the others of its group wait on it"
    reason = REASON_ROOTS.format(s=s, ranks=compact_ranks(roots), waiting=waiting)
    if suspect.state == SLOW_STATE:
        numbers = suspect.groups or ((suspect.group_index,) if suspect.group_index is not None else ())
        reason = REASON_SLOW.format(machines=" ".join(machines), group=group_name(str(suspect.kind), numbers))
    if set(machines) == set(group.machines):
        return EvictionScope(precise, None, reason)
    return EvictionScope(precise, group, reason)


def degrader_suspect(top: Suspect, topology: Topology | None, placement: Mapping[int, str]) -> Suspect:
    """A fail-slow verdict's machine as `e` evicts it: the machine precisely, its degrader group one key away.

    The fail-slow detectors name a machine (``SuspectKind.MACHINE``); ByteRobust
    (§5) over-evicts the parallel group a slow member degrades. The group is
    the first of ``DEGRADER_KINDS`` whose members reach beyond the machine;
    the machine's flagged ranks are its roots, so ``eviction_scope`` makes the
    machine the default and the group the alternative. A suspect that already
    is a group (the stack rounds named it), or one no group reaches beyond,
    is returned as it is.
    """
    if top.kind is not SuspectKind.MACHINE or topology is None or not top.machines:
        return top
    named = set(top.machines)
    roots = tuple(sorted(r for r in top.ranks if placement.get(r) in named)) or tuple(sorted(top.ranks))
    if not roots or any(not 0 <= r < topology.world_size for r in roots):
        return top
    kinds = topology.kinds()
    for kind in DEGRADER_KINDS:
        if kind not in kinds:
            continue
        ranks = tuple(sorted({p for r in roots for p in topology.group_of(r, kind)}))
        machines = {placement.get(r) for r in ranks}
        if None in machines or machines <= named:
            continue
        indices = tuple(sorted({topology.group_index(r, kind) for r in roots}))
        return replace(top, kind=SuspectKind(kind), ranks=ranks,
                       machines=_sorted_machines({m for m in machines if m is not None}), group_index=indices[0],
                       groups=indices if len(indices) > 1 else (), roots=roots,
                       victims=tuple(r for r in ranks if r not in roots), state=SLOW_STATE)
    return top


def option_line(option: EvictionOption) -> str:
    """``machine-3 (1 standby)``: what an option takes and costs, for a dialog's button or a report."""
    n = option.standbys
    return f"{' '.join(option.machines) or '(no machine)'} ({n} standby{'s' if n != 1 else ''})"
