"""A fail-slow verdict is acted on like a hang's: `e` evicts the slow machine, its degrader group one key away.

The job keeps making steps, so the stack capture on screen names nobody (or
is stale); the fail-slow detectors' confident verdict is the live reading
of the job. The recorded series of test_tui_failslow (machine m2 1.5x slower
from second 10) is replayed through a source that answers plans like agents
and records what it was asked.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from typing import Any

import pytest
from rankscope.actions.agent_protocol import ActionError, ActionUpdate, AgentLost, Confirmation
from rankscope.actions.model import ActionKind, ActionPlan, ActionRequest, AuditRecord, ConfirmationRule, ProcessRef
from rankscope.analyzers.eviction_scope import degrader_suspect, eviction_scope
from rankscope.analyzers.findings import Suspect, SuspectKind
from rankscope.analyzers.topology import Topology
from rankscope.contract.bundle import Bundle
from rankscope.contract.snapshot import Layout
from rankscope.drill.scoring import score_verdict
from rankscope.tui import staleness
from rankscope.tui.app import AppOptions, RankscopeApp
from rankscope.tui.screens.confirm import ConfirmModal, PlanningModal
from rankscope.tui.sources import BundleSource
from test_tui_failslow import WALL0, fs_series
from tui_screen import screen_text, until

pytestmark = pytest.mark.timeout(120)

LAYOUT = Layout(tp=2, pp=2, dp=2, ranks_per_machine=2)  # m2 holds ranks 4-5; their PP groups are (0,4) and (1,5)
PLACEMENT = {r: f"m{r // 2}" for r in range(8)}


async def until_verdict(app: RankscopeApp, pilot: Any) -> None:
    """The recording loaded and judged: the fail-slow verdict `e` acts on is on hand."""
    await app.loaded.wait()
    await app.failslow.idle.wait()
    await until(pilot, lambda: staleness.failslow_target(app.state)[0] is not None, 10, "the fail-slow verdict")


class PlanningSource(BundleSource):
    """A recorded series plus the action passthroughs: each planned request recorded, nothing ever run."""

    def __init__(self, bundle: Bundle) -> None:
        super().__init__(bundle, "bundle fs")
        self.act_problem: tuple[str, str] | None = None
        self.planned: list[ActionRequest] = []

    async def plan_action(self, request: ActionRequest) -> Mapping[str, ActionPlan | ActionError]:
        self.planned.append(request)
        return {f"127.0.0.1:{5000 + int(m[1:])}": ActionPlan(
            request.action_id, request.kind, f"evict {m}", machines=(m,),
            processes=(ProcessRef(m, 4000 + int(m[1:]), 2 * int(m[1:])),), standbys=(f"spare-{m}",),
            typed_confirmation=True, confirm_phrase=ConfirmationRule.phrase_for(ActionKind.EVICT, (m,)))
            for m in request.targets.machines}

    async def run_action(self, request: ActionRequest, confirmation: Confirmation) -> AsyncIterator[ActionUpdate]:
        raise AssertionError("nothing is confirmed in these tests")
        yield  # pragma: no cover

    async def watch_audit(self, since: int | None = 0) -> AsyncIterator[tuple[str, AuditRecord] | AgentLost]:
        if False:  # pragma: no cover - no audit in a recording
            yield


def test_a_slow_machine_is_evicted_precisely_and_its_degrader_group_is_the_alternative() -> None:
    slow = Suspect(SuspectKind.MACHINE, (4, 5), ("m2",), 0.8, ("[step_time] 1.5x the median",), ("step_time",))
    d = degrader_suspect(slow, Topology(LAYOUT, 8), PLACEMENT)
    assert d.kind is SuspectKind.PP and d.roots == (4, 5) and d.ranks == (0, 1, 4, 5) and d.victims == (0, 1)
    scope = eviction_scope(d, PLACEMENT)
    assert scope.default.machines == ("m2",) and scope.other is not None and scope.other.machines == ("m0", "m2")
    assert "fail-slow detectors name m2" in scope.reason and "PP groups #0 and #1" in scope.reason
    # No layout, or a group already named by the stack rounds: the suspect stays as it is.
    assert degrader_suspect(slow, None, PLACEMENT) is slow
    group = Suspect(SuspectKind.PP, (0, 4), ("m0", "m2"), 0.8, ("x",))
    assert degrader_suspect(group, Topology(LAYOUT, 8), PLACEMENT) is group


def test_the_eviction_dialog_and_its_reason_count_the_ranks_they_name() -> None:
    # By hand: "Evict rank 4-5 of PP groups #0 and #1 (ranks 0-1,4-5): machine-2 (1 standby)".
    from rankscope.tui.actions import evict_request, evict_title

    d = degrader_suspect(Suspect(SuspectKind.MACHINE, (4, 5), ("m2",), 0.8, ("slow",)), Topology(LAYOUT, 8),
                         PLACEMENT)
    scope = eviction_scope(d, PLACEMENT)
    assert evict_title(d, scope.default).startswith("Evict ranks 4-5 of PP groups #0 and #1 (ranks 0-1,4-5): m2")
    request = evict_request(d, "a1", "alice", "job", scope.default)
    assert request.args.reason.startswith("ranks 4-5 of PP groups #0 and #1"), request.args.reason
    one = eviction_scope(replace(d, roots=(5,)), PLACEMENT)
    assert evict_title(replace(d, roots=(5,)), one.default).startswith("Evict rank 5 of PP groups"), one.default


def test_the_drill_grades_a_fail_slow_verdict_by_the_machine_e_evicts() -> None:
    from rankscope.analyzers.findings import Verdict

    slow = degrader_suspect(Suspect(SuspectKind.MACHINE, (4, 5), ("m2",), 0.8, ("slow",)), Topology(LAYOUT, 8),
                            PLACEMENT)
    truth = {"fault": "slow-compute", "category": "slow", "suspect_kind": "rank", "rank": 4, "machine": "m2",
             "suspect_ranks": [4], "suspect_machines": ["m2"]}
    graded = score_verdict(Verdict((slow,), "fail-slow: m2"), truth, PLACEMENT)
    assert graded["correct"] and graded["extra_machines"] == 0
    assert graded["eviction"]["precise"]["machines"] == ["m2"] and graded["eviction"]["group"]["machines"] == ["m0", "m2"]
    wrong = {**truth, "machine": "m3", "rank": 6, "suspect_ranks": [6], "suspect_machines": ["m3"]}
    assert not score_verdict(Verdict((slow,), "fail-slow: m2"), wrong, PLACEMENT)["correct"]


async def test_e_on_a_live_fail_slow_verdict_plans_the_slow_machine_and_offers_its_degrader_group() -> None:
    source = PlanningSource(Bundle(tuple(fs_series(70)), WALL0 + 70))
    app = RankscopeApp(source, AppOptions(layout=LAYOUT))
    async with app.run_test(size=(160, 48)) as pilot:
        await app.loaded.wait()
        await app.failslow.idle.wait()
        await until(pilot, lambda: "slow: m2 (fail-slow, key 7) │ 4/4 machines" in screen_text(app), 10, "the header")
        assert staleness.failslow_target(app.state)[0] is not None
        overview = screen_text(app)
        lines = [line.strip() for line in overview.splitlines()]
        assert lines[lines.index("fail-slow verdict (view 7):") + 1].startswith("fail-slow: machine m2"), lines
        assert " ▸ slow: m2  in PP groups #0 and #1 (ranks 0-1,4-5); 2 ranks wait on it" in overview
        assert "e: m2 (1 standby); ctrl+o group: m0, m2 (2 standbys) — the fail-slow detectors name m2" in overview
        await pilot.press("e")
        await until(pilot, lambda: isinstance(app.screen, ConfirmModal), 10, "the eviction plan")
        (request,) = source.planned
        assert request.kind == ActionKind.EVICT and request.targets.machines == ("m2",)
        text = screen_text(app)
        assert "Type evict m2 to confirm" in text
        assert "over-evict the whole group: m0 m2 (2 standbys), 1 more than the evidence names" in text
        await pilot.click("#other-plan")
        await until(pilot, lambda: len(source.planned) == 2, 10, "the degrader group's plan")
        assert source.planned[1].targets.machines == ("m0", "m2")
        # The slowdown was logged when it was found.
        assert any(e.kind == "verdict" and e.text.startswith("slow: m2") for e in app.state.events)


async def test_a_fail_slow_verdict_whose_machine_was_evicted_is_not_acted_on() -> None:
    from rankscope.tui import state as st

    source = PlanningSource(Bundle(tuple(fs_series(70)), WALL0 + 70))
    app = RankscopeApp(source, AppOptions(layout=LAYOUT))
    async with app.run_test(size=(160, 48)) as pilot:
        await until_verdict(app, pilot)
        app.state = st.apply_evicted(app.state, ("m2",), WALL0 + 71)
        target, why = staleness.failslow_target(app.state)
        assert target is None and why == "its suspect m2 was evicted"
        await pilot.press("e")
        await pilot.pause()
        assert source.planned == [] and not isinstance(app.screen, ConfirmModal)


async def test_polls_of_a_job_stopping_for_its_restart_are_not_judged_for_slowness() -> None:
    # By hand, after a fail-slow eviction, the detectors went on judging the job being stopped ("watching: machine-0
    # [minder] host CPU unlike peers (low)", its ranks exiting): a suspicion a slow restart would have made
    # confident, and `e` would then have planned the eviction of a healthy machine.
    from rankscope.tui import digest as dg
    from rankscope.tui import state as st
    from rankscope.tui.messages import SnapshotReceived

    series = fs_series(80)
    source = PlanningSource(Bundle(tuple(series[:70]), WALL0 + 70))
    app = RankscopeApp(source, AppOptions(layout=LAYOUT))
    async with app.run_test(size=(160, 48)) as pilot:
        await until_verdict(app, pilot)
        assert app.state.failslow is not None
        judged = app.state.failslow.updates
        app.state = st.apply_evicted(app.state, ("m2",), WALL0 + 70.5)
        for snap in series[70:75]:  # one at a time: a poll waiting to be folded is replaced by a newer one
            polls = app.state.polls
            app.post_message(SnapshotReceived(dg.digest(snap), snap.captured.wall))
            await until(pilot, lambda polls=polls: app.state.polls == polls + 1 and app.failslow.idle.is_set(), 10,
                        "the poll folded")
        assert app.state.awaiting_restart and app.state.failslow.updates == judged
        # The same polls once the job is back are judged.
        app.state = replace(app.state, awaiting_restart=False)
        for snap in series[75:80]:
            app.post_message(SnapshotReceived(dg.digest(snap), snap.captured.wall))
        await until(pilot, lambda: app.state.failslow is not None and app.state.failslow.updates > judged, 10,
                    "the polls judged")


class SlowPlanningSource(PlanningSource):
    """Plans as PlanningSource once ``release`` is set: the agents of a loaded host taking their time."""

    def __init__(self, bundle: Bundle) -> None:
        super().__init__(bundle)
        self.release = asyncio.Event()
        self.asked = 0  # plan_action calls begun

    async def plan_action(self, request: ActionRequest) -> Mapping[str, ActionPlan | ActionError]:
        self.asked += 1
        await self.release.wait()
        return await super().plan_action(request)


async def test_keys_typed_while_the_agents_plan_go_nowhere_and_escape_cancels_the_planning() -> None:
    from textual.widgets import Input
    from textual.worker import WorkerCancelled

    # By hand on a loaded host the plan took 7 s with nothing on screen: the tab, the phrase and the enter typed
    # meanwhile reached the main screen, and the dialog then answered "that is not the phrase" over an empty box.

    source = SlowPlanningSource(Bundle(tuple(fs_series(70)), WALL0 + 70))
    app = RankscopeApp(source, AppOptions(layout=LAYOUT))
    async with app.run_test(size=(80, 24)) as pilot:
        await until_verdict(app, pilot)
        await pilot.press("7", "e")
        await until(pilot, lambda: isinstance(app.screen, PlanningModal) and source.asked == 1
                    and "evict: the agents are making the plan" in screen_text(app), 10, "the planning notice")
        await pilot.press("tab", *"evict m2", "1", "e", "enter")
        assert isinstance(app.screen, PlanningModal) and source.asked == 1 and app.main.active_view == "failslow"
        source.release.set()
        await until(pilot, lambda: isinstance(app.screen, ConfirmModal) and app.focused is not None, 10, "the dialog")
        assert app.screen.query_one("#confirm-phrase", Input).value == ""
        assert app.focused.id == "cancel" and len(source.planned) == 1
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, ConfirmModal), 10, "the dialog closed")
        # Escape while the agents plan: back to the view, and the plan that comes later opens no dialog.
        source.release.clear()
        await pilot.press("e")
        await until(pilot, lambda: isinstance(app.screen, PlanningModal) and source.asked == 2, 10,
                    "the second planning notice")
        (planning,) = [w for w in app.workers if w.group == "action-plan" and not w.is_finished]
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, PlanningModal), 10, "the planning cancelled")
        source.release.set()
        with pytest.raises(WorkerCancelled):
            await planning.wait()
        await pilot.pause()
        assert planning.is_cancelled and len(source.planned) == 1 and not isinstance(app.screen, ConfirmModal)


async def test_at_80x24_the_header_the_fail_slow_verdict_and_the_alternative_are_whole_in_every_view() -> None:
    # The header ended "step 0 s ago, han…": the countdown to the hang threshold was cut at 80 columns.
    source = PlanningSource(Bundle(tuple(fs_series(70)), WALL0 + 70))
    app = RankscopeApp(source, AppOptions(layout=LAYOUT))
    async with app.run_test(size=(80, 24)) as pilot:
        await app.loaded.wait()
        await app.failslow.idle.wait()
        await until(pilot, lambda: "slow: m2" in screen_text(app), 10, "the header")
        overview = screen_text(app).splitlines()
        assert "e: m2 (1 standby); ctrl+o group: m0, m2 (2 standbys)" in "\n".join(overview)
        assert "fail-slow verdict (view 7):" in [line.strip() for line in overview]
        assert any(line.strip().startswith("fail-slow: machine m2 (ranks 4-5)") for line in overview), overview
        for key in "1234567":
            await pilot.press(key)
            await pilot.pause()
            first = screen_text(app).splitlines()[0].rstrip()
            assert first.startswith(" slow: m2 (key 7) │ 4/4 machines │ ") and "…" not in first, (key, first)
            assert first.endswith(f"step 0 s ago, hang at {app.state.hang_threshold_s:.0f} s"), (key, first)


async def test_at_80x24_with_the_drills_machine_names_the_fail_slow_headline_and_the_alternative_are_whole() -> None:
    # By hand (fail-slow drill at 80x24): "fail-slow verdict (view 7): fail-slow: machine machine-2 (ranks 4-5)
    # (non-com…": with machine names as long as the drill's the verdict's headline was cut.

    named = {f"m{i}": f"machine-{i}" for i in range(4)}
    series = tuple(replace(snap, machines=tuple(replace(m, machine=named[m.machine], hostname=named[m.machine])
                                                for m in snap.machines)) for snap in fs_series(70))
    app = RankscopeApp(BundleSource(Bundle(series, WALL0 + 70), "bundle fs"), AppOptions(layout=LAYOUT))
    async with app.run_test(size=(80, 24)) as pilot:
        await app.loaded.wait()
        await app.failslow.idle.wait()
        await until(pilot, lambda: "slow: machine-2" in screen_text(app), 10, "the header")
        lines = [line.strip() for line in screen_text(app).splitlines()]
        verdict = app.state.failslow.verdict if app.state.failslow is not None else None
        assert verdict is not None and verdict.confident
        head = verdict.verdict.summary.split(" — ")[0]
        assert head.startswith("fail-slow: machine machine-2 (ranks 4-5)"), head
        assert any(line.startswith(head) for line in lines), lines
        assert any("e: machine-2 (1 standby); ctrl+o group: machine-0, machine-2 (2 standbys)" in line
                   for line in lines), lines


class ConfirmingSource(PlanningSource):
    """A planning source that records what a confirmed eviction was sent with."""

    def __init__(self, bundle: Bundle) -> None:
        super().__init__(bundle)
        self.confirmed: list[tuple[ActionRequest, Confirmation]] = []

    async def run_action(self, request: ActionRequest, confirmation: Confirmation) -> AsyncIterator[ActionUpdate]:
        self.confirmed.append((request, confirmation))
        return
        yield  # pragma: no cover


@pytest.mark.parametrize("tab", [True, False], ids=["tab-then-phrase", "phrase-at-once"])
async def test_the_phrase_typed_in_the_fail_slow_dialog_confirms_the_eviction(tab: bool) -> None:
    # By hand one tab did not reach the phrase box here, so the typed phrase went nowhere and enter answered
    # "that is not the phrase". The dialog opens on Cancel as the hang dialog does; one tab reaches the box, and a
    # phrase typed without the tab lands in it too.
    from textual.widgets import Button, Input

    source = ConfirmingSource(Bundle(tuple(fs_series(70)), WALL0 + 70))
    app = RankscopeApp(source, AppOptions(layout=LAYOUT))
    async with app.run_test(size=(80, 24)) as pilot:
        await until_verdict(app, pilot)
        await pilot.press("7")
        await pilot.press("e")
        await until(pilot, lambda: isinstance(app.screen, ConfirmModal) and app.focused is not None, 10,
                    "the eviction dialog, focused")
        await pilot.pause()
        assert isinstance(app.focused, Button) and app.focused.id == "cancel", app.focused
        if tab:
            await pilot.press("tab")
            assert isinstance(app.focused, Input) and app.focused.id == "confirm-phrase", app.focused
        await pilot.press(*"evict m2", "enter")
        await until(pilot, lambda: bool(source.confirmed), 10, "the confirmed eviction")
        ((request, confirmation),) = source.confirmed
        assert request.targets.machines == ("m2",) and confirmation.typed == "evict m2"
        assert confirmation.machines == ("m2",)
        assert not isinstance(app.screen, ConfirmModal)
