"""Confirming an action: the exact plan, Cancel focused, and a typed phrase for eviction.

``ConfirmModal(ModalScreen[bool])`` is answered through the callback given
to ``push_screen`` (frogmouth's pattern): True only after the person pressed
the confirm button (or enter in the phrase box) with the phrase typed
exactly. Escape, the Cancel button (focused at start, so a stray enter
cancels) and anything unclear answer False; a phrase typed before tabbing to
its box goes into the box. ``typed`` holds the phrase that
was typed, which goes into the confirmation the agents check again.

``PlanningModal`` stands in for the dialog while the agents make the plan.

``UpdateModal`` asks what a hot-update needs before there is a plan: the
version (a git ref, or the absolute path of a prepared directory) and the
mode (immediate, or lazy at the next restart), or a rollback.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

from rankscope.actions.model import UpdateMode
from rich.text import Text
from textual import events, on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, RadioButton, RadioSet, Static


class PlanToConfirm(Protocol):
    """What the modal needs of a plan (``tui.actions.PlanSummary``); the caller renders its text.

    A protocol, so the screen does not import the action controller that opens it (no import circle).
    """

    @property
    def runnable(self) -> bool: ...

    @property
    def machines(self) -> tuple[str, ...]: ...

    @property
    def shown_machines(self) -> tuple[str, ...]: ...

    @property
    def phrase(self) -> str | None: ...

    def accepts(self, answer: str | bool | None) -> bool: ...


class PlanScroll(VerticalScroll, can_focus=False):
    """The plan text; scrolled with pgup/pgdn from anywhere in the modal, so tab goes Cancel -> phrase box."""


class ConfirmModal(ModalScreen[bool]):
    """The plan of one action, waiting for a decision that names its targets."""

    AUTO_FOCUS = "#cancel"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel"),
        Binding("pageup", "scroll_plan(-1)", "Scroll plan", show=False),
        Binding("pagedown", "scroll_plan(1)", "Scroll plan", show=False),
        Binding("ctrl+o", "other_plan", "Other plan", show=False),
    ]

    def __init__(self, title: str, summary: PlanToConfirm, plan: Text, alternative: str | None = None) -> None:
        super().__init__()
        self.title_text = title
        self.summary = summary
        self.plan = plan
        self.typed = ""
        # The label of another plan of the same action (an eviction's whole group beside the machines the evidence
        # names); pressing it answers False with ``switched`` set, and the caller plans that one.
        self.alternative = alternative
        self.switched = False

    @property
    def phrase(self) -> str | None:
        return self.summary.phrase

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm-box"):
            yield Static(Text(self.title_text, "bold"), id="confirm-title")
            with Vertical(id="confirm-foot"):  # docked at the bottom: the prompt and buttons never scroll away
                yield from self._foot()
            with PlanScroll(id="confirm-plan"):
                yield Static(self.plan, id="confirm-plan-text")

    def _foot(self) -> ComposeResult:
        if not self.summary.runnable:
            yield Static(Text("Nothing can run until every target has a plan: fix the above and press the key "
                              "again.", "bold red"), id="confirm-prompt")
        elif self.phrase is not None:
            yield Static(Text.assemble("Type ", (self.phrase, "bold red"), " to confirm (tab to the box), "
                                       "then enter. Cancel is the default; pgup/pgdn scroll the plan."),
                         id="confirm-prompt")
            # Not the phrase itself as the placeholder: in monochrome it looks typed already.
            # No select-all on focus: the first key typed before the tab would be replaced by the next.
            yield Input(placeholder="type the phrase above here", id="confirm-phrase", select_on_focus=False)
        else:
            yield Static(Text.assemble("Run this on ", (" ".join(self.summary.shown_machines), "bold"),
                                       "? Cancel is the default; tab to the other button to confirm."),
                         id="confirm-prompt")
        with Horizontal(id="confirm-buttons"):
            yield Button("Cancel", id="cancel", variant="primary")
            label = "Evict" if self.phrase is not None else "Confirm"
            yield Button(label, id="confirm", variant="error",
                         disabled=not self.summary.runnable or self.phrase is not None)
            if self.alternative is not None:
                # Out of the tab order (tab goes Cancel -> phrase box, as without it); ctrl+o or a click.
                other = Button(f"^o {self.alternative}", id="other-plan")
                other.can_focus = False
                yield other

    def on_key(self, event: events.Key) -> None:
        # A phrase typed while Cancel (or nothing) has focus goes into the phrase box, in every eviction dialog
        # alike: a tab pressed before the dialog opened (planning with the agents takes a moment) or one too many
        # left the phrase going nowhere, and enter then answered "not the phrase" or cancelled.
        if self.phrase is None or not self.summary.runnable or not event.is_printable or event.character is None:
            return
        box = self.query_one("#confirm-phrase", Input)
        if self.focused is box:
            return
        event.stop()
        event.prevent_default()
        box.focus()
        box.insert_text_at_cursor(event.character)

    def action_scroll_plan(self, direction: int) -> None:
        plan = self.query_one("#confirm-plan", PlanScroll)
        plan.scroll_to(y=plan.scroll_y + direction * max(1, plan.size.height - 1), animate=False)

    def _matches(self, text: str) -> bool:
        return self.phrase is not None and self.summary.accepts(text)  # the rule the client and agents apply

    @on(Input.Changed, "#confirm-phrase")
    def _phrase_changed(self, event: Input.Changed) -> None:
        self.query_one("#confirm", Button).disabled = not self._matches(event.value)

    @on(Input.Submitted, "#confirm-phrase")
    def _phrase_submitted(self, event: Input.Submitted) -> None:
        if self._matches(event.value):
            self.typed = " ".join(event.value.split())
            self.dismiss(True)
        else:
            # Said inside the dialog: toasts wait while a dialog is open, so none covers it.
            self.query_one("#confirm-prompt", Static).update(Text.assemble(
                ("that is not the phrase: ", "bold yellow"), "type exactly ", (self.phrase or "", "bold red"),
                " (tab to the box), then enter. Cancel is the default."))

    @on(Button.Pressed, "#confirm")
    def _confirm(self) -> None:
        if not self.summary.runnable:
            return
        if self.phrase is not None:
            text = self.query_one("#confirm-phrase", Input).value
            if not self._matches(text):
                return
            self.typed = " ".join(text.split())
        self.dismiss(True)

    @on(Button.Pressed, "#other-plan")
    def action_other_plan(self) -> None:
        if self.alternative is None:
            return
        self.switched = True
        self.dismiss(False)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(False)


class PlanningModal(ModalScreen[bool]):
    """From the key press until the agents' plan is in: what is being planned, and the keys typed meanwhile kept
    from the screen below.

    By hand on a loaded host a plan took 7 s with nothing on screen: the tab, the phrase and the enter typed
    meanwhile reached the main screen (a digit there switches views, ``e`` plans again), and the dialog then opened
    on an empty phrase box ("that is not the phrase"). Keys typed before the plan is shown are dropped, never put
    into the phrase box: the phrase is typed having read the plan. Escape cancels; a plan changes nothing, so
    nothing was sent (False). Dismissed by the caller with True once the plan is in (the dialog takes over)."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what  # the action's label: evict, hot-update, rollback, backup

    def compose(self) -> ComposeResult:
        with Vertical(id="planning-box"):
            yield Static(Text.assemble((f"{self.what}: the agents are making the plan …", "bold"), "\n",
                                       "Its plan opens here before anything runs; keys typed now are not kept. "
                                       "Escape cancels (nothing is sent)."), id="planning-text")

    def on_key(self, event: events.Key) -> None:
        if event.key == "escape":
            return  # the binding: cancel
        event.stop()
        event.prevent_default()

    def action_cancel(self) -> None:
        self.dismiss(False)


@dataclass(frozen=True, slots=True)
class UpdateChoice:
    version: str
    mode: UpdateMode
    rollback: bool = False


class UpdateModal(ModalScreen["UpdateChoice | None"]):
    """Version and mode of a hot-update (or a rollback), asked before the agents plan it."""

    AUTO_FOCUS = "#update-version"
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]

    def compose(self) -> ComposeResult:
        with Vertical(id="update-box"):
            yield Static(Text("Hot-update the job's code", "bold"))
            yield Static("Version: a git ref of the agents' configured repository, or the absolute path of a "
                         "directory prepared on every machine.")
            yield Input(placeholder="a tag, branch or commit (v2 on the drill), or /srv/job/versions/fix-17",
                        id="update-version")
            yield Static("", id="update-note")
            with RadioSet(id="update-mode"):
                yield RadioButton(self._label("immediate", True), value=True, id="mode-immediate")
                yield RadioButton(self._label("lazy", False), id="mode-lazy")
            with Horizontal(id="update-buttons"):
                yield Button("Cancel", id="cancel", variant="primary")
                yield Button("Plan update", id="plan-update", variant="warning")
                yield Button("Plan rollback", id="plan-rollback")

    MODE_TEXT: ClassVar[dict[str, str]] = {
        "immediate": "immediate: restart the training processes on the new code now",
        "lazy": "lazy: apply at the next restart or failure (at the latest in 24 h)",
    }

    def _label(self, mode: str, chosen: bool) -> str:
        # The choice in words, not by the indicator's colour alone (a monochrome terminal showed two equal rows).
        return f"{'(chosen) ' if chosen else ''}{self.MODE_TEXT[mode]}"

    @on(RadioSet.Changed, "#update-mode")
    def _mode_changed(self) -> None:
        for mode in ("immediate", "lazy"):
            button = self.query_one(f"#mode-{mode}", RadioButton)
            button.label = self._label(mode, button.value)

    @property
    def mode(self) -> UpdateMode:
        lazy = self.query_one("#mode-lazy", RadioButton).value
        return UpdateMode.LAZY if lazy else UpdateMode.IMMEDIATE

    def _update(self) -> None:
        version = self.query_one("#update-version", Input).value.strip()
        if not version:
            self.query_one("#update-note", Static).update(Text("type a version first (a git ref or /absolute/path)",
                                                               "bold yellow"))
            return
        self.dismiss(UpdateChoice(version, self.mode))

    @on(Input.Submitted, "#update-version")
    def _submitted(self) -> None:
        self._update()

    @on(Button.Pressed, "#plan-update")
    def _plan_update(self) -> None:
        self._update()

    @on(Button.Pressed, "#plan-rollback")
    def _plan_rollback(self) -> None:
        self.dismiss(UpdateChoice("", self.mode, rollback=True))

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)
