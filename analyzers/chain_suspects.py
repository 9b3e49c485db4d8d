"""The chain of waits put into the stack suspects' ranking: roots first with their victims, desyncs as suspects.

The candidates (``suspects.suspects_for``) fit the outlier ranks to layout
groups; the chain (``stage_roots``) says who waits on whom. A suspect that
holds a root gets its victims; one made only of ranks waiting on a root is
dropped; a root no suspect holds, and every desync, becomes a suspect of its
own.
"""

from __future__ import annotations

from dataclasses import replace

from rankscope.analyzers.chain import (
    DESYNC_ADVICE,
    TERMINAL,
    Chain,
    RankState,
    desync_evidence,
    desync_summary,
)
from rankscope.analyzers.findings import Finding, Side, Suspect, SuspectKind
from rankscope.analyzers.labels import group_name
from rankscope.analyzers.placement import Placement
from rankscope.analyzers.stacks import Grouping
from rankscope.analyzers.topology import Topology
from rankscope.contract.ranks import compact_machines, compact_ranks


def _root_state(chain: Chain, ranks: set[int]) -> tuple[str, Side | None]:
    """What a suspect's root ranks are doing, in a few words, and the side that shows: a root that waits for no
    other rank (``TERMINAL``) is in its own work. No words (and no side) when none of them is such a root."""
    views = [chain.views[r] for r in sorted(ranks) if r in chain.views and chain.views[r].state in TERMINAL]
    if not views:
        return "", None
    return views[0].short(), Side.OWN_WORK


def _root_lines(chain: Chain, ranks: set[int], placement: Placement) -> list[str]:
    lines: list[str] = []
    for root in chain.roots:
        if root.rank not in ranks:
            continue
        waits = sorted({chain.views[v].site or chain.views[v].frame for v in root.victims if v in chain.views})
        where = compact_machines(placement.machines(root.victims))
        line = (f"root: rank {root.rank} is {root.view.describe()}; {len(root.victims)} rank(s) wait on it "
                f"(ranks {compact_ranks(root.victims)} on {where}, at {'; '.join(waits[:3])}"
                f"{'; ...' if len(waits) > 3 else ''}): they are its victims, not suspects of their own")
        if root.view.state in (RankState.UNREADABLE, RankState.STOPPED):
            line += "; absence is evidence: a rank the others wait on whose stack cannot be read is the prime suspect"
        lines.append(line)
    return lines


def apply_chain(
    suspects: list[Suspect], explains: list[set[int]], chain: Chain, placement: Placement, topology: Topology,
    grouping: Grouping,
) -> tuple[list[Suspect], list[set[int]], list[Finding]]:
    """Put the chain's verdict into the ranking: roots first with their victims, victims never on their own.

    - a suspect holding a root gets the root's victims and a ``root:`` line;
    - a suspect that holds no root or desync but only ranks waiting on one is dropped (one chain, one suspect);
    - a root no suspect holds (an unreadable rank has no stack group) becomes a suspect of its own;
    - a desync becomes one suspect of kind ``desync`` and a finding, replacing suspects inside its group.
    """
    roots = chain.root_ranks
    victims = {v for r in chain.roots for v in r.victims}
    findings: list[Finding] = []
    out: list[tuple[Suspect, set[int]]] = []
    for d in chain.desyncs:
        ranks = set(d.ranks)
        machines = placement.machines(d.ranks)
        comm = d.communicator or ("the whole job" if d.group_kind == "world" else (
            group_name(d.group_kind, (topology.group_index(d.group[0], d.group_kind),))))
        summary = desync_summary(d)
        evidence = desync_evidence(d)
        findings.append(Finding(kind="desync", ranks=d.ranks, summary=summary, evidence=evidence,
                                communicator=comm, advice=DESYNC_ADVICE))
        out.append((Suspect(
            kind=SuspectKind.DESYNC, ranks=d.ranks, machines=machines,
            score=round(2.0 + len(d.victims) / max(topology.world_size, 1), 6),
            evidence=(f"{summary} (ranks {compact_ranks(d.ranks)} on {compact_machines(machines)}, {comm})",
                      *evidence, f"advice: {DESYNC_ADVICE}"),
            sources=("stacks",), victims=d.victims, state="desync",
            roots=() if d.tie else d.ranks,  # on a tie either side may have strayed
            title=summary,
        ), ranks | set(d.victims)))
    in_desync = {r for d in chain.desyncs for r in (*d.ranks, *d.victims)}
    held: set[int] = set()
    for s, explained in zip(suspects, explains, strict=True):
        members = set(s.ranks)
        if in_desync and members <= in_desync:
            continue  # the desync suspect speaks for these ranks
        mine = members & roots
        if not mine and (roots or in_desync) and (members & set(grouping.outlier_ranks)) <= victims | in_desync:
            continue  # only ranks that wait on a root: evidence under that root
        if mine:
            # Every rank that waits on its roots, its own members included: they are why the group is named.
            own_victims = tuple(sorted({v for r in chain.roots if r.rank in mine for v in r.victims} - mine))
            lines = _root_lines(chain, mine, placement)
            state, side = _root_state(chain, mine)
            s = replace(s, evidence=(s.evidence[0], *lines, *s.evidence[1:]), victims=own_victims,
                        state=state, state_side=side, roots=tuple(sorted(mine)))
            # The chain says who waits on whom; the layout's "mostly outliers around it" guess is not needed.
            explained = (members & set(grouping.outlier_ranks)) | set(own_victims) | mine
            held |= mine
        out.append((s, explained))
    world = max(topology.world_size, 1)
    for root in chain.roots:
        absent = root.view.state in (RankState.UNREADABLE, RankState.STOPPED)
        alone = any(se[0].ranks == (root.rank,) for se in out)
        if alone or (root.rank in held and not absent):
            continue  # an unreadable root is named alone even inside a group: no stack group holds it
        strong = root.view.process_state in ("D", "T", "t", "Z", "gone") or root.view.state is RankState.STOPPED
        machines = placement.machines([root.rank])
        state, side = _root_state(chain, {root.rank})
        out.append((Suspect(
            kind=SuspectKind.RANK, ranks=(root.rank,), machines=machines,
            score=round(1.0 + (0.5 if strong else 0.0) + 0.5 * len(root.victims) / world, 6),
            evidence=(f"rank {root.rank} on {compact_machines(machines) or 'unknown machines'}: "
                      f"{root.view.state.value} while {len(root.victims)} rank(s) wait on it",
                      *_root_lines(chain, {root.rank}, placement)),
            sources=("stacks",), victims=root.victims, state=state, state_side=side, roots=(root.rank,),
        ), {root.rank, *root.victims}))
        held.add(root.rank)
    out.sort(key=lambda se: -se[0].score)
    return [s for s, _ in out], [e for _, e in out], findings


__all__ = ["apply_chain"]
