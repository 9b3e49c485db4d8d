"""The Actions view: the agents' audit log live, the hot-update history, standby sizing and the backup rule.

The audit rows come from every agent's audit stream (newest first), so a
read-only pane shows an eviction started in the other pane step by step.
The summary lines above say what a person needs before pressing e or b:
how many warm standbys the job should keep (ByteRobust §6.2: the P99 of a
binomial model of machine failures in a day) and which backup rule the
layout allows (§6.3, peers outside the rank's groups).
"""

from __future__ import annotations

from rankscope.tui.health import fmt_time
from rankscope.tui.state import AppState
from rankscope.tui.state_actions import KIND_LABELS, ActionLog
from rankscope.tui.widgets.table import LineTable
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

RESULT_STYLES = {"succeeded": "bold green", "failed": "bold red", "refused": "red", "cancelled": "yellow",
                 "started": "bold cyan", "requested": "cyan", "progress": "dim"}


def standby_line(machines: int, daily_failure_rate: float) -> Text:
    """'warm standbys (P99): 2 for 128 machines at 0.12 %/machine/day' (or why it cannot be sized)."""
    from rankscope.analyzers.standby import size_standby_pool
    from rankscope.contract.errors import RankscopeError

    t = Text()
    if machines <= 0:
        return t.append("warm standbys: no machines seen yet", "dim")
    try:
        s = size_standby_pool(machines, daily_failure_rate)
    except RankscopeError as exc:
        return t.append(f"warm standbys: {exc.message}", "yellow")
    t.append("warm standbys (P99, 24 h): ", "bold")
    t.append(f"{s.count}", "bold green")
    t.append(f" for {machines} machines at {daily_failure_rate * 100:.2f} %/machine/day "
             f"(expected failures {s.expected_failures:.2f}, pool short with p={s.probability_short:.3g}); "
             "sized for a day's failures: an eviction takes one per machine it evicts, over-eviction more")
    return t


def backup_line(state: AppState) -> Text:
    """The backup rule for the job's layout (peers outside the rank's groups), or why it is unknown."""
    from rankscope.analyzers.backup_plan import backup_plan
    from rankscope.contract.errors import RankscopeError

    t = Text()
    if state.layout is None:
        return t.append("backup peers: layout unknown (pass --tp/--pp/--dp); b still asks the agents", "dim")
    try:
        where = state.machine_of_rank()
        # Only a map of every rank names the machines; a partial one (ranks exiting, a restart) would be refused.
        whole = state.world_size is not None and set(where) >= set(range(state.world_size))
        plan = backup_plan(state.layout, world_size=state.world_size, machine_of=where if whole else None)
    except (RankscopeError, ValueError) as exc:
        message = exc.message if isinstance(exc, RankscopeError) else str(exc)
        return t.append(f"backup peers: {message}", "yellow")
    t.append("backup peers: ", "bold")
    t.append(f"rule {plan.rule}, ")
    t.append("safe" if plan.safe else "NOT safe", "green" if plan.safe else "bold red")
    pairs = " ".join(f"{p.rank}→{p.peer}" for p in plan.pairs[:8])
    more = f" … +{len(plan.pairs) - 8}" if len(plan.pairs) > 8 else ""
    t.append(f" ({pairs}{more})")
    return t


def history_text(log: ActionLog, limit: int = 4) -> Text:
    t = Text()
    history = log.history()
    t.append("update history: ", "bold")
    if not history:
        return t.append("none seen", "dim")
    for r in history[-limit:][::-1]:
        t.append(f"\n  {fmt_time(r.when)} {KIND_LABELS.get(r.kind, r.kind)} ")
        t.append(r.result, RESULT_STYLES.get(r.result, ""))
        t.append(f" {' '.join(r.machines)} by {r.who}: {r.what}")
    return t


def summary_text(state: AppState, log: ActionLog, read_only: bool, daily_failure_rate: float) -> Text:
    """What to know before pressing e or b: who may act, standby sizing and those on hand, backup rule, history."""
    t = Text()
    if read_only:
        t.append("[read-only] this session watches actions; it cannot start them\n", "bold cyan")
    else:
        t.append("e evict what the evidence names (ctrl+o: the whole group) · u hot-update / rollback · "
                 "b checkpoint backup\n", "bold")
    # The job's size in machines: from its layout when known (it stays the same across an eviction), else the
    # machines running ranks (idle standbys are the pool, not the job; evicted machines are out of it).
    per = state.layout.ranks_per_machine if state.layout is not None else None
    job = state.job_machines
    job_machines = (-(-state.world_size // per) if per and state.world_size
                    else sum(1 for m in job if m.ranks) or len(job))
    t.append_text(standby_line(job_machines, daily_failure_rate))
    idle = [m.name for m in job if m.reachable and not m.ranks]
    if idle and len(idle) < len(job):  # agents without ranks: the warm standbys on hand
        t.append(f"; on hand (agents without ranks): {' '.join(idle[:8])}"
                 + (f" +{len(idle) - 8}" if len(idle) > 8 else ""), "green")
    t.append("\n")
    t.append_text(backup_line(state))
    t.append("\n")
    t.append_text(history_text(log))
    for _address, note in log.notes:
        t.append(f"\n{note}", "yellow")
    return t


class ActionsPanel(Vertical):
    def __init__(self, *, id: str | None = None, daily_failure_rate: float = 0.0012) -> None:
        super().__init__(id=id)
        self.daily_failure_rate = daily_failure_rate
        self._shown: tuple[object, ...] = ()

    def compose(self) -> ComposeResult:
        yield Static(id="actions-summary")
        yield LineTable(id="audit-table")

    def show(self, state: AppState, log: ActionLog, read_only: bool) -> None:
        key = (log.version, state.machines, state.layout, state.world_size, read_only)
        if key == self._shown:
            return
        self._shown = key
        t = summary_text(state, log, read_only, self.daily_failure_rate)
        self.query_one("#actions-summary", Static).update(t)
        rows = []
        for line in reversed(log.lines):
            r = line.record
            what = r.message if r.result == "progress" or (r.message and r.result not in ("started", "requested")) \
                else r.what
            # What happened before who did it: a long "who" (user@host (rankscope attach) (act token)) pushed
            # "what" off an 80-column screen.
            rows.append((fmt_time(r.when), " ".join(r.machines) or line.address,
                         KIND_LABELS.get(r.kind, str(r.kind)), Text(r.result, RESULT_STYLES.get(r.result, "")),
                         what, r.who))
        self.query_one("#audit-table", LineTable).set_rows(("time", "machines", "action", "result", "what", "who"),
                                                           rows)
