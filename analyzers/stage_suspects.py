"""Stage 5 of the pass (docs/analysis-pass.md): the suspects, from the chain and the layout.

Takes ``stage_roots.Roots``; passes on ``StackAnalysis`` (the stacks'
verdict, with the grouping it settled on, its prefix tree and the chain).
Every group of every layout kind is scored by how well it explains the
outlier ranks (``suspects.suspects_for``, ByteRobust §5.1); the chain's roots
and desyncs then take the place of the groups they account for
(``chain_suspects.apply_chain``). When several stack groups tie for largest, the
chain decides which is healthy. Last, the "not a rank" check: every rank in
one call with none behind names no suspect (``not_a_rank.stack_stall``), and
every rank showing the same stacks inside one wait is itself the finding
(``not_a_rank.same_stacks_stall``: the stall is below the ranks).

Pure: stdlib, numpy and the snapshot contract; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from rankscope.analyzers.chain import Chain
from rankscope.analyzers.chain_suspects import apply_chain
from rankscope.analyzers.findings import Suspect, Verdict, VerdictStatus
from rankscope.analyzers.labels import joined, reason_digest, stacks_headline
from rankscope.analyzers.not_a_rank import same_stacks_stall, stack_stall
from rankscope.analyzers.stacks import Grouping, PrefixNode, tree_from_grouping, with_dominant
from rankscope.analyzers.stage_roots import Roots
from rankscope.analyzers.suspects import named_apart, suspects_for
from rankscope.analyzers.topology import Topology
from rankscope.contract.ranks import compact_ranks


@dataclass(frozen=True, slots=True)
class StackAnalysis:
    """Everything the stack detector found: the groups, the tree, the verdict, the layout used."""

    grouping: Grouping
    tree: PrefixNode
    verdict: Verdict
    topology: Topology
    chain: Chain | None = None  # every rank's state and who waits for whom (rankscope.analyzers.chain)


def suspects_of(roots: Roots) -> StackAnalysis:
    """Rank the parallel groups that explain the outliers, the chain's roots and desyncs first."""
    states = roots.waits.states
    evidence = states.evidence
    chain, topology, placement, missing = roots.chain, evidence.topology, evidence.placement, evidence.missing
    grouping, counted, waits = evidence.grouping, states.counted, evidence.waits
    notes = [*grouping.notes, *([grouping.tie] if grouping.tie else [])]
    named = chain.root_ranks | {r for d in chain.desyncs for r in d.ranks}
    chosen: tuple[list[Suspect], list[set[int]]] | None = None  # the suspects of the grouping a tie settled on

    # When several groups tie for largest, no majority says which is healthy: the chain decides (a group
    # holding a root or a desync is never the healthy one), then the choice whose outliers are best explained
    # by one parallel group.
    if grouping.groups and grouping.dominant:
        top = len(grouping.groups[0].ranks)
        tied = [i for i, g in enumerate(grouping.groups) if len(g.ranks) == top]
        if len(tied) > 1:
            free = [t for t in tied if not named.intersection(grouping.groups[t].ranks)] or tied
            best, best_score = grouping, -1.0
            for t in free:
                trial = with_dominant(grouping, (t,))
                found, found_explains = suspects_for(trial, topology, placement, missing, counted)
                score = found[0].score if found else 0.0
                if score > best_score + 1e-9:
                    best, best_score, chosen = trial, score, (found, found_explains)
            if named:
                notes = list(grouping.notes)  # the chain's choice below replaces the lowest-rank one
                notes.append(f"{len(tied)} groups of {top} ranks tie for largest, so no majority says which is "
                             f"healthy: the chain of waits decides (group {best.dominant[0]} taken as healthy; "
                             f"it holds no root)")
            elif best.dominant != grouping.dominant:
                notes.append(f"group {best.dominant[0]} taken as healthy instead: its complement is explained "
                             "better by one parallel group")
            grouping = best

    suspects, explains = (chosen if chosen is not None
                          else suspects_for(grouping, topology, placement, missing, counted))
    suspects, explains, findings = apply_chain(suspects, explains, chain, placement, topology, grouping)
    tree = tree_from_grouping(grouping)
    missing_ranks = tuple(sorted(missing))
    if missing_ranks:
        notes.append(f"{len(missing_ranks)} rank(s) could not be seen: {compact_ranks(missing_ranks)}"
                     + reason_digest(missing))
    exiting = evidence.exiting
    if len(exiting) * 2 >= max(topology.world_size, 1):
        notes.append(f"{len(exiting)} of {topology.world_size} ranks are exiting or gone: the job looks crashed, "
                     "not hung; the launcher's log names the rank that failed first")
    if topology.assumed and suspects:
        notes.append("no parallel sizes known: only ranks and machines can be suspected; "
                     "pass --tp/--pp/--dp (and --order) to name parallel groups")
    seen_count = sum(len(g.ranks) for g in grouping.groups)
    apart = named_apart(grouping, suspects, explains, named)
    if apart:
        notes.append(f"{len(apart)} separate outlier sets, each explained by its own suspect")
    head, root = stacks_headline(apart or suspects[:1], seen_count, len(grouping.groups), bool(grouping.dominant))
    summary = joined(head, root)
    status = VerdictStatus.NAMED if suspects else VerdictStatus.NO_VERDICT  # the headline says why there is none
    stall = stack_stall(chain, range(topology.world_size), waits)
    # Counters that cover every rank and hold no open request say the device owes the hosts nothing: ranks alike
    # at a sync point are a running GPU job caught there, not a stall below them (no counters: a pasted dump).
    settled = waits is not None and set(range(topology.world_size)) <= set(waits.live) and not waits.table.open_ops
    if stall is None and not suspects and not named and len(grouping.groups) == 1 and not missing_ranks \
            and seen_count == topology.world_size >= 2 and not settled:
        # Every rank of the job shows the same stacks: that is the finding (the stall is below the ranks).
        same = grouping.groups[0]
        # (the views as read, before the chain: it calls backward compute when no DP peer is seen elsewhere)
        stall = same_stacks_stall(same.frames, same.ranks, [states.views[r] for r in same.ranks if r in states.views])
    if stall is not None:
        # Every rank in one call and none behind: the stack groups differ only above that call, so no suspect
        # of theirs is more than a guess.
        if suspects:
            notes.append(f"set aside, every rank waits in the same call: {summary}")
        suspects, summary, head, root, apart, status = [], stall.summary(), "", "", [], VerdictStatus.NOT_A_RANK
        findings.append(stall.finding())
    verdict = Verdict(suspects=tuple(suspects), summary=summary, missing_ranks=missing_ranks, notes=tuple(notes),
                      findings=tuple(findings), named=tuple(apart), status=status, summary_root=root,
                      summary_head=head if root else "")
    return StackAnalysis(grouping=grouping, tree=tree, verdict=verdict, topology=topology, chain=chain)


__all__ = ["StackAnalysis", "suspects_of"]
