"""The job header and the verdict: the two things to read first."""

from __future__ import annotations

from collections.abc import Mapping

from rankscope.analyzers.eviction_scope import GROUP, eviction_scope, option_line
from rankscope.analyzers.findings import Suspect
from rankscope.analyzers.labels import group_name, group_numbers, suspect_label
from rankscope.analyzers.render import headline, headline_parts
from rankscope.contract.ranks import compact_machines, compact_ranks
from rankscope.contract.snapshot import DIMS, Layout
from rankscope.tui.analysis import StackView
from rankscope.tui.filter import Filter
from rankscope.tui.health import (
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


def layout_text(layout: Layout | None, per_machine: bool = True) -> str:
    """The layout's one text (``Layout.sizes_text``, as analyze and the backup plan word it), or that it is unknown."""
    return "layout unknown" if layout is None else layout.sizes_text(per_machine=per_machine)


def header_text(state: AppState, source: str, read_only: bool, filter_line: str = "",
                slow_machine: str | None = None, width: int | None = None) -> Text:
    """Line 1: the state first (what matters at 3 a.m.), the machines, then the job's time (``_state_line``); line 2:
    the job, where the data is from. ``width`` (the screen's columns): the first line says less until it fits, and
    below 120 the second line says less (the layout without the world size, the poll time without the capture's,
    which the verdict shows), so an 80-column screen keeps both whole.

    ``slow_machine``: the fail-slow detectors' confident suspect. A job that
    is merely slower than it was can look "healthy" by its step rate alone.
    """
    h = health(state)
    fail_slow = bool(slow_machine) and h.kind in ("healthy", "slow", "unknown")
    narrow = width is not None and width < 120
    # At 80 columns the line lost its countdown ("step 0 s a…"): it says less until it fits (the padding takes 2).
    room = width - 2 if width is not None else None
    t = _state_line(state, h, slow_machine if fail_slow else None, 0)
    for detail in (1, 2):
        if room is None or t.cell_len <= room:
            break
        t = _state_line(state, h, slow_machine if fail_slow else None, detail)
    t.append("\n")
    # Who the job is leads the second line.
    t.append(f"job {state.job_id or '?'}", "bold")
    if narrow:
        t.append(f" │ {layout_text(state.layout, per_machine=False)} │ ")
    else:
        t.append(f" │ world {state.world_size if state.world_size is not None else '?'} {layout_text(state.layout)} │ ")
    if read_only:
        t.append("[read-only] ", "bold cyan")
    if filter_line:
        t.append(filter_line + " │ ", "bold yellow")
    polled = fmt_time(state.progress_points[-1][0] if state.progress_points else None)
    if narrow:
        t.append(f"{source} │ polled {polled}", "dim")
    else:
        t.append(f"{source} │ polled {polled} │ captured {fmt_time(state.capture_wall)} UTC", "dim")
    return t


def _state_line(state: AppState, h: Health, slow_machine: str | None, detail: int) -> Text:
    """The header's first line: the state first (what matters at 3 a.m.), the machines, then the job's time.
    ``detail`` 0 says it all; 1 leaves out what the rhythm is and names view 7 by its key only; 2 also the step rate
    (the Metrics and Fail-slow views show it) and says the state in its short words (``Health.short``): an 80-column
    screen keeps the state, the machines and the countdown."""
    if slow_machine:
        h = Health("slow", f"slow: {slow_machine} ({'fail-slow, ' if detail == 0 else ''}key 7)")
    job = state.job_machines
    reachable = sum(1 for m in job if m.reachable)
    away = [m.name for m in job if not m.reachable]
    # After an eviction or a hot-update the job's agents restart with it: "restarting", never "lost".
    restarting = len(away) if state.awaiting_restart else sum(1 for name in away if name in state.restarting)
    lost = len(away) - restarting
    evicted = len(state.machines) - len(job)
    t = Text(no_wrap=True, overflow="ellipsis")
    said = h.short if detail >= 2 and h.short else h.text
    t.append("HUNG" + said[4:] if h.kind == "hung" else said, HEALTH_STYLES[h.kind])
    # The machines before the time: were the line cut, a lost machine must not be.
    t.append(f" │ {reachable}/{len(job)} machines")
    if restarting:
        t.append(f" {restarting} restarting", "yellow")
    if lost:
        t.append(f" {lost} lost", "bold red")
    if evicted:
        t.append(f" {evicted} evicted", "yellow")
    t.append_text(timing_text(state, h, with_basis=detail == 0, with_rate=detail < 2))
    return t


def timing_text(state: AppState, h: Health, with_basis: bool = True, with_rate: bool = True) -> Text:
    """The job's time: its recent step rate, seconds since its last progress, and the count to the hang threshold
    (the job's own rhythm, ``AppState.hang``, whose basis ``with_basis`` says; the automatic capture runs then); none
    of it for a job with no ranks running (an old rate is no rate now)."""
    t = Text()
    if h.kind in ("finished", "idle"):
        t.append(" │ - steps/s")
        return t
    rate = 0.0 if h.kind == "hung" else recent_step_rate(state)
    if with_rate:
        t.append(f" │ {rate:.2f} steps/s" if rate is not None else " │ - steps/s")
    age = progress_age(state)
    if age is None:
        return t
    hang = state.hang
    left = hang.seconds - age
    if h.kind == "hung":
        mark = state.clock.progress_mark if state.clock is not None else state.last_progress_wall
        if state.capturing:
            t.append(" │ capturing", "bold red")
        elif state.capture_wall is not None and (mark is None or state.capture_wall >= mark):
            t.append(f" │ captured {fmt_time(state.capture_wall)}", "bold")
        else:
            t.append(" │ capture due" if hang_capture_due(state) else " │ not captured (s)", "bold red")
    elif h.kind == "stalled":
        t.append(f" │ hang + capture in {max(0.0, left):.0f} s" + (f" ({hang.basis()})" if with_basis else ""),
                 "bold yellow")
    else:
        t.append(f" │ step {age:.0f} s ago, hang at {hang.seconds:.0f} s" + (f" ({hang.basis()})" if with_basis else ""),
                 "dim")
    return t


class JobHeader(Static):
    """Two lines: who the job is and how it is doing."""


def verdict_text_rich(view: StackView | None, flt: Filter, max_suspects: int = 3, progressing: bool = False,
                      stale: str | None = None, taken: float | None = None,
                      placement: Mapping[int, str] | None = None, acting: bool = True) -> Text:
    """``progressing``: the capture is of a job making steps (or the job is, and the capture carries no progress
    mark): ranks caught at different points of a step differ by timing alone, so no suspect is drawn, only how
    many differences there were (``y`` copies them).

    ``stale``: why the verdict no longer describes the job (``state.verdict_stale``); it is then shown as a
    record of the capture taken at ``taken``, for reading, and no action aims at it.

    ``placement`` (rank -> machine): with it the top suspect's line says what `e` evicts (``eviction_scope``, the
    plan the dialog and the drill's scorer use), so the Overview and the dialog cannot disagree. ``acting``: False
    in a read-only view, which has no `e`: the line says it is the acting view's plan.
    """
    t = Text(no_wrap=True, overflow="ellipsis")
    if view is None:
        t.append("no capture yet — press s to capture stacks", "dim")
        return t
    v = view.verdict
    if progressing and v.suspects:
        # A capture of a running job finds ranks at different points of a step; that is not a hang, and listing
        # its "suspects" (a desync, a rank in compute) told an engineer a healthy job was broken.
        # It named no verdict, so none can go stale: "verdict of … (stale: its suspects … were evicted)" over
        # "no verdict" told two stories.
        t.append(f"capture of {fmt_time(taken)}:", "bold")
        # On a line of its own: the line above is cut at the panel's width, and this is what must be read.
        t.append(f"\n {running_capture_text(view)} (y copies them)", "dim")
        for note in view.notes[:1]:
            t.append(f"\n note: {note}", "dim")
        return t
    if stale is not None:
        t.append(f"verdict of {fmt_time(taken)} (stale: {stale}; s captures again): ", "bold")
        t.append(headline(v), "dim")
    else:
        t.append("verdict: ", "bold")
        # The root on a line of its own: at 80 columns the end of one long line was cut ("root rank 2 (…").
        head, root = headline_parts(v)
        t.append(head, "bold red" if v.suspects else "bold")
        if root:
            t.append(f"\n   {root}", "bold red")
    advice = {f.ranks: f.advice for f in v.findings if f.advice}

    def look(style: str) -> str:
        # A stale verdict is a record of another time: its suspects are drawn dim, not in alarm colours.
        return "dim" if stale is not None else style

    for s in v.suspects[:max_suspects]:
        number = group_numbers(s)
        # "PP 6-7" read as ranks 6-7: the groups are named as groups.
        name = group_name(s.kind.value, s.groups or ((s.group_index,) if s.group_index is not None else ())) \
            if s.kind.value in DIMS else \
            f"{s.kind.value.upper()}{' ' + number if number else ''}"
        t.append(f"\n ▸ {name}", look("bold yellow"))
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
            t.append("\n    ")
            t.append_text(eviction_line(s, placement, acting))
        frame, where = root_diverging_frame(view, s)
        if frame:
            t.append(f"\n    {where}diverges at ", look(""))
            t.append(frame, look("bold magenta"))
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


def eviction_line(s: Suspect, placement: Mapping[int, str], acting: bool = True) -> Text:
    """What `e` evicts for ``s`` and the alternative one key away (``eviction_scope``, the dialog's plan), then why:
    the plan first, the reason last, so an 80-column screen keeps the alternative whole."""
    scope = eviction_scope(s, placement)
    key, alt = ("e", "ctrl+o") if acting else ("acting view's e", "or")
    t = Text()
    t.append(f"{key}: {option_line(scope.default)}", "bold")
    if scope.other is not None:
        what = "group" if scope.other.scope == GROUP else "only the evidence"
        n = scope.other.standbys
        t.append(f"; {alt} {what}: {compact_machines(scope.other.machines)} ({n} standby{'s' if n != 1 else ''})")
    t.append(f" — {scope.reason}", "dim")
    return t


def failslow_verdict_text(summary: str, s: Suspect, placement: Mapping[int, str], acting: bool = True) -> Text:
    """The Overview's verdict while the job runs and the fail-slow detectors name a machine (view 7 has the
    detail): their summary, the machine and its degrader group, and what `e` evicts. The summary on a line of its
    own: after the label, at 80 columns with the drill's machine names it was cut inside its headline ("fail-slow:
    machine machine-2 (ranks 4-5) (non-com…"); its evidence, last, is what a narrow line loses."""
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append("fail-slow verdict (view 7):", "bold")
    t.append(f"\n  {summary}", "bold yellow")
    slow = sorted({placement.get(r, "?") for r in s.roots}) if s.roots else s.machines
    t.append(f"\n ▸ slow: {compact_machines(slow)}", "bold yellow")
    if s.roots and s.victims:
        t.append(f"  in {suspect_label(s)}; {len(s.victims)} ranks wait on it")
    t.append("\n    ")
    t.append_text(eviction_line(s, placement, acting))
    return t


def root_diverging_frame(view: StackView, s: Suspect) -> tuple[str | None, str]:
    """Where the suspect leaves the dominant path, and whose stack that is: the root's stack group where the
    evidence pins a root (the Stacks view's "group C diverges at send_forward"), not the frame where its victims
    leave it (the suspect's ``diverging_frame`` is taken over all its outlier ranks)."""
    for root in s.roots[:1]:
        index = view.group_of_rank.get(root)
        group = next((g for g in view.groups if g.index == index), None)
        if group is not None and group.diverging_frame:
            return group.diverging_frame, f"root rank {root} (group {group_glyph(group.index)}) "
    return s.diverging_frame, ""


class VerdictPanel(Static):
    """Suspect groups with kind, machines and one line of evidence, and the diverging frame."""


def legend_text(view: StackView | None, limit: int = 6, width: int | None = None) -> Text:
    """The map's legend: each stack group, then the marks. ``width``: entries are laid out on lines of that many
    cells, never broken inside (the legend wrapped "B 2×" away from "send (…)")."""
    entries: list[Text] = []
    if view is not None:
        for g in view.groups[:limit]:
            entry = Text(group_glyph(g.index), group_style(g.index))
            entry.append(f" {len(g.ranks)}× {g.main_summary}")
            entries.append(entry)
        if len(view.groups) > limit:
            entries.append(Text(f"+{len(view.groups) - limit} groups", "dim"))
    marks = ("? no stack", "× lost") if view is None else \
        ("? no stack", "× lost", "↻ restarting", "○ not captured since a restart")
    entries.extend(Text(m, "dim") for m in marks)
    t = Text()
    used = 0
    for entry in entries:
        n = entry.cell_len
        if used and width is not None and used + 2 + n > width:
            t.append("\n")
            used = 0
        elif used:
            t.append("  ")
            used += 2
        t.append_text(entry)
        used += n
    return t
