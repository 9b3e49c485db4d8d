"""View 7, fail-slow: which machine slows the job, how sure the detectors are, since when.

Top to bottom: the verdict line with its confidence and how long the
slowdown has lasted; a heat map of step time (machines as rows, ranks as
cells coloured by their step time over the job median, packed several ranks
to a cell when a machine has more ranks than the width holds, slowest
machines kept when there are more machines than rows); the suspect machine's
step time against its peers' median as two sparklines on one scale; the
detectors' history round by round; their flags now. The history comes before
the flags: it is a few lines, while each flag carries its evidence.

Glyphs carry the meaning as well as colours (▲ slow, ■ normal, · unknown),
so the screen reads the same without colour.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

from rankscope.contract.ranks import compact_ranks
from rankscope.tui.failslow_state import FailSlowView, HeatRow, RoundFlags, detectors_seen
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

SLOW_RATIO = 1.2  # the step-time detector's default threshold (FailSlowConfig.step_ratio)
WARM_RATIO = 1.1
_BARS = "▁▂▃▄▅▆▇█"
_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def fmt_duration(s: float) -> str:
    s = max(0.0, s)
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def _cell(ratio: float | None) -> tuple[str, str]:
    if ratio is None or not math.isfinite(ratio):
        return "·", "grey50"
    if ratio >= SLOW_RATIO:
        return "▲", "bold red"
    if ratio >= WARM_RATIO:
        return "■", "yellow"
    return "■", "green"


def summary_text(view: FailSlowView, hung: str | None = None) -> Text:
    """``hung``: the job's state when it makes no steps (a hang). A rank's step time is then the time since its
    last step (a stuck step grows: ``analyzers.series``), so the figures below are that, and the view says so
    first ("the figures below are of the steps before it" stood over "job step 67.7 s", the hang's age)."""
    if hung is not None:
        head = Text(f"{hung}: no step ends while the job makes no steps, so the step times below are the time "
                    "since each rank's last step; a hang is judged by the verdict (1 Overview), not by slowness\n",
                    "bold yellow")
        return Text.assemble(head, _summary(view, "time since the last step"))
    return _summary(view, "job step")


def _summary(view: FailSlowView, step_label: str) -> Text:
    v = view.verdict
    if v is None:
        return Text("fail-slow: the detectors need a series of snapshots with step counters: attach to the job "
                    "(--fail-slow adds a stack round every 10 s), or open a series recorded by "
                    "`rankscope watch --record`", "dim")
    style = "bold red" if v.confident else ("yellow" if v.verdict.suspects else "green")
    out = Text.assemble((v.verdict.summary, style))
    out.append(f"\nconfidence {v.confidence:.2f}{' (confident)' if v.confident else ''} · "
               f"{view.updates} rounds", "bold" if v.confident else "")
    slow_for = view.slow_for_s
    if slow_for is not None and v.slow_since_mono is not None:
        # The detectors' own clock is each agent's monotonic one (time since its boot), no job time: only the
        # duration is shown ("job time 2164 s" of a 90 s job was that clock).
        out.append(f" · slow for {fmt_duration(slow_for)}", "bold red" if v.confident else "yellow")
    if view.job_step_s is not None:
        out.append(f" · {step_label} {view.job_step_s:.3g} s")
    if view.skipped:
        out.append(f" · {view.skipped} polls skipped while the detectors were busy", "yellow")
    for e in view.errors:
        out.append(f"\n{e}", "red")
    trend_line = v.trend.evidence() if v.trend is not None else None
    for note in v.verdict.notes:  # what the detectors could not see, and why (unreachable agents, failed sampling)
        if note != trend_line:  # the job step is on the line above
            out.append(f"\n{note}", "yellow")
    return out


def _pack(ratios: Sequence[float | None], cells: int) -> list[float | None]:
    """Several ranks to a cell when they do not fit: the cell shows its slowest rank."""
    if len(ratios) <= cells:
        return list(ratios)
    per = math.ceil(len(ratios) / cells)
    out: list[float | None] = []
    for i in range(0, len(ratios), per):
        known = [r for r in ratios[i:i + per] if r is not None]
        out.append(max(known) if known else None)
    return out


def heat_text(view: FailSlowView, width: int, max_rows: int, suspects: Sequence[str] = (),
              evicted: Collection[str] = (), hung: bool = False) -> Text:
    """``hung``: the step column holds each machine's time since its last step (a stuck step grows), headed
    "stuck", never "step" ("machine-1 1.00 67.7" under "step" read as a 67.7 s step)."""
    rows = list(view.heat)
    out = Text()
    if not rows:
        return Text("no step times yet", "dim")
    hidden = 0
    if len(rows) > max_rows:
        keep = {h.machine for h in sorted(rows, key=lambda h: -_worst(h))[:max_rows]}
        keep.update(s for s in suspects if any(h.machine == s for h in rows))
        hidden = len(rows) - len(keep)
        rows = [h for h in rows if h.machine in keep]
    name_w = min(16, max(len(h.machine) for h in rows))
    room = max(4, width - name_w - 16)
    per = max(1, math.ceil(max(len(h.ranks) for h in rows) / room))
    out.append(f"{'machine':<{name_w}} {'×med':>5} {'stuck' if hung else 'step':>6}  ranks"
               + (f" ({per} per cell, slowest shown)" if per > 1 else "") + "\n", "bold")
    for h in rows:
        _row(out, h, name_w, room, h.machine in suspects, h.machine in evicted)
    if hidden:
        out.append(f"… {hidden} more machines, none slower than those shown\n", "dim")
    out.append("▲", "bold red")
    out.append(f" ≥{SLOW_RATIO}× job median  ")
    out.append("■", "yellow")
    out.append(f" ≥{WARM_RATIO}×  ")
    out.append("■", "green")
    out.append(" normal  · unknown", "")
    even = [h.machine for h in rows if h.machine in suspects and (h.ratio is None or h.ratio < SLOW_RATIO)]
    if even and not hung:
        # Synchronous training: every rank's step lasts as long as the slowest's, so the slow machine's step is the
        # job's; "machine-2 ×med 0.98" beside "slow: machine-2" read as a contradiction.
        out.append(f"\n{', '.join(even)}: its step takes as long as every rank's (each waits for the slowest at "
                   "the collectives); the detectors name it by who arrives last and who is waited on "
                   "(flags below)", "dim")
    return out


def _worst(h: HeatRow) -> float:
    """How slow a machine looks at its worst: its median or its slowest rank (one straggling GPU counts)."""
    return max([h.ratio or 0.0, *(r for r in h.ratios if r is not None)])


def _row(out: Text, h: HeatRow, name_w: int, room: int, suspect: bool, evicted: bool = False) -> None:
    name = h.machine[:name_w]
    out.append(f"{name:<{name_w}}", "bold red" if suspect else ("dim red" if not h.reachable else ""))
    ratio = f"{h.ratio:.2f}" if h.ratio is not None else "-"
    _, style = _cell(h.ratio)
    out.append(f" {ratio:>5}", style)
    out.append(f" {h.step_s:>6.3g}" if h.step_s is not None else f" {'-':>6}")
    out.append("  ")
    for r in _pack(h.ratios, room):
        g, s = _cell(r)
        out.append(g, s)
    if evicted:  # its agent was stopped with it: out of the job, not lost
        out.append(" evicted", "dim yellow")
    elif not h.reachable:
        out.append(" lost", "dim red")
    out.append("\n")


def flags_text(view: FailSlowView) -> Text:
    v = view.verdict
    out = Text("detector flags now\n", "bold")
    if v is None or not v.flags:
        out.append("none: no detector flags a machine", "green")
        return out
    for f in sorted(v.flags, key=lambda f: (not f.alarmed, -f.score)):
        mark = "●" if f.alarmed else "○"
        # held/required in the detector's own unit (flags.held's): stack rounds, CCL updates, else seconds
        unit = {"stacks": " rounds", "ccl": " updates"}.get(f.detector, " s")
        held = f" held {f.held:.0f}/{f.required:.0f}{unit}" if f.required else ""
        ranks = f"r{compact_ranks(f.ranks, 2)}" if f.ranks else "-"
        out.append(f"{mark} {f.detector:<9} {f.machine or '-':<10} {ranks:<9}{held:>20} ",
                   "bold red" if f.alarmed else "yellow")
        out.append(f"{f.evidence}\n")
    out.append("● alarmed (held long enough) ○ flagged, not yet held", "dim")
    return out


def history_text(rounds: Sequence[RoundFlags], columns: int, total: int = 0) -> Text:
    """Detectors as rows, the last rounds as columns; each cell names the machine flagged (a letter)."""
    shown = list(rounds)[-max(1, columns):]
    out = Text(f"history: the last {len(shown)} of {total or len(shown)} rounds, oldest left\n", "bold")
    if not shown:
        out.append("no rounds yet", "dim")
        return out
    letters: dict[str, str] = {}

    def letter(machine: str) -> str:
        if machine not in letters:
            letters[machine] = _LETTERS[len(letters) % len(_LETTERS)]
        return letters[machine]

    for r in shown:  # letters in order of first appearance, the verdict first
        if r.suspect:
            letter(r.suspect)
    label_w = 9
    line = Text(f"{'verdict':<{label_w}} ")
    for r in shown:
        if r.suspect is None:
            line.append("·", "green")
        else:
            line.append(letter(r.suspect), "bold red" if r.confident else "yellow")
    out.append_text(line)
    out.append("\n")
    for det in detectors_seen(shown):
        line = Text(f"{det:<{label_w}} ")
        for r in shown:
            hits = [(m, a) for d, m, a in r.flags if d == det and m is not None]
            if not hits:
                line.append("·", "grey50")
            elif len({m for m, _ in hits}) > 1:
                line.append("*", "yellow")
            else:
                m, alarmed = hits[0][0], any(a for _, a in hits)
                g = letter(m)
                line.append(g if alarmed else g.lower(), "bold red" if alarmed else "yellow")
        out.append_text(line)
        out.append("\n")
    if letters:
        out.append("  ".join(f"{g}={m}" for m, g in letters.items()), "dim")
        out.append("  (capital: alarmed, small: flagged, *: several)", "dim")
    return out


def spark_pair(a: Sequence[float], b: Sequence[float], width: int) -> tuple[str, str]:
    """Two sparklines on one scale from zero, so bar heights compare as ratios and noise stays small."""
    a, b = list(a)[-width:], list(b)[-width:]
    vals = [x for x in (*a, *b) if math.isfinite(x)]
    if not vals:
        return "", ""
    lo, hi = min(0.0, *vals), max(vals)

    def line(xs: Sequence[float]) -> str:
        if hi == lo:
            return "".join(_BARS[0] if math.isfinite(x) else " " for x in xs)
        return "".join(_BARS[min(7, int((x - lo) / (hi - lo) * 7.999))] if math.isfinite(x) else " " for x in xs)

    return line(a), line(b)


def spark_text(view: FailSlowView, width: int) -> Text:
    if view.suspect is None or not view.suspect_steps:
        return Text("step time: no suspect to follow yet", "dim")
    a, b = spark_pair(view.suspect_steps, view.peer_steps, max(8, width - 30))
    last_a = next((x for x in reversed(view.suspect_steps) if math.isfinite(x)), math.nan)
    last_b = next((x for x in reversed(view.peer_steps) if math.isfinite(x)), math.nan)
    label_w = min(16, max(len(view.suspect), 5))
    role = "suspect" if view.verdict is not None and view.suspect in view.verdict.machines else "slowest"
    out = Text(f"step time of {view.suspect} ({role}) vs the other machines' median, one scale from 0 s\n", "bold")
    out.append(f"{view.suspect[:label_w]:<{label_w}} ", "bold red")
    out.append(a, "red")
    out.append(f" {last_a:.3g} s\n" if math.isfinite(last_a) else " - s\n")
    out.append(f"{'peers':<{label_w}} ")
    out.append(b, "green")
    out.append(f" {last_b:.3g} s" if math.isfinite(last_b) else " - s")
    return out


class FailSlowPanel(VerticalScroll, can_focus=True):
    """Draws a ``FailSlowView``; redraws only when a new view arrives or the size changed."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._shown: tuple[object, ...] | None = None

    def compose(self) -> ComposeResult:
        yield Static(id="fs-summary")
        yield Static(id="fs-heat")
        yield Static(id="fs-spark")
        yield Static(id="fs-history")
        yield Static(id="fs-flags")

    def show(self, view: FailSlowView | None, width: int, height: int, evicted: frozenset[str] = frozenset(),
             hung: str | None = None) -> None:
        from rankscope.tui.failslow_state import EMPTY

        view = view or EMPTY
        key = (view, width, height, evicted, hung)
        if self._shown is not None and self._shown[0] is view and self._shown[1:] == key[1:]:
            return
        self._shown = key
        width = max(40, width - 2)
        suspects = view.verdict.machines if view.verdict is not None else ()
        self.query_one("#fs-summary", Static).update(summary_text(view, hung))
        self.query_one("#fs-heat", Static).update(heat_text(view, width, max(4, height // 3), suspects, evicted,
                                                            hung is not None))
        self.query_one("#fs-spark", Static).update(spark_text(view, width))
        self.query_one("#fs-flags", Static).update(flags_text(view))
        self.query_one("#fs-history", Static).update(history_text(view.rounds, width - 12, view.updates))
