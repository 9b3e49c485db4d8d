"""Scoring a verdict against a drill's ground truth.

A drill knows what it broke, so the tool is graded honestly: did the top
suspect name the right *kind* of thing (the rank, or the parallel group the
fault lives in), does it hold the faulty machine, how much more than the
expected machines would an eviction take, and at which place in the ranking
the truth first appears.

``ground_truth`` is the drill's ``GroundTruth`` or its JSON form (as stored
in a bundle); only its fields are read, so this module has no drill
dependencies and also grades bundles from older runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rankscope.analyzers.eviction_scope import EvictionOption, eviction_scope
from rankscope.analyzers.findings import Suspect, Verdict


def _field(truth: Any, name: str, default: Any = None) -> Any:
    if isinstance(truth, Mapping):
        return truth.get(name, default)
    return getattr(truth, name, default)


def _suspect_json(s: Suspect) -> dict[str, Any]:
    return {"kind": str(s.kind), "ranks": list(s.ranks), "machines": list(s.machines), "score": s.score,
            "sources": list(s.sources), "headline": s.evidence[0] if s.evidence else ""}


def score_eviction(top: Suspect | None, machine: str | None, placement: Mapping[int, str]) -> dict[str, Any] | None:
    """What `e` would evict for ``top`` (``eviction_scope``, the plan the TUI executes), graded against the faulty
    machine: the default (precise where the evidence pins a rank) and ByteRobust's over-eviction of the group.

    ``right``: the faulty machine is evicted; ``extra_machines``: healthy machines evicted with it.
    """
    if top is None:
        return None
    scope = eviction_scope(top, placement)

    def graded(option: EvictionOption) -> dict[str, Any]:
        taken = set(option.machines)
        return {"machines": list(option.machines), "standbys": option.standbys,
                "right": machine is not None and machine in taken,
                "extra_machines": len(taken - {machine}) if machine is not None else len(taken)}

    return {"default": scope.default.scope, "reason": scope.reason, "precise": graded(scope.precise),
            "group": graded(scope.group)}


def score_verdict(verdict: Verdict, ground_truth: Any, placement: Mapping[int, str] | None = None) -> dict[str, Any]:
    """Grade ``verdict`` against the drill's ground truth.

    ``correct`` is the drill's pass mark: the top suspect is of the expected
    kind and holds the faulty machine. For the healthy baseline (fault
    ``none``) a verdict is correct when it names nobody. ``eviction`` grades
    the plan `e` executes for the top suspect (``score_eviction``); ``placement``
    (rank -> machine, e.g. ``topology.placement_of(snapshot)``) places the
    ranks the evidence pins.
    """
    kind = str(_field(ground_truth, "suspect_kind", "none"))
    fault = str(_field(ground_truth, "fault", "none"))
    machine = _field(ground_truth, "machine")
    rank = _field(ground_truth, "rank")
    expected_ranks = {int(r) for r in _field(ground_truth, "suspect_ranks", ()) or ()}
    expected_machines = {str(m) for m in _field(ground_truth, "suspect_machines", ()) or ()}
    top = verdict.top
    out: dict[str, Any] = {
        "fault": fault,
        "expected": {"kind": kind, "rank": rank, "machine": machine, "ranks": sorted(expected_ranks),
                     "machines": sorted(expected_machines)},
        "summary": verdict.summary,
        "top": _suspect_json(top) if top is not None else None,
        "suspects": len(verdict.suspects),
        "missing_ranks": list(verdict.missing_ranks),
        "eviction": score_eviction(top, None if machine is None else str(machine), placement or {}),
    }
    if kind == "none":
        out.update(kind_ok=top is None, machine_ok=top is None, ranks_ok=top is None, machines_ok=top is None,
                   extra_machines=len(top.machines) if top else 0, truth_position=None, correct=top is None)
        return out
    if kind == "desync":
        out.update(_score_desync(verdict, expected_ranks, expected_machines, machine))
        return out
    if top is None:
        out.update(kind_ok=False, machine_ok=False, ranks_ok=False, machines_ok=False, extra_machines=0,
                   truth_position=None, correct=False)
        return out
    if _field(ground_truth, "category") == "slow":
        out.update(_score_slow(top, verdict, machine, expected_machines, placement or {}))
        return out
    top_machines = set(top.machines)
    kind_ok = str(top.kind) == kind or (kind == "machine" and set(top.ranks) == expected_ranks)
    machine_ok = machine is not None and str(machine) in top_machines
    position = next((i + 1 for i, s in enumerate(verdict.suspects)
                     if machine is not None and str(machine) in s.machines), None)
    out.update(
        kind_ok=kind_ok,
        machine_ok=machine_ok,
        ranks_ok=rank is not None and int(rank) in top.ranks and expected_ranks <= set(top.ranks),
        machines_ok=expected_machines <= top_machines,
        extra_machines=len(top_machines - expected_machines),
        truth_position=position,
        correct=kind_ok and machine_ok,
    )
    return out


def _score_slow(top: Suspect, verdict: Verdict, machine: Any, expected_machines: set[str],
                placement: Mapping[int, str]) -> dict[str, Any]:
    """A fail-slow verdict names machines (the detectors compare machines): graded as the fail-slow suite grades
    it. Right when the machines `e` evicts by default hold the faulty machine and lie within the expected
    suspect's machines (its degrader group, offered beside, is graded in ``eviction``)."""
    named = set(eviction_scope(top, placement).default.machines)
    position = next((i + 1 for i, s in enumerate(verdict.suspects)
                     if machine is not None and str(machine) in s.machines), None)
    machine_ok = machine is not None and str(machine) in named
    within = not expected_machines or named <= expected_machines
    return {"kind_ok": within, "machine_ok": machine_ok, "ranks_ok": machine_ok,
            "machines_ok": expected_machines <= named, "extra_machines": len(named - expected_machines),
            "truth_position": position, "correct": machine_ok and within}


def _score_desync(verdict: Verdict, expected_ranks: set[int], expected_machines: set[str],
                  machine: Any) -> dict[str, Any]:
    """A desync is a program mismatch, not a part to evict: graded on what the verdict names first.

    Top-1 is the verdict's first word on the job: its first finding when it
    has findings (the desync rule reports there), else its top suspect. It is
    correct when that is of kind ``desync`` and the desync findings together
    (a rule may report one per group it saw split) name exactly the ranks
    that ran ahead, no more and no fewer: a desync blamed on the peers that
    wait, or on a whole group around the ranks, would send the person to the
    wrong code path.
    """
    first = verdict.findings[0] if verdict.findings else None
    top = verdict.top
    named_kind: str | None
    if first is not None:
        named_kind = first.kind
        named = {r for f in verdict.findings if f.kind == first.kind for r in f.ranks}
    elif top is not None:
        named_kind, named = str(top.kind), set(top.ranks)
    else:
        named_kind, named = None, set()
    kind_ok = named_kind == "desync"
    ranks_ok = kind_ok and named == expected_ranks
    position = next((i + 1 for i, f in enumerate(verdict.findings)
                     if f.kind == "desync" and set(f.ranks) & expected_ranks), None)
    top_machines = set(top.machines) if top is not None else set()
    return {
        "named": {"kind": named_kind, "ranks": sorted(named)},
        "kind_ok": kind_ok,
        "machine_ok": machine is not None and ranks_ok,
        "ranks_ok": ranks_ok,
        "machines_ok": ranks_ok,
        # What an eviction of the top suspect would take beyond the desync ranks' machines (none is best).
        "extra_machines": len(top_machines - expected_machines),
        "truth_position": position,
        "correct": ranks_ok,
    }
