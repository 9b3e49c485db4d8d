"""The action protocol's data: typed requests (never shell text) and confirmation.

An agent's refusal of targets outside its job is the planner's (`check_job`, test_actions_planning.py).
"""

from __future__ import annotations

import pytest
from rankscope.actions.model import (
    ActionKind,
    ActionPlan,
    ActionRequest,
    ActionResult,
    ActionState,
    BackupArgs,
    ConfirmationRule,
    EvictArgs,
    HotUpdateArgs,
    RollbackArgs,
    Targets,
    UpdateMode,
    VersionSource,
)
from rankscope.contract.errors import RankscopeError


def _evict(machines: tuple[str, ...] = ("m12", "m13"), action_id: str = "a-1") -> ActionRequest:
    return ActionRequest(action_id, ActionKind.EVICT, Targets(machines=machines), EvictArgs("PP group 3 hangs"),
                         requested_by="alice")


def test_requests_round_trip_through_json() -> None:
    requests = [
        _evict(),
        ActionRequest("u-7", ActionKind.HOT_UPDATE, Targets(), HotUpdateArgs(VersionSource.GIT, "release/v2",
                      UpdateMode.LAZY, window_s=3600.0, note="fused kernel"), requested_by="bob", job_id="j1"),
        ActionRequest("b-1", ActionKind.BACKUP, Targets(ranks=(0, 5)), BackupArgs(tag="before-evict"), "carol"),
        ActionRequest("r-1", ActionKind.ROLLBACK, Targets(), RollbackArgs(), "dave"),
    ]
    for req in requests:
        assert ActionRequest.from_json(req.to_json()) == req
    assert requests[1].to_json()["args"] == {"source": "git", "version": "release/v2", "mode": "lazy",
                                             "window_s": 3600.0, "note": "fused kernel"}


@pytest.mark.parametrize("build", [
    lambda: Targets(machines=("-rf",)),                                        # would read as an option
    lambda: Targets(machines=("m1; reboot",)),                                 # shell text
    lambda: Targets(ranks=(-1,)),
    lambda: EvictArgs("line one\nline two"),                                   # no control characters
    lambda: HotUpdateArgs(VersionSource.GIT, "--upload-pack=evil"),
    lambda: HotUpdateArgs(VersionSource.GIT, "main..evil"),
    lambda: HotUpdateArgs(VersionSource.DIR, "relative/dir"),
    lambda: HotUpdateArgs(VersionSource.GIT, "main", window_s=0),
    lambda: ActionRequest("has space", ActionKind.BACKUP, Targets(), BackupArgs(), "x"),
    lambda: ActionRequest("a1", ActionKind.EVICT, Targets(), EvictArgs("r"), "x"),  # eviction needs machines
    lambda: ActionRequest("a1", ActionKind.EVICT, Targets(("m1",)), BackupArgs(), "x"),  # args of another kind
])
def test_bad_arguments_are_refused_with_a_fix(build: object) -> None:
    with pytest.raises(RankscopeError) as err:
        build()  # type: ignore[operator]
    assert err.value.fix


def test_malformed_json_is_a_rankscope_error() -> None:
    with pytest.raises(RankscopeError, match="malformed"):
        ActionRequest.from_json({"kind": "evict", "targets": {"machines": ["m1"]}})
    with pytest.raises(RankscopeError, match="malformed"):
        ActionRequest.from_json({"action_id": "a", "kind": "shell", "requested_by": "x"})


def test_eviction_needs_the_typed_phrase_naming_every_machine() -> None:
    assert ConfirmationRule.typed_for(ActionKind.EVICT)
    phrase = ConfirmationRule.phrase_for(ActionKind.EVICT, ("m12", "m13", "m14", "m15"))
    assert phrase == "evict m12 m13 m14 m15"
    plan = ActionPlan("a-1", ActionKind.EVICT, "evict PP group 3", machines=("m12", "m13", "m14", "m15"),
                      typed_confirmation=True, confirm_phrase=phrase)
    assert ConfirmationRule.of(plan).accepts("evict m12 m13 m14 m15")
    assert ConfirmationRule.of(plan).accepts("  evict m12  m13 m14 m15 ")
    assert not ConfirmationRule.of(plan).accepts("evict m12 m13 m14")
    assert not ConfirmationRule.of(plan).accepts(True)  # a bare "yes" is not enough
    assert not ConfirmationRule.of(plan).accepts(None)  # Cancel is the default


def test_one_eviction_over_several_agents_is_confirmed_by_one_phrase_naming_all() -> None:
    plans = [ActionPlan("a-1", ActionKind.EVICT, "evict", machines=("m12", "m13"), typed_confirmation=True,
                        confirm_phrase="evict m12 m13"),
             ActionPlan("a-1", ActionKind.EVICT, "evict", machines=("m14",), typed_confirmation=True,
                        confirm_phrase="evict m14")]
    assert ConfirmationRule.of(plans).accepts("evict m12 m13 m14")
    assert not ConfirmationRule.of(plans).accepts("evict m12 m13")  # one agent's phrase is not the action's
    assert not ConfirmationRule.of(plans).accepts(True)
    assert not ConfirmationRule.of([]).accepts("evict")


def test_other_actions_confirm_with_an_explicit_yes_only() -> None:
    assert not ConfirmationRule.typed_for(ActionKind.HOT_UPDATE)
    plan = ActionPlan("u-1", ActionKind.HOT_UPDATE, "hot-update to v2", machines=("m0", "m1"))
    assert ConfirmationRule.of(plan).accepts(True)
    assert not ConfirmationRule.of(plan).accepts(False)
    assert not ConfirmationRule.of(plan).accepts(None)
    assert not ConfirmationRule.of(plan).accepts("y")


def test_a_confirmation_must_name_exactly_the_planned_targets_and_carry_the_phrase() -> None:
    """The check the client makes before sending and each agent before acting (on the plan it makes then)."""
    from rankscope.actions.agent_protocol import Confirmation

    plans = [ActionPlan("a-1", ActionKind.EVICT, "evict", machines=("m12", "m13"), typed_confirmation=True,
                        confirm_phrase="evict m12 m13"),
             ActionPlan("a-1", ActionKind.EVICT, "evict", machines=("m14",), typed_confirmation=True,
                        confirm_phrase="evict m14")]
    rule = ConfirmationRule.of(plans)
    assert rule.machines == ("m12", "m13", "m14") and rule.phrase == "evict m12 m13 m14"
    assert rule.problem(Confirmation(("m14", "m12", "m13"), (5,), " evict m12 m13  m14"), [5]) is None
    stale = rule.problem(Confirmation(("m12", "m13"), (5,), "evict m12 m13"), [5])  # a plan that grew since
    assert stale is not None and "m14" in stale
    assert rule.problem(Confirmation(("m12", "m12", "m13", "m14"), (5,), "evict m12 m13 m14"), [5]) is not None
    assert rule.problem(Confirmation(("m12", "m13", "m14"), (), "evict m12 m13 m14"), [5]) is not None
    assert "typed confirmation" in (rule.problem(Confirmation(("m12", "m13", "m14"), (5,), "yes"), [5]) or "")
    update = ConfirmationRule.of(ActionPlan("u-1", ActionKind.HOT_UPDATE, "hot-update", machines=("m0",)))
    assert update.phrase is None and update.problem(Confirmation(("m0",)), []) is None


def test_result_state_and_json() -> None:
    res = ActionResult("a-1", ActionKind.EVICT, ActionState.SUCCEEDED, "done", 1.0, 2.0, ("x",))
    assert res.ok and ActionState.SUCCEEDED.final and not ActionState.RUNNING.final
    assert ActionResult.from_json(res.to_json()) == res
