"""The eviction plan of a suspect: precise (the roots' machines) by default, the group (ByteRobust) beside it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from rankscope.analyzers.eviction_scope import (
    GROUP,
    PRECISE,
    REASON_LINK,
    REASON_MEMBERS,
    eviction_scope,
    option_line,
)
from rankscope.analyzers.findings import Suspect, SuspectKind

PLACEMENT = {r: f"machine-{r // 2}" for r in range(8)}


def pp_groups(roots: tuple[int, ...] = (), evidence: tuple[str, ...] = ("PP groups 2-3",)) -> Suspect:
    # hang-p2p at rank 6: the stack aggregation names PP groups 2-3 (ranks 2-3,6-7) on machine-1, machine-3.
    return Suspect(SuspectKind.PP, (2, 3, 6, 7), ("machine-1", "machine-3"), 1.0, evidence, ("stacks", "ccl"),
                   victims=(0, 1, 2, 3, 4, 5, 7), roots=roots)


def test_roots_make_the_precise_plan_the_default_and_offer_the_group() -> None:
    scope = eviction_scope(pp_groups(roots=(6,)), PLACEMENT)
    assert scope.default.scope == PRECISE
    assert scope.default.machines == ("machine-3",)
    assert scope.default.standbys == 1
    assert scope.other is not None and scope.other.scope == GROUP
    assert scope.group.machines == ("machine-1", "machine-3") and scope.group.standbys == 2
    assert scope.extra_of_group == ("machine-1",)
    assert "rank 6" in scope.reason and "7 ranks wait on it" in scope.reason


def test_no_roots_is_the_group_with_the_reason() -> None:
    scope = eviction_scope(pp_groups(), PLACEMENT)
    assert scope.default.scope == GROUP and scope.other is None
    assert scope.default.machines == ("machine-1", "machine-3")
    assert scope.reason == REASON_MEMBERS
    assert scope.precise == scope.group and scope.extra_of_group == ()


def test_evidence_at_the_link_says_so() -> None:
    scope = eviction_scope(pp_groups(evidence=("p2p 6->2: both sides posted, requests stuck",)), PLACEMENT)
    assert scope.reason == REASON_LINK and scope.default.scope == GROUP


def test_a_root_placed_nowhere_falls_back_to_the_group() -> None:
    scope = eviction_scope(pp_groups(roots=(6,)), {})
    assert scope.default.scope == GROUP and "no machine is known" in scope.reason


def test_roots_on_every_machine_of_the_group_offer_one_plan() -> None:
    scope = eviction_scope(pp_groups(roots=(3, 6)), PLACEMENT)
    assert scope.default.scope == PRECISE and scope.other is None
    assert scope.default.machines == ("machine-1", "machine-3")


def test_option_line_names_machines_and_cost() -> None:
    scope = eviction_scope(pp_groups(roots=(6,)), PLACEMENT)
    assert option_line(scope.default) == "machine-3 (1 standby)"
    assert option_line(scope.group) == "machine-1 machine-3 (2 standbys)"


@given(st.frozensets(st.integers(0, 7), min_size=1), st.frozensets(st.integers(0, 7)))
def test_precise_never_takes_more_than_the_group(group: frozenset[int], roots: frozenset[int]) -> None:
    roots = roots & group
    machines = tuple(sorted({PLACEMENT[r] for r in group}))
    s = Suspect(SuspectKind.TP, tuple(sorted(group)), machines, 1.0, ("x",), roots=tuple(sorted(roots)))
    scope = eviction_scope(s, PLACEMENT)
    assert set(scope.precise.machines) <= set(scope.group.machines)
    assert scope.precise.machines  # never an empty eviction
    assert set(scope.group.machines) == set(machines)
    assert set(scope.default.machines) == ({PLACEMENT[r] for r in roots} if roots else set(machines))


def test_the_scorer_grades_the_plan_e_executes_precise_and_over_eviction() -> None:
    from rankscope.analyzers.findings import Verdict
    from rankscope.drill.scoring import score_verdict

    truth = {"fault": "hang-p2p", "suspect_kind": "pp", "rank": 6, "machine": "machine-3",
             "suspect_ranks": [2, 3, 6, 7], "suspect_machines": ["machine-1", "machine-3"]}
    graded = score_verdict(Verdict((pp_groups(roots=(6,)),), "PP groups 2-3"), truth, PLACEMENT)
    ev = graded["eviction"]
    assert ev["default"] == "precise"
    assert ev["precise"] == {"machines": ["machine-3"], "standbys": 1, "right": True, "extra_machines": 0}
    assert ev["group"] == {"machines": ["machine-1", "machine-3"], "standbys": 2, "right": True, "extra_machines": 1}
    unpinned = score_verdict(Verdict((pp_groups(),), "PP groups 2-3"), truth, PLACEMENT)["eviction"]
    assert unpinned["default"] == "group" and unpinned["precise"] == unpinned["group"]
    assert unpinned["reason"] == REASON_MEMBERS


def test_the_fail_slow_scorecard_reports_the_plan_e_executes() -> None:
    from rankscope.drill.scoring import score_eviction
    from rankscope.drill.suite import score_records, scorecard_lines

    eviction = score_eviction(pp_groups(roots=(6,)), "machine-3", PLACEMENT)
    result = {"scorecard": score_records([]), "wall_s": 1.0,
              "drills": [{"eviction": eviction, "unprepared": False}, {"eviction": None, "unprepared": False}]}
    line = next(x for x in scorecard_lines(result) if x.startswith("eviction plan"))
    assert line == ("eviction plan (e) of 1 confident verdicts: default precise in 1; extra machines (mean) default "
                    "0.00, over-eviction 1.00; faulty machine evicted by default in 1")
