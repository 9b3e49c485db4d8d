"""The job header and the verdict: the two things to read first."""

from __future__ import annotations

from collections.abc import Mapping

from rankscope.analyzers.eviction_scope import GROUP, eviction_scope, option_line
from rankscope.analyzers.labels import group_numbers
from rankscope.analyzers.topology import compact_machines
from rankscope.contract.ranks import compact_ranks
from rankscope.contract.snapshot import Layout
from rankscope.tui.analysis import StackView
from rankscope.tui.filter import Filter
from rankscope.tui.health import (
    RATE_WINDOW_S,
    Health,
    fmt_time,
    health,
    progress_age,
    recent_step_rate,
    running_capture_text,
)
from rankscope.tui.schedule import hang_capture_due
from rankscope.tui.state import AppState
from rankscope.tui.widgets.rank_map import group_glyph, group_style
from rich.text import Text
from textual.widgets import Static

HEALTH_STYLES = {"healthy": "bold green", "hung": "bold red", "slow": "bold yellow", "idle": "bold cyan",
                 "starting": "bold cyan", "finished": "bold cyan", "unknown": "dim", "stalled": "bold yellow"}


def layout_text(layout: Layout | None) -> str:
    if layout is None:
        return "layout unknown"
    parts = [f"{k.upper()}{v}" for k, v in (("tp", layout.tp), ("cp", layout.cp), ("ep", layout.ep),
                                            ("pp", layout.pp), ("dp", layout.dp)) if v > 1 or k in ("tp", "pp", "dp")]
    text = " ".join(parts)
    if layout.ranks_per_machine:
        text += f", {layout.ranks_per_machine}/machine"
    return text


def header_text(state: AppState, source: str, read_only: bool, filter_line: str = "",
                slow_machine: str | None = None) -> Text:
    """Line 1: the state first (what matters at 3 a.m.), its time, the machines; line 2: the job, where the data is from.

    ``slow_machine``: the fail-slow detectors' confident suspect. A job that
    is merely slower than it was can look "healthy" by its step rate alone.
    """
    h = health(state)
    if slow_machine and h.kind in ("healthy", "slow", "unknown"):
        h = Health("slow", f"slow: {slow_machine} (fail-slow detectors, key 7)")
    job = state.job_machines
    reachable = sum(1 for m in job if m.reachable)
    away = [m.name for m in job if not m.reachable]
    # After an eviction or a hot-update the job's agents restart with it: "restarting", never "lost".
    restarting = len(away) if state.awaiting_restart else sum(1 for name in away if name in state.restarting)
    lost = len(away) - restarting
    evicted = len(state.machines) - len(job)
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append("HUNG" + h.text[4:] if h.kind == "hung" else h.text, HEALTH_STYLES[h.kind])
    t.append_text(timing_text(state, h))
    t.append(f" │ {reachable}/{len(job)} machines")
    if restarting:
        t.append(f" {restarting} restarting", "yellow")
    if lost:
        t.append(f" {lost} lost", "bold red")
    if evicted:
        t.append(f" {evicted} evicted", "yellow")
    t.append("\n")
    # Who the job is leads the second line: at 80 columns the first line's end is cut.
    t.append(f"job {state.job_id or '?'}", "bold")
    t.append(f" │ world {state.world_size if state.world_size is not None else '?'} {layout_text(state.layout)} │ ")
    if read_only:
        t.append("[read-only] ", "bold cyan")
    if filter_line:
        t.append(filter_line + " │ ", "bold yellow")
    t.append(f"{source} │ polled {fmt_time(state.progress_points[-1][0] if state.progress_points else None)}"
             f" │ captured {fmt_time(state.capture_wall)} UTC", "dim")
    return t


def timing_text(state: AppState, h: Health) -> Text:
    """The job's time: its recent step rate, seconds since its last progress, and the count to the hang threshold
    (when the automatic capture runs); none of it for a job with no ranks running (an old rate is no rate now)."""
    t = Text()
    if h.kind in ("finished", "idle"):
        t.append(" │ - steps/s")
        return t
    rate = 0.0 if h.kind == "hung" else recent_step_rate(state)
    t.append(f" │ {rate:.2f} steps/s ({RATE_WINDOW_S:.0f} s)" if rate is not None else " │ - steps/s")
    age = progress_age(state)
    if age is None:
        return t
    left = state.hang_after_s - age
    if h.kind == "hung":
        mark = state.clock.progress_mark if state.clock is not None else state.last_progress_wall
        if state.capturing:
            t.append(" │ capturing", "bold red")
        elif state.capture_wall is not None and (mark is None or state.capture_wall >= mark):
            t.append(f" │ captured {fmt_time(state.capture_wall)}", "bold")
        else:
            t.append(" │ capture due" if hang_capture_due(state) else " │ not captured (s)", "bold red")
    elif h.kind == "stalled":
        t.append(f" │ hang + capture in {max(0.0, left):.0f} s", "bold yellow")
    else:
        t.append(f" │ progress {age:.0f} s ago, hang at {state.hang_after_s:.0f} s", "dim")
    return t


class JobHeader(Static):
    """Two lines: who the job is and how it is doing."""


def verdict_text_rich(view: StackView | None, flt: Filter, max_suspects: int = 3, progressing: bool = False,
                      stale: str | None = None, taken: float | None = None,
                      placement: Mapping[int, str] | None = None) -> Text:
    """``progressing``: the capture is of a job making steps (or the job is, and the capture carries no progress
    mark): ranks caught at different points of a step differ by timing alone, so no suspect is drawn, only how
    many differences there were (``y`` copies them).

    ``stale``: why the verdict no longer describes the job (``state.verdict_stale``); it is then shown as a
    record of the capture taken at ``taken``, for reading, and no action aims at it.

    ``placement`` (rank -> machine): with it the top suspect's line says what `e` evicts (``eviction_scope``, the
    plan the dialog and the drill's scorer use), so the Overview and the dialog cannot disagree.
    """
    t = Text(no_wrap=True, overflow="ellipsis")
    if view is None:
        t.append("no capture yet — press s to capture stacks", "dim")
        return t
    v = view.verdict
    if progressing and v.suspects:
        # A capture of a running job finds ranks at different points of a step; that is not a hang, and listing
        # its "suspects" (a desync, a rank in compute) told an engineer a healthy job was broken.
        if stale is not None:
            t.append(f"verdict of {fmt_time(taken)} (stale: {stale}; s captures again):", "bold")
        else:
            t.append(f"capture of {fmt_time(taken)}:", "bold")
        # On a line of its own: the line above is cut at the panel's width, and this is what must be read.
        t.append(f"\n {running_capture_text(view)} (y copies them)", "dim")
        for note in view.notes[:1]:
            t.append(f"\n note: {note}", "dim")
        return t
    if stale is not None:
        t.append(f"verdict of {fmt_time(taken)} (stale: {stale}; s captures again): ", "bold")
        t.append(v.summary, "dim")
    else:
        t.append("verdict: ", "bold")
        t.append(v.summary, "bold red" if v.suspects else "bold")
    advice = {f.ranks: f.advice for f in v.findings if f.advice}

    def look(style: str) -> str:
        # A stale verdict is a record of another time: its suspects are drawn dim, not in alarm colours.
        return "dim" if stale is not None else style

    for s in v.suspects[:max_suspects]:
        number = group_numbers(s)
        t.append(f"\n ▸ {s.kind.value.upper()}{' ' + number if number else ''}", look("bold yellow"))
        t.append(f"  machines {compact_machines(s.machines)}", look("bold"))
        t.append(f"  ranks {compact_ranks(s.ranks, 4)}", look(""))
        if s.state and s.kind.value != "desync":
            t.append(f"  [{s.state}]", look("bold red"))
        if flt.active and not (set(s.ranks) & flt.ranks):
            t.append("  (outside filter)", "dim")
        if s.kind.value == "desync":
            # Where each side is: the call sites (the evidence lines after the headline).
            for line in s.evidence[1:3]:
                t.append(f"\n    {line}", look("italic"))
        elif s.victims:
            # The root and the ranks waiting on it: one suspect, its victims are evidence.
            root = f"rank {compact_ranks(s.roots, 4)}; " if s.roots else ""
            t.append(f"\n    root: {root}{len(s.victims)} ranks wait on it (victims, not suspects): "
                     f"{compact_ranks(s.victims, 4)}", look(""))
        elif s.evidence:
            t.append(f"\n    {s.evidence[0]}", look("italic"))
        if s.ranks in advice:
            t.append(f"\n    {advice[s.ranks]}", look("bold cyan"))
        elif s is v.suspects[0] and placement is not None and stale is None:
            scope = eviction_scope(s, placement)
            t.append(f"\n    eviction (e): {option_line(scope.default)}: {scope.reason}", "bold")
            if scope.other is not None:
                what = "the whole group" if scope.other.scope == GROUP else "only the evidence"
                t.append(f"; or {what}: {option_line(scope.other)}", "")
        if s.diverging_frame:
            t.append("\n    diverges at ", look(""))
            t.append(s.diverging_frame, look("bold magenta"))
    if len(v.suspects) > max_suspects:
        t.append(f"\n   … {len(v.suspects) - max_suspects} more suspects (y copies all)", "dim")
    shown = {f.ranks for f in v.findings if any(s.ranks == f.ranks for s in v.suspects[:max_suspects])}
    for f in v.findings:
        if f.ranks not in shown:
            t.append(f"\n ◆ {f.kind}: {f.summary}", look("bold magenta"))
    if view.unreadable:
        for ranks, why in view.unreadable[:2]:
            t.append(f"\n no stack: ranks {compact_ranks(ranks, 6)} — {why}", look("yellow"))
    elif view.missing_ranks:
        t.append(f"\n missing stacks: ranks {compact_ranks(view.missing_ranks, 6)}", look("yellow"))
    for note in (*v.notes, *view.notes)[:2]:
        t.append(f"\n note: {note}", "dim")
    return t


class VerdictPanel(Static):
    """Suspect groups with kind, machines and one line of evidence, and the diverging frame."""


def legend_text(view: StackView | None, limit: int = 6) -> Text:
    t = Text()
    if view is None:
        t.append("? no stack  × lost", "dim")
        return t
    for g in view.groups[:limit]:
        t.append(group_glyph(g.index), group_style(g.index))
        t.append(f" {len(g.ranks)}× {g.summary.split(' | ')[0]}  ")  # the main thread's part; 2 shows the rest
    if len(view.groups) > limit:
        t.append(f"+{len(view.groups) - limit} groups  ", "dim")
    t.append("? no stack  × lost  ↻ restarting  ○ not captured since a restart", "dim")
    return t
