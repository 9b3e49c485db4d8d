"""The stack analysis as ``rankscope analyze --json`` writes it: groups, suspects, findings, the chain of waits."""

from __future__ import annotations

from rankscope.analyzers.chain import Chain
from rankscope.analyzers.findings import Suspect, finding_to_json
from rankscope.analyzers.stacks import diverging_frame
from rankscope.analyzers.stage_suspects import StackAnalysis
from rankscope.contract.snapshot import DIMS


def suspect_to_json(s: Suspect) -> dict[str, object]:
    return {
        "kind": str(s.kind),
        "ranks": list(s.ranks),
        "machines": list(s.machines),
        "score": s.score,
        "evidence": list(s.evidence),
        "sources": list(s.sources),
        "group_index": s.group_index,
        "groups": list(s.groups),
        "diverging_frame": s.diverging_frame,
        "victims": list(s.victims),
        "state": s.state,
        "roots": list(s.roots),
    }


def verdict_to_json(analysis: StackAnalysis) -> dict[str, object]:
    """The ``rankscope analyze --json`` shape: groups, dominant, outliers, suspects (most likely first)."""
    g = analysis.grouping
    topo = analysis.topology
    groups = []
    for i, group in enumerate(g.groups):
        groups.append({
            "index": i,
            "size": len(group.ranks),
            "ranks": list(group.ranks),
            "summary": group.summary,
            "healthy": i in g.dominant,
            "diverging_frame": None if i in g.dominant else diverging_frame(g, group),
            "frames": list(group.frames),
            "lanes": [{"label": lane.label, "frames": list(lane.frames)} for lane in group.lanes],
        })
    v = analysis.verdict
    return {
        "summary": v.summary,
        "world_size": topo.world_size,
        "layout": {**{d: topo.size(d) for d in DIMS}, "order": "-".join(topo.order),
                   "ranks_per_machine": topo.layout.ranks_per_machine,
                   "from_communicators": [k for k, _ in topo.explicit], "assumed": topo.assumed},
        "groups": groups,
        "dominant": list(g.dominant),
        "outliers": list(g.outliers),
        "suspects": [suspect_to_json(s) for s in v.suspects],
        "findings": [finding_to_json(f) for f in v.findings],
        "chain": chain_to_json(analysis.chain) if analysis.chain is not None else None,
        "missing_ranks": list(v.missing_ranks),
        "notes": list(v.notes),
    }


def chain_to_json(chain: Chain) -> dict[str, object]:
    """The roots the waiting ranks lead to (with their victims) and the waiters no root explains."""
    return {
        "roots": [{"rank": r.rank, "state": r.view.state.value, "detail": r.view.describe(),
                   "process_state": r.view.process_state, "wchan": r.view.wchan, "victims": list(r.victims)}
                  for r in chain.roots],
        "desyncs": [{"group_kind": d.group_kind, "ranks": list(d.ranks), "victims": list(d.victims),
                     "sites": [{"site": site, "ranks": list(ranks)} for site, ranks in d.sites], "tie": d.tie}
                    for d in chain.desyncs],
        "unexplained": list(chain.unexplained),
    }


__all__ = ["chain_to_json", "suspect_to_json", "verdict_to_json"]
