"""The action keys of the TUI: plan shown, Cancel by default, type-to-confirm, live progress, read-only without keys.

Most tests drive the app with Pilot over the recorded Fig. 7 bundle and a
source that records what it is asked (the same plan/run/watch passthroughs
LiveSource offers), so they can say exactly what would have been sent. The
last test does it for real: agents on loopback with actions enabled and
stand-in rank processes, a TUI that presses e and types the phrase, the
ranks really stopped, and a second, read-only TUI on the same agents that
sees the audit records arrive.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from typing import Any

import pytest
from rankscope.actions.agent_protocol import ActionError, ActionUpdate, AgentLost, Confirmation
from rankscope.actions.model import (
    ActionKind,
    ActionPlan,
    ActionProgress,
    ActionRequest,
    ActionResult,
    ActionState,
    AuditRecord,
    ConfirmationRule,
    EvictArgs,
    HotUpdateArgs,
    ProcessRef,
    Targets,
    UpdateMode,
    VersionSource,
)
from rankscope.analyzers.findings import Suspect, SuspectKind
from rankscope.contract.bundle import Bundle
from rankscope.tui.actions import ACT_TOKEN_FIX, ActionSource, pick_suspect, plan_text, summarize
from rankscope.tui.app import AppOptions, RankscopeApp
from rankscope.tui.screens.confirm import ConfirmModal, UpdateModal
from rankscope.tui.screens.help import HelpScreen
from rankscope.tui.sources import BundleSource
from rankscope.tui.story import journal_worthy
from rankscope.tui.toasts import kind_of
from textual.widgets import Button, Input, RadioButton, Static
from tui_bundles import T0, fig7_bundle, job
from tui_screen import screen_text, until

pytestmark = pytest.mark.timeout(60)

SUSPECT_MACHINES = ("node12", "node13", "node14", "node15")  # Fig. 7: the PP group on machines 12-15
PHRASE = "evict node12 node13 node14 node15"
# The evidence pins rank 30 (the rank the group waits on), so `e` evicts its machine by default.
PINNED = ("node15",)
PINNED_PHRASE = "evict node15"


def address_of(machine: str) -> str:
    return f"10.0.0.{int(machine[4:])}:50051"


class RecordingSource(BundleSource):
    """The Fig. 7 bundle plus the action passthroughs, answering like agents and recording every call."""

    def __init__(self, act_problem: tuple[str, str] | None = None, result_message: str = "evicted",
                 bundle: Bundle | None = None) -> None:
        super().__init__(bundle or fig7_bundle(), "bundle fig7" if bundle is None else "bundle")
        self.act_problem = act_problem
        self.result_message = result_message
        self.planned: list[ActionRequest] = []
        self.runs: list[tuple[ActionRequest, Confirmation]] = []
        self.audit: asyncio.Queue[tuple[str, AuditRecord] | AgentLost] = asyncio.Queue()

    async def plan_action(self, request: ActionRequest) -> Mapping[str, ActionPlan | ActionError]:
        self.planned.append(request)
        machines = request.targets.machines or ("node00", "node01")
        plans: dict[str, ActionPlan | ActionError] = {}
        for m in machines:
            n = int(m[4:])
            evict = request.kind == ActionKind.EVICT
            plans[address_of(m)] = ActionPlan(
                request.action_id, request.kind, f"{request.kind.value} {m}", machines=(m,),
                processes=(ProcessRef(m, 4000 + 2 * n, 2 * n), ProcessRef(m, 4001 + 2 * n, 2 * n + 1)),
                standbys=(f"spare-{n}",) if evict else (),
                backup_peers=((2 * n, 2 * n + 10), (2 * n + 1, 2 * n + 11)) if request.kind == ActionKind.BACKUP else (),
                commands=((("scontrol", "update", f"NodeName={m}", "State=DRAIN"),) if evict else ()),
                typed_confirmation=evict, confirm_phrase=ConfirmationRule.phrase_for(ActionKind.EVICT, (m,)) if evict else "")
        return plans

    async def run_action(self, request: ActionRequest, confirmation: Confirmation) -> AsyncIterator[ActionUpdate]:
        self.runs.append((request, confirmation))
        for m in confirmation.machines:
            yield ActionUpdate(address_of(m), ActionProgress(request.action_id, 1.0, 1, 2, f"SIGTERM 2 processes on {m}"))
        for m in confirmation.machines:
            yield ActionUpdate(address_of(m), ActionResult(request.action_id, request.kind, ActionState.SUCCEEDED,
                                                           f"{self.result_message} {m}", 1.0, 2.0))

    async def watch_audit(self, since: int | None = 0) -> AsyncIterator[tuple[str, AuditRecord] | AgentLost]:
        while True:
            yield await self.audit.get()


class Watched:
    """The app's notifications, as text (what a person saw pop up)."""

    def __init__(self, app: RankscopeApp) -> None:
        self.lines: list[str] = []
        original = app.notify

        def notify(message: str, **kwargs: Any) -> None:
            self.lines.append(f"{kwargs.get('title', '')}: {message}")
            original(message, **kwargs)

        app.notify = notify  # type: ignore[method-assign]

    def has(self, text: str) -> bool:
        return any(text in line for line in self.lines)


async def open_confirm(pilot: Any, app: RankscopeApp, key: str) -> ConfirmModal:
    await until(pilot, app.loaded.is_set, what="the bundle")
    await pilot.press(key)
    await until(pilot, lambda: isinstance(app.screen, ConfirmModal) and app.focused is not None,
                what="the confirm modal, focused")
    await pilot.pause()
    assert isinstance(app.screen, ConfirmModal)
    return app.screen


async def focus_phrase_box(pilot: Any, app: RankscopeApp) -> None:
    """One tab from the focused Cancel button reaches the phrase box, as a person would press it."""
    assert isinstance(app.focused, Button) and app.focused.id == "cancel", app.focused
    await pilot.press("tab")
    assert isinstance(app.focused, Input), app.focused


# ---- pure parts --------------------------------------------------------------------------------


def test_the_eviction_aims_at_the_suspect_under_the_cursor_else_the_top_one() -> None:
    from rankscope.tui.analysis import build_stack_view

    snap = [s for s in fig7_bundle().snapshots if any(m.stacks for m in s.machines)][-1]
    view = build_stack_view(snap, None)
    assert pick_suspect(view).machines == SUSPECT_MACHINES  # type: ignore[union-attr]
    assert pick_suspect(view, selected_rank=3).machines == SUSPECT_MACHINES  # type: ignore[union-attr]
    assert pick_suspect(view, selected_rank=30).machines == SUSPECT_MACHINES  # type: ignore[union-attr]
    # pointing at an outlier rank picks the most likely suspect holding it; a healthy rank changes nothing
    top = view.verdict.suspects[0]
    tp = Suspect(SuspectKind.TP, (24, 25), ("node12",), top.score / 2, ("TP group 12",), ("stacks",), group_index=12)
    rank30 = Suspect(SuspectKind.RANK, (30,), ("node15",), top.score / 3, ("rank 30",), ("ccl",))
    narrow = replace(view, verdict=replace(view.verdict, suspects=(rank30, tp)))
    assert pick_suspect(narrow, selected_rank=24).machines == ("node12",)  # type: ignore[union-attr]
    assert pick_suspect(narrow, selected_rank=0) == narrow.verdict.top
    assert pick_suspect(None) is None


async def test_plan_text_names_machines_processes_standbys_peers_and_argv() -> None:
    source = RecordingSource()
    request = ActionRequest("evict-x", ActionKind.EVICT, Targets(("node12", "node13")), EvictArgs("hung"), "alice")
    summary = summarize(request, await source.plan_action(request))
    assert summary.runnable and summary.machines == ("node12", "node13")
    assert summary.phrase == "evict node12 node13"
    text = plan_text(summary).plain
    for needle in ("evict node12 node13", "24: 4024", "25: 4025", "26: 4026", "standbys joining: spare-12",
                   "runs: scontrol update NodeName=node12 State=DRAIN", "reason: hung"):
        assert needle in text, needle
    assert summary.confirmation("evict node12 node13") == Confirmation(("node12", "node13"), (), "evict node12 node13")


async def test_a_plan_says_how_many_of_the_standbys_on_hand_join() -> None:
    # One machine evicted, two standbys in the pool: "standbys joining: standby-0 standby-1" beside "(1 standby)".
    source = RecordingSource()
    request = ActionRequest("evict-y", ActionKind.EVICT, Targets(("node12",)), EvictArgs("hung"), "alice")
    plans = dict(await source.plan_action(request))
    (address, plan), = plans.items()
    assert isinstance(plan, ActionPlan)
    plans[address] = replace(plan, standbys=("spare-12", "spare-13"))
    text = plan_text(summarize(request, plans)).plain
    assert "standbys on hand: spare-12 spare-13 (1 joins, one per evicted machine)" in text
    assert "standbys joining" not in text


def test_help_lists_every_view_key_together() -> None:
    from rankscope.tui.screens.help import help_table
    from rich.console import Console

    for read_only in (False, True):
        console = Console(width=200, record=True)
        console.print(help_table(read_only))
        text = console.export_text()
        assert "1-7" in text and "actions (the agents' audit log" in text and "fail-slow (step-time" in text
        assert "\n  6 " not in text and "1-5" not in text


async def test_plans_are_shown_in_rank_order_whatever_order_the_agents_answered_in() -> None:
    # The drill's agents came up as machine-1, 3, 2, 0: the backup plan of ranks 0-1 was shown last, below the
    # modal's fold. Shown by rank; the phrase and the confirmation keep the order the client checks them in.
    source = RecordingSource()
    from rankscope.actions.model import BackupArgs

    for kind, args in ((ActionKind.BACKUP, BackupArgs()), (ActionKind.EVICT, EvictArgs("hung"))):
        request = ActionRequest(f"{kind.value}-x", kind, Targets(("node03", "node01", "node02", "node00")), args,
                                "alice")
        summary = summarize(request, await source.plan_action(request))
        text = plan_text(summary).plain
        heads = [line for line in text.splitlines() if line.startswith("▸ ")]
        assert heads == [f"▸ {kind.value} node0{n}" for n in range(4)], heads
        assert text.splitlines()[0].startswith(f"{kind.value} node00 node01 node02 node03"), text
        assert summary.shown_machines == ("node00", "node01", "node02", "node03")
        assert summary.machines == ("node03", "node01", "node02", "node00")
        if kind == ActionKind.BACKUP:
            assert text.index("0→10 1→11") < text.index("2→12 3→13")
    assert summary.phrase == "evict node03 node01 node02 node00"


# ---- e: plan, Cancel default, type-to-confirm ------------------------------------------------------


async def test_evict_shows_the_plan_with_cancel_focused_and_enter_cancels_without_running() -> None:
    source = RecordingSource()
    app = RankscopeApp(source, AppOptions())
    async with app.run_test(size=(140, 48)) as pilot:
        modal = await open_confirm(pilot, app, "e")
        (request,) = source.planned
        assert request.kind == ActionKind.EVICT and request.targets.machines == PINNED
        assert isinstance(app.focused, Button) and app.focused.id == "cancel"
        assert modal.query_one("#confirm", Button).disabled  # nothing typed yet
        text = screen_text(app)
        assert f"Type {PINNED_PHRASE} to confirm" in text
        for needle in ("processes (rank: pids): 30: 4030; 31: 4031", "standbys joining: spare-15",
                       "scontrol update NodeName=node15 State=DRAIN", "the evidence pins rank 30",
                       "over-evict the whole group: node12 node13 node14 node15 (4 standbys), 3 more"):
            assert needle in text, needle
        await pilot.press("enter")  # the default answer
        await until(pilot, lambda: not isinstance(app.screen, ConfirmModal), what="the modal to close")
        await pilot.pause()
        assert source.runs == []


async def test_e_on_a_desync_plans_no_eviction_and_says_it_would_not_cure_it() -> None:
    from ccl_fixtures import L8, drill_desync, with_counters
    from stack_fixtures import snapshot

    # the drill's desync: TP pair 2-3 ran a step ahead (the counters tell it); the verdict's top is a desync
    stacks, counters = drill_desync((2, 3))
    snap = with_counters(snapshot(stacks, 8, 2, L8), counters.files())
    source = RecordingSource(bundle=Bundle(snapshots=(snap,), created_wall=snap.captured.wall))
    app = RankscopeApp(source, AppOptions())
    watched = Watched(app)
    async with app.run_test(size=(140, 48)) as pilot:
        await until(pilot, app.loaded.is_set, what="the bundle")
        await until(pilot, lambda: app.state.stacks is not None, what="the verdict")
        assert app.state.stacks is not None and app.state.stacks.verdict.top is not None
        assert app.state.stacks.verdict.top.kind is SuspectKind.DESYNC
        await pilot.press("e")
        await until(pilot, lambda: watched.has("no eviction for a desync"), what="the desync notice")
        await pilot.pause()
        assert not isinstance(app.screen, ConfirmModal) and source.planned == []
        assert watched.has("ranks 2-3 are at another point of the program than the 6 ranks waiting for them")
        assert watched.has("evicting machines will not cure it")


async def test_a_wrong_phrase_runs_nothing_and_escape_cancels() -> None:
    source = RecordingSource()
    app = RankscopeApp(source, AppOptions())
    watched = Watched(app)
    async with app.run_test(size=(140, 48)) as pilot:
        modal = await open_confirm(pilot, app, "e")
        await focus_phrase_box(pilot, app)
        await pilot.press(*"evict node12 node13")  # two machines short
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, ConfirmModal), "a wrong phrase must not close the modal as confirmed"
        assert modal.query_one("#confirm", Button).disabled
        assert "that is not the phrase: type exactly" in screen_text(app)  # inside the dialog, not a toast over it
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, ConfirmModal), what="the modal to close")
        await pilot.pause()
        assert source.runs == []
        assert watched.has("cancelled: nothing was sent")


async def test_the_right_phrase_runs_with_the_exact_confirmation_and_progress_and_result_are_shown() -> None:
    source = RecordingSource()
    app = RankscopeApp(source, AppOptions())
    watched = Watched(app)
    async with app.run_test(size=(140, 48)) as pilot:
        await open_confirm(pilot, app, "e")
        await focus_phrase_box(pilot, app)
        await pilot.press(*PINNED_PHRASE)
        await pilot.press("enter")
        await until(pilot, lambda: bool(source.runs), what="the run")
        (request, confirmation), = source.runs
        assert request is source.planned[0]
        assert confirmation == Confirmation(PINNED, (), PINNED_PHRASE)
        await until(pilot, lambda: watched.has("succeeded: evicted node15"), what="the result")
        assert watched.has("SIGTERM 2 processes on node15") and watched.has("evict 1/2")
        assert all(watched.has(f"{address_of(m)}: succeeded: evicted {m}") for m in PINNED)
        # the steps and every machine's result were raised as the eviction's kind: one toast holds them
        evict_toasts = [n for n in app._notifications if kind_of(n) is ActionKind.EVICT]
        assert [n.title for n in evict_toasts] == ["evict result"]
        assert all(f"{address_of(m)}: succeeded: evicted {m}" in evict_toasts[0].message for m in PINNED)
        # the agents' audit stream: shown in the Actions view and the Events view
        for seq, result in enumerate(("started", "succeeded"), start=1):
            source.audit.put_nowait((address_of("node12"), AuditRecord(
                seq, request.action_id, "alice@desk", 1700000000.0 + seq, ActionKind.EVICT,
                "evict node12: stop ranks 24 25 and block it", result, "blocked node12" if seq == 2 else "",
                ("node12",))))
        await until(pilot, lambda: len(app.state.actions.log.lines) == 2, what="the audit records")
        await pilot.press("6")
        await pilot.pause()
        text = screen_text(app)
        assert "succeeded" in text and "started" in text and "alice@desk" in text and "blocked node12" in text
        # what happened comes before who did it: a long "who" pushed "what" off an 80-column screen
        assert any(line.index("blocked node12") < line.index("alice@desk") for line in text.splitlines()
                   if "blocked node12" in line and "alice@desk" in line), text
        assert "warm standbys (P99, 24 h): 1 for 16 machines" in text  # the job's size, with node12 out of it
        assert "15/15 machines 1 evicted" in text  # out of the job on purpose: not counted as lost
        await pilot.press("5")
        await pilot.pause()
        assert "evict succeeded on node12 by alice@desk" in screen_text(app)


# ---- u and b ------------------------------------------------------------------------------------------


async def test_update_asks_version_and_mode_then_plans_and_a_plain_confirm_runs_it() -> None:
    source = RecordingSource(result_message="updated")
    app = RankscopeApp(source, AppOptions())
    async with app.run_test(size=(140, 48)) as pilot:
        await until(pilot, app.loaded.is_set)
        await pilot.press("u")
        await until(pilot, lambda: isinstance(app.screen, UpdateModal), what="the update modal")
        await pilot.pause()
        assert isinstance(app.focused, Input)
        await pilot.press(*"release-2")
        assert "(chosen) immediate" in screen_text(app) and "(chosen) lazy" not in screen_text(app)
        app.screen.query_one("#mode-lazy", RadioButton).value = True
        await pilot.pause()
        assert "(chosen) lazy" in screen_text(app) and "(chosen) immediate" not in screen_text(app)  # in words
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, ConfirmModal), what="the plan")
        (request,) = source.planned
        assert request.kind == ActionKind.HOT_UPDATE
        assert request.args == HotUpdateArgs(VersionSource.GIT, "release-2", UpdateMode.LAZY)
        assert isinstance(app.focused, Button) and app.focused.id == "cancel"
        assert "Input" not in {type(w).__name__ for w in app.screen.query("*")}, "only eviction is typed"
        await pilot.press("tab")  # to Confirm
        assert isinstance(app.focused, Button) and app.focused.id == "confirm"
        await pilot.press("enter")
        await until(pilot, lambda: bool(source.runs), what="the run")
        assert source.runs[0][1] == Confirmation(("node00", "node01"), (), "")


async def test_backup_plan_shows_the_peers_and_cancel_sends_nothing() -> None:
    source = RecordingSource()
    app = RankscopeApp(source, AppOptions())
    async with app.run_test(size=(140, 48)) as pilot:
        await open_confirm(pilot, app, "b")
        assert source.planned[0].kind == ActionKind.BACKUP
        assert "backup peers (rank→peer): 0→10 1→11" in screen_text(app)
        await pilot.press("enter")
        await until(pilot, lambda: not isinstance(app.screen, ConfirmModal))
        assert source.runs == []


# ---- who may act --------------------------------------------------------------------------------------


async def test_read_only_has_no_action_bindings_and_help_and_footer_do_not_list_them() -> None:
    source = RecordingSource()
    app = RankscopeApp(source, AppOptions(read_only=True))
    async with app.run_test(size=(140, 48)) as pilot:
        await until(pilot, app.loaded.is_set)
        await pilot.pause()
        assert not {"e", "u", "b"} & set(app.active_bindings)
        actions = {b.action for _, b in app.active_bindings.items() for b in [b.binding]}
        assert not {"evict", "update", "backup"} & actions
        text = screen_text(app)
        assert "[read-only]" in text and "Evict" not in text and "Backup" not in text
        for key in "eub":
            await pilot.press(key)
        await pilot.pause()
        assert source.planned == [] and isinstance(app.screen, type(app.main))
        await pilot.press("question_mark")
        await until(pilot, lambda: isinstance(app.screen, HelpScreen))
        help_text = screen_text(app)
        assert "evict the suspect" not in help_text and "hot-update" not in help_text
        assert "read-only: no keys change the job" in help_text
    writer = RankscopeApp(RecordingSource(), AppOptions())
    async with writer.run_test(size=(140, 48)) as pilot:
        await until(pilot, writer.loaded.is_set)
        await pilot.pause()
        assert {"e", "u", "b"} <= set(writer.active_bindings)
        text = screen_text(writer)
        assert "Evict" in text and "Update" in text and "Backup" in text


async def test_a_saved_bundle_says_actions_need_a_live_job() -> None:
    app = RankscopeApp(BundleSource(fig7_bundle(), "bundle fig7"), AppOptions())
    watched = Watched(app)
    async with app.run_test(size=(140, 48)) as pilot:
        await until(pilot, app.loaded.is_set)
        assert isinstance(app.source, ActionSource)
        await pilot.press("e")
        await pilot.pause()
        assert not isinstance(app.screen, ConfirmModal)
        assert watched.has("actions need a live job") and watched.has("--agents")


async def test_a_token_without_the_act_role_is_named_with_the_fix() -> None:
    source = RecordingSource(act_problem=("rankscope.token holds no token with the 'act' role",
                                          "add a line 'act:<token>'"))
    app = RankscopeApp(source, AppOptions())
    watched = Watched(app)
    async with app.run_test(size=(140, 48)) as pilot:
        await until(pilot, app.loaded.is_set)
        await pilot.press("e")
        await pilot.pause()
        assert source.planned == [] and not isinstance(app.screen, ConfirmModal)
        assert watched.has("no token with the 'act' role") and watched.has("fix: add a line 'act:<token>'")
    # known only when the agents refuse: the result says it was the token, and how to fix it
    refused = RecordingSource(result_message="agent at x: RunAction needs a token with the 'act' role;")
    app = RankscopeApp(refused, AppOptions())
    watched = Watched(app)
    async with app.run_test(size=(140, 48)) as pilot:
        await open_confirm(pilot, app, "e")
        await focus_phrase_box(pilot, app)
        await pilot.press(*PINNED_PHRASE, "enter")
        await until(pilot, lambda: watched.has("this token may not act"), what="the refusal")
        assert watched.has(ACT_TOKEN_FIX)


# ---- for real: agents on loopback, stand-in ranks, two TUIs ------------------------------------------------

# A rank stand-in with a worker child, its main thread parked in a function named on the command line, so the
# capture groups the ranks by where they wait, as it would group a pipeline stall.
PARKED_RANK = """
import subprocess, sys, time
where, ready = sys.argv[1], sys.argv[2]
child = subprocess.Popen([sys.executable, "-c", "import time\\nwhile True: time.sleep(1)"])
def park():
    open(ready + ".tmp", "w").write(str(child.pid))
    import os
    os.replace(ready + ".tmp", ready)
    while True:
        time.sleep(1)
exec(f"def {where}():\\n    park()\\n")
globals()[where]()
"""


async def test_e_through_real_agents_stops_the_suspect_ranks_and_a_read_only_tui_sees_the_audit(
        tmp_path: Any) -> None:
    import subprocess
    import uuid

    import psutil
    from agent_helpers import PY, Processes, clean_env, wait_for
    from rankscope.actions.config import ActionsConfig, EvictionSettings
    from rankscope.contract.snapshot import Layout
    from rankscope.tui.sources import LiveSource
    from rankscope.wire.agent import AgentConfig, start_agent
    from rankscope.wire.tokens import parse_tokens

    read, act = "read" + uuid.uuid4().hex, "act0" + uuid.uuid4().hex
    tokens = parse_tokens(f"read:{read}\nact:{act}", "test")
    base = f"rankscope-tui-actions-{uuid.uuid4().hex[:8]}"
    # TP1 PP2 DP2, one rank per machine: ranks 1 and 3 form the PP group of dp=1; they wait in the pipeline
    # while 0 and 2 sit in the optimizer, so the verdict names machines m1 and m3.
    where = {0: "optimizer_step", 1: "recv_activations", 2: "optimizer_step", 3: "send_activations"}
    procs = Processes(tmp_path)
    agents = []
    agents_stopped: set[int] = set()
    try:
        ranks: dict[int, tuple[subprocess.Popen[bytes], int]] = {}
        for r, fn in where.items():
            ready = tmp_path / f"rank{r}.ready"
            env = clean_env()
            env.update(RANK=str(r), LOCAL_RANK="0", WORLD_SIZE="4", GROUP_RANK=str(r), LOCAL_WORLD_SIZE="1",
                       TORCHELASTIC_RUN_ID=f"{base}-{r}")
            proc = subprocess.Popen([PY, "-c", PARKED_RANK, fn, str(ready)], env=env, start_new_session=True)
            procs.started.append(proc)
            wait_for(ready.exists, 30, f"rank {r} to start")
            ranks[r] = (proc, int(ready.read_text()))
        for r in where:  # one agent per "machine", each scoped to its rank's run id
            agents.append(await start_agent(AgentConfig(
                tokens=tokens, port=0, machine_name=f"m{r}", run_id=f"{base}-{r}",
                actions=ActionsConfig(tmp_path / f"state-m{r}", EvictionSettings(grace_s=5.0)))))
        addresses = [a.address for a in agents]
        options = AppOptions(poll_interval_s=0.5, hang_after_s=3600.0, layout=Layout(tp=1, pp=2, dp=2,
                                                                                      ranks_per_machine=1))
        actor = RankscopeApp(LiveSource(addresses, act, acting=True, capture_timeout_s=10.0), options)
        watcher = RankscopeApp(LiveSource(addresses, read, capture_timeout_s=10.0),
                               AppOptions(poll_interval_s=0.5, hang_after_s=3600.0, read_only=True,
                                          capture_on_start=False))
        notes = Watched(actor)
        async with actor.run_test(size=(160, 48)) as pilot, watcher.run_test(size=(160, 48)) as second:
            def named() -> bool:
                view = actor.state.stacks
                return view is not None and view.verdict.top is not None
            await until(pilot, named, 60, "a verdict from the capture")
            top = actor.state.stacks.verdict.top  # type: ignore[union-attr]
            assert top is not None and set(top.machines) == {"m1", "m3"}, actor.state.stacks.verdict  # type: ignore[union-attr]
            assert not {"e", "u", "b"} & set(watcher.active_bindings)

            await pilot.press("e")
            await until(pilot, lambda: isinstance(actor.screen, ConfirmModal), 30, "the plan")
            modal = actor.screen
            assert isinstance(modal, ConfirmModal) and modal.summary.runnable, modal.summary.errors
            phrase = modal.summary.phrase
            assert phrase is not None and sorted(phrase.split()[1:]) == ["m1", "m3"]
            planned = {p.pid for plan in modal.summary.plans for p in plan.processes}
            assert planned == {ranks[1][0].pid, ranks[1][1], ranks[3][0].pid, ranks[3][1]}
            assert ranks[1][0].poll() is None, "planning must not touch a rank"
            await until(pilot, lambda: isinstance(actor.focused, Button), 10, "Cancel to take the focus")
            await focus_phrase_box(pilot, actor)
            await pilot.press(*phrase, "enter")

            def stopped(r: int) -> bool:
                proc, child = ranks[r]
                try:
                    child_gone = psutil.Process(child).status() == psutil.STATUS_ZOMBIE
                except psutil.NoSuchProcess:
                    child_gone = True
                return proc.poll() is not None and child_gone

            await until(pilot, lambda: stopped(1) and stopped(3), 60, "the suspect ranks to stop")
            await until(pilot, lambda: notes.has("succeeded"), 30, "the result in the acting TUI")

            def audited(app: RankscopeApp) -> set[tuple[str, str]]:
                return {(m, x.record.result) for x in app.state.actions.log.lines for m in x.record.machines
                        if x.record.kind == ActionKind.EVICT}

            want = {("m1", "started"), ("m1", "succeeded"), ("m3", "started"), ("m3", "succeeded")}
            await until(second, lambda: want <= audited(watcher), 30, "the read-only TUI to see the audit records")
            await second.press("6")
            await second.pause()
            text = screen_text(watcher)
            assert "succeeded" in text and "started" in text and "[read-only]" in text
            assert ranks[0][0].poll() is None and ranks[2][0].poll() is None, "a healthy rank was stopped"

            # The evicted machines' agents go away (the drill and a real cluster stop them). Membership follows
            # the action: both views show m1 and m3 evicted, never lost, and the next whole-job action plans
            # on the machines of the job only (it used to fail with "no agent answered" at the stopped agents).
            for i in (1, 3):
                await agents[i].stop(0)
                agents_stopped.add(i)
            for app, p in ((actor, pilot), (watcher, second)):
                await until(p, lambda a=app: {m.name for m in a.state.machines if m.evicted} == {"m1", "m3"}
                            and not any(m.reachable for m in a.state.machines if m.evicted), 30,
                            "the evicted agents to be polled as gone")
                polled = app.state.polls
                # a few more polls (not a fixed wait: a loaded machine polls less often): still evicted, not lost
                await until(p, lambda a=app, n=polled: a.state.polls >= n + 3, 30, "three more polls")
                assert app.state.lost == () and not any(e.kind == "lost" for e in app.state.events)
                header = screen_text(app).splitlines()[0]
                assert "2/2 machines 2 evicted" in header and "lost" not in header, header
            # A view attached now, after m1's and m3's agents are gone with their audit logs, tells the same story:
            # the verdict and the eviction come from the journal the acting view wrote to every agent.
            late = RankscopeApp(LiveSource(addresses, read, capture_timeout_s=10.0),
                                AppOptions(poll_interval_s=0.5, hang_after_s=3600.0, read_only=True,
                                           capture_on_start=False))
            async with late.run_test(size=(160, 48)) as third:
                await until(third, late.loaded.is_set, 30, "the late view")

                def story(app: RankscopeApp) -> list[tuple[str, str]]:
                    return [(e.kind, e.text) for e in app.state.events if journal_worthy(e)]

                await until(third, lambda: any(k == "action" and "evict succeeded on m1" in t for k, t in story(late))
                            and any(k == "verdict" for k, _ in story(late)), 30, "the journal in the late view")
                assert any(k == "evicted" for k, _ in story(late)), story(late)
            await pilot.press("1")
            await pilot.press("e")  # the verdict named m1 and m3, now evicted: no default target any more
            await until(pilot, lambda: notes.has("nothing to evict now"), 10, "e to say why it has no target")
            assert notes.has("its suspects m1 m3 were evicted")
            await pilot.press("b")
            await until(pilot, lambda: isinstance(actor.screen, ConfirmModal), 30, "the backup plan")
            backup = actor.screen
            assert isinstance(backup, ConfirmModal)
            assert backup.summary.errors == (), backup.summary.errors
            assert backup.summary.runnable and backup.summary.machines == ("m0", "m2")
            await pilot.press("escape")
    finally:
        for i, agent in enumerate(agents):
            if i not in agents_stopped:
                await agent.stop(0)
        procs.close()


async def test_on_a_small_terminal_the_phrase_box_and_buttons_stay_visible_and_pgdn_scrolls_the_plan() -> None:
    source = RecordingSource()
    app = RankscopeApp(source, AppOptions())
    async with app.run_test(size=(80, 24)) as pilot:
        first = await open_confirm(pilot, app, "e")
        assert "^o Whole group (4 machines)" in screen_text(app)
        await pilot.press("ctrl+o")  # the whole group's plan: four machines
        await until(pilot, lambda: isinstance(app.screen, ConfirmModal) and app.screen is not first
                    and app.focused is not None, what="the whole group's plan")
        await pilot.pause()
        text = screen_text(app)
        assert "Cancel" in text and "Evict" in text and "Type evict node12" in text
        assert "^o Only the evidence (1 machine)" in text
        plan = app.screen.query_one("#confirm-plan")
        assert plan.scroll_y == 0 and plan.max_scroll_y > 0  # 4 machines' plans do not fit in 24 rows
        await pilot.press("pagedown")
        await pilot.pause()
        assert plan.scroll_y > 0
        assert isinstance(app.focused, Button) and app.focused.id == "cancel"


def test_the_actions_summary_sizes_the_pool_lists_standbys_on_hand_and_the_update_history() -> None:
    from rankscope.contract.snapshot import Layout
    from rankscope.tui.digest import MachineView
    from rankscope.tui.state import AppState
    from rankscope.tui.state_actions import ActionLog, log_note, log_record
    from rankscope.tui.widgets.audit import summary_text

    def machine(name: str, ranks: tuple[int, ...]) -> MachineView:
        return MachineView(name, f"{name}:50051", True, None, ranks, None, (), None)

    # 128 job machines + 2 idle agents: ByteRobust Table 5 keeps 2 standbys for 128 machines at 0.12 %/day
    machines = (*(machine(f"m{i}", (2 * i, 2 * i + 1)) for i in range(128)),
                machine("spare-0", ()), machine("spare-1", ()))
    state = AppState(machines=machines, world_size=256, layout=Layout(tp=2, pp=4, dp=32, ranks_per_machine=2))
    log = ActionLog()
    for seq, (kind, result, what) in enumerate([
            (ActionKind.HOT_UPDATE, "started", "hot-update m0 to git:v2 (lazy)"),
            (ActionKind.HOT_UPDATE, "succeeded", "hot-update m0 to git:v2 (lazy)"),
            (ActionKind.ROLLBACK, "failed", "roll back m0 to git:v1 (immediate)")], start=1):
        before = log
        log = log_record(log, "m0:50051", AuditRecord(seq, f"a{seq}", "alice", 1700000000.0 + seq, kind, what, result,
                                                      "", ("m0",)))
        assert log is not before
    assert log_record(log, "m0:50051", AuditRecord(1, "a1", "alice", 0.0, ActionKind.HOT_UPDATE, "x", "started")) is log
    log = log_note(log, "m5:50051", "audit of m5:50051: no agent answered — reconnecting")
    text = summary_text(state, log, read_only=False, daily_failure_rate=0.0012).plain
    assert "warm standbys (P99, 24 h): 2 for 128 machines" in text
    assert "on hand (agents without ranks): spare-0 spare-1" in text
    assert "backup peers: rule mirror, safe" in text
    history = text.split("update history:")[1]
    assert "rollback failed m0" in history and "hot-update succeeded m0" in history
    assert history.index("rollback") < history.index("hot-update")  # newest first
    assert "started" not in history  # only how each ended
    assert "no agent answered — reconnecting" in text
    assert "[read-only]" in summary_text(state, log, read_only=True, daily_failure_rate=0.0012).plain


async def test_at_80x24_the_footer_keeps_every_action_key_and_the_stack_tree_its_width() -> None:
    app = RankscopeApp(RecordingSource(), AppOptions())
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, app.loaded.is_set, what="the bundle")
        await until(pilot, lambda: "s Capture" in screen_text(app), what="the footer")
        footer = next(line for line in screen_text(app).splitlines() if "s Capture" in line)
        for key in ("e Evict", "u Update", "b Backup", "s Capture", "? Help", "q Quit"):
            assert key in footer, footer
        await pilot.press("2")
        await until(pilot, lambda: "diverges at" in screen_text(app), what="the stacks view")
        text = screen_text(app)
        # The tree has the whole width (the comparison went under it): a deep frame is not cut to "└── ▼ _fi".
        assert "└── ▼ ⋯ 4 frames every rank shares, folded (innermost: train_step (train.py))" in text, text
        assert "group D diverges at forward_step (schedules.py)" in text  # the root rank 30's group


async def test_e_names_no_target_in_a_capture_taken_while_the_job_made_steps() -> None:
    # After a restart the automatic capture runs at the first step, and a view attached to a healthy job captures
    # at once: ranks caught mid-step. Before the next poll marked it stale, `e` aimed at its "suspects".
    steps = [job(T0 + i, stacks=False, step=100 + i, hung=False) for i in range(5)]
    mid_step = job(T0 + 5, stacks=True, step=105, hung=True)  # stacks that differ, steps still moving
    source = RecordingSource(bundle=Bundle((*steps, mid_step), T0 + 5))
    app = RankscopeApp(source, AppOptions())
    watched = Watched(app)
    async with app.run_test(size=(140, 48)) as pilot:
        await until(pilot, app.loaded.is_set)
        assert app.state.stacks is not None and app.state.stacks.verdict.suspects
        assert app.state.verdict is not None and app.state.verdict.running
        await until(pilot, lambda: "no verdict: the job was making progress" in screen_text(app), 10, "the verdict")
        await pilot.press("e")
        await until(pilot, lambda: watched.has("nothing to evict now: the capture on screen was taken while the job "
                                               "was making progress"), 10, "e to say why it has no target")
        assert source.planned == [] and not isinstance(app.screen, ConfirmModal)


async def test_roots_make_e_evict_only_their_machine_and_the_dialog_offers_the_whole_group(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import rankscope.tui.actions as tui_actions

    picked = tui_actions.pick_suspect

    def with_root(*args: Any) -> Suspect | None:  # the evidence pins rank 26 (node13) of Fig. 7's PP group
        s = picked(*args)
        return None if s is None else replace(s, roots=(26,))

    monkeypatch.setattr(tui_actions, "pick_suspect", with_root)
    source = RecordingSource()
    app = RankscopeApp(source, AppOptions())
    async with app.run_test(size=(160, 48)) as pilot:
        modal = await open_confirm(pilot, app, "e")
        (request,) = source.planned
        assert request.targets.machines == ("node13",), "the default evicts only what the evidence names"
        text = screen_text(app)
        assert "Type evict node13 to confirm" in text and "evict node12" not in text
        assert "only what the evidence names (the default); the evidence pins rank 26" in text
        assert "over-evict the whole group: node12 node13 node14 node15 (4 standbys), 3 more" in text
        await pilot.click("#other-plan")
        await until(pilot, lambda: len(source.planned) == 2 and isinstance(app.screen, ConfirmModal)
                    and app.screen is not modal, what="the whole group's plan")
        assert source.planned[1].targets.machines == SUSPECT_MACHINES
        assert PHRASE in screen_text(app) and "ByteRobust's over-eviction" in screen_text(app)
        assert source.runs == []


async def test_p_shows_the_whole_pairing_command_and_copies_it() -> None:
    command = "/venv/bin/rankscope attach --hostfile /tmp/run/agents.txt --token-file /tmp/run/token --read-only " \
              "--tp 2 --pp 2 --dp 2 --ranks-per-machine 2"
    app = RankscopeApp(RecordingSource(), AppOptions(pair_command=command))
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, app.loaded.is_set, what="the bundle")
        await pilot.press("P")
        await pilot.pause()
        from rankscope.tui.screens.pair import PairScreen

        assert isinstance(app.screen, PairScreen)
        shown = app.screen.query_one("#pair-command", Static)
        assert str(shown.content) == command
        assert shown.size.height >= 2 and shown.size.width <= 80  # wrapped at 80 columns, not cut
        assert app.clipboard == command
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, PairScreen)


async def test_no_toast_covers_a_dialog_and_they_come_back_when_it_closes() -> None:
    source = RecordingSource()
    app = RankscopeApp(source, AppOptions())
    async with app.run_test(size=(160, 48)) as pilot:
        await until(pilot, app.loaded.is_set, what="the bundle")
        app.notify("an earlier note", title="note", timeout=30)
        await pilot.pause()
        await open_confirm(pilot, app, "e")  # "planning evict with the agents …" was raised before it opened too
        await until(pilot, lambda: len(app._notifications) == 0, 5, "the toasts to leave the dialog")
        app.notify("raised while the dialog is open", title="later", timeout=30)
        await pilot.pause(0.5)
        assert len(app._notifications) == 0
        await pilot.press("escape")
        await until(pilot, lambda: any(n.title == "later" for n in app._notifications), 5, "the held toasts back")
