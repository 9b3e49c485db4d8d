"""What the TUI shows about stacks, built from a capture (off the UI thread).

The grouping, the prefix tree and the verdict come from the one analysis
(``rankscope.analyzers.analysis.analyze_job``, as ``rankscope analyze`` and
the drill's scorer get them). If it fails on a snapshot the views still show
the stacks grouped by a plain signature, with a note saying so: a broken
analyzer must never blank the screen of someone in the middle of an
incident.

Everything here is a pure function of a snapshot, so the same capture always
draws the same screen (snapshot tests rely on that).
"""

from __future__ import annotations

import linecache
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from rankscope.analyzers.analysis import analyze_job
from rankscope.analyzers.findings import Verdict, VerdictStatus
from rankscope.analyzers.progress import ProgressAtCapture
from rankscope.analyzers.render import headline, verdict_lines
from rankscope.analyzers.rounds import StackRound, round_of
from rankscope.analyzers.stacks import diverging_frame
from rankscope.contract.heap import collector_paused
from rankscope.contract.ranks import compact_ranks
from rankscope.contract.snapshot import Frame, JobSnapshot, Layout, RankStacks, main_thread


@dataclass(frozen=True, slots=True)
class GroupView:
    """One stack group: ranks that share a signature, largest group first."""

    index: int
    ranks: tuple[int, ...]
    summary: str  # the innermost frame worth naming
    frames: tuple[str, ...]  # outermost first, as a person reads a call path
    signature: str
    diverging_frame: str | None = None  # where it leaves the dominant path (None for the dominant group)
    main_part: str = ""  # the summary's main-thread part, where the summary names other threads too

    @property
    def main_summary(self) -> str:
        """The main thread's part of ``summary`` (one legend line; view 2 shows the rest)."""
        return self.main_part or self.summary


@dataclass(frozen=True, slots=True)
class TreeNode:
    """A node of the prefix tree: a frame and the ranks whose stacks pass through it."""

    frame: str
    ranks: tuple[int, ...]
    children: tuple[TreeNode, ...] = ()


@dataclass(frozen=True, slots=True)
class StackView:
    groups: tuple[GroupView, ...]
    group_of_rank: Mapping[int, int]
    tree: TreeNode
    verdict: Verdict
    missing_ranks: tuple[int, ...] = ()
    notes: tuple[str, ...] = field(default=())
    # ranks without a readable stack, grouped by their state and why: "unreadable: permission, process state D"
    unreadable: tuple[tuple[tuple[int, ...], str], ...] = ()
    round: StackRound | None = None  # the capture's stack round, which the fail-slow detector counts
    # The timing judgement of the one analysis: the capture caught the job making steps (``verdict`` keeps the
    # suspects it set aside; JobAnalysis.fault_verdict), and when the job last progressed per its agents.
    timing_not_fault: bool = False
    progress: ProgressAtCapture | None = None

    @property
    def dominant(self) -> GroupView | None:
        return self.groups[0] if self.groups else None


# --------------------------------------------------------------------------
# rank ranges, frames
# --------------------------------------------------------------------------


def frame_label(frame: Frame) -> str:
    base = frame.filename.rsplit("/", 1)[-1]
    return f"{frame.name} ({base})"


def rank_path(rs: RankStacks) -> tuple[str, ...]:
    """A rank's main call path, outermost first (py-spy reports innermost first)."""
    main = main_thread(rs.main)
    return tuple(frame_label(f) for f in reversed(main.frames)) if main is not None else ()


def diverging_index(a: Sequence[str], b: Sequence[str]) -> int:
    """Index of the first frame where two paths differ (len of the shorter when one is a prefix)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def source_line(frame: Frame) -> str | None:
    """The source line of a frame when the file is readable here (same paths as the job)."""
    if frame.line is None or frame.native:
        return None
    text = linecache.getline(frame.filename, frame.line).strip()
    return text or None


class StackLine(StrEnum):
    """What a line of a rank's capture shows (the rank screen styles each kind)."""

    PROCESS = "process"
    THREAD = "thread"
    PROBLEM = "problem"  # no stack for a process, and its fix
    FRAME = "frame"
    SOURCE = "source"  # the source line of the frame above


def rank_stack_entries(rs: RankStacks, with_source: bool = True) -> list[tuple[str, StackLine]]:
    """A rank's full capture, line by line with what each shows: every thread of the main process and of each
    subprocess."""
    lines: list[tuple[str, StackLine]] = []
    for proc in (rs.main, *rs.subprocesses):
        lines.append((f"process {proc.pid} [{proc.role.value}] {proc.name}".rstrip(), StackLine.PROCESS))
        if proc.error is not None:
            lines.append((f"  no stack: {proc.error.kind.value}: {proc.error.message}", StackLine.PROBLEM))
            if proc.error.fix:
                lines.append((f"  fix: {proc.error.fix}", StackLine.PROBLEM))
            continue
        for t in proc.threads or ():
            flags = " ".join(x for x, on in (("active", t.active), ("gil", t.owns_gil)) if on)
            lines.append((f"  thread {t.thread_name or t.thread_id} {flags}".rstrip(), StackLine.THREAD))
            for f in t.frames:  # innermost first, like py-spy
                where = f"{f.filename}:{f.line}" if f.line is not None else f.filename
                lines.append((f"    {f.name} ({where})", StackLine.FRAME))
                src = source_line(f) if with_source else None
                if src:
                    lines.append((f"        {src}", StackLine.SOURCE))
    return lines


def rank_stack_lines(rs: RankStacks, with_source: bool = True) -> list[str]:
    """A rank's full capture as text (``rank_stack_entries``' lines)."""
    return [line for line, _ in rank_stack_entries(rs, with_source)]


# --------------------------------------------------------------------------
# building the view
# --------------------------------------------------------------------------


def _fallback_groups(stacks: Mapping[int, RankStacks]) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
    by_path: dict[tuple[str, ...], list[int]] = {}
    for rank in sorted(stacks):
        by_path.setdefault(rank_path(stacks[rank]), []).append(rank)
    return sorted(((p, tuple(r)) for p, r in by_path.items()), key=lambda x: (-len(x[1]), x[1][0]))


def _tree_from_paths(paths: Mapping[int, tuple[str, ...]]) -> TreeNode:
    """Build the prefix tree of call paths (outermost first)."""

    # Without recursion (a stack can be thousands of frames deep): nodes are listed parents first, then built
    # from the last back, so every child exists before its parent.
    nodes: list[tuple[str, list[int], list[int]]] = [("all ranks", sorted(paths), [])]  # frame, ranks, children
    depth_of = [0]
    i = 0
    while i < len(nodes):
        _, ranks, kids = nodes[i]
        depth = depth_of[i]
        children: dict[str, list[int]] = {}
        for r in ranks:
            p = paths[r]
            if len(p) > depth:
                children.setdefault(p[depth], []).append(r)
        for f, rs in sorted(children.items(), key=lambda x: (-len(x[1]), x[0])):
            kids.append(len(nodes))
            nodes.append((f, rs, []))
            depth_of.append(depth + 1)
        i += 1
    built: list[TreeNode | None] = [None] * len(nodes)
    for k in range(len(nodes) - 1, -1, -1):
        frame, ranks, kids = nodes[k]
        built[k] = TreeNode(frame, tuple(ranks), tuple(b for c in kids if (b := built[c]) is not None))
    root = built[0]
    assert root is not None
    return root


def _convert_tree(node: Any) -> TreeNode:
    """The analyzers' tree as the view's, without recursion (a stack can be thousands of frames deep)."""
    order: list[Any] = []  # parents before their children
    pending = [node]
    while pending:
        n = pending.pop()
        order.append(n)
        pending.extend(n.children)
    done: dict[int, TreeNode] = {}
    for n in reversed(order):
        done[id(n)] = TreeNode(str(n.frame), tuple(n.ranks), tuple(done.pop(id(c)) for c in n.children))
    return done[id(node)]


def build_stack_view(snapshot: JobSnapshot, layout: Layout | None = None) -> StackView:
    """Group the capture's stacks and judge them; never raises on a bad analyzer."""
    stacks = snapshot.all_stacks()
    known = set(snapshot.rank_to_machine())
    missing = tuple(sorted(r for r in known if r not in stacks or stacks[r].main.threads is None))
    notes: list[str] = []
    try:
        return _from_analyzers(snapshot, layout, missing)
    except Exception as exc:  # the analyzer is someone else's code; show what we can
        notes.append(f"stack analyzer failed ({type(exc).__name__}: {exc}); groups by main-thread path")
    # The plain paths only where the analysis failed: every rank's path again is a second pass at 16k ranks.
    usable = {r: s for r, s in stacks.items() if s.main.threads is not None}
    paths = {r: rank_path(s) for r, s in usable.items()}
    found = _fallback_groups(usable)
    top = found[0][0] if found else ()
    groups = tuple(
        GroupView(i, ranks, path[-1] if path else "(empty stack)", path, " / ".join(path),
                  None if i == 0 else (path[diverging_index(top, path)] if diverging_index(top, path) < len(path)
                                       else None))
        for i, (path, ranks) in enumerate(found)
    )
    group_of = {r: g.index for g in groups for r in g.ranks}
    verdict = Verdict(suspects=(), summary="no verdict (analyzer unavailable)", missing_ranks=missing,
                      status=VerdictStatus.NO_VERDICT)
    return StackView(groups, group_of, _tree_from_paths(paths), verdict, missing, tuple(notes))


def _from_analyzers(snapshot: JobSnapshot, layout: Layout | None, missing: tuple[int, ...]) -> StackView:
    with collector_paused():  # the analysis makes many objects and no cycles (rankscope.contract.heap)
        job = analyze_job(snapshot, layout or snapshot.layout)  # the verdict analyze and the drill give too
    analysis, verdict = job.stacks, job.fault_verdict
    notes: list[str] = []
    grouping = analysis.grouping
    # The healthy group(s) first, so "A" on the map always means "where most ranks are".
    order = [*grouping.dominant, *(i for i in range(len(grouping.groups)) if i not in grouping.dominant)]
    groups: list[GroupView] = []
    for new_index, i in enumerate(order):
        g = grouping.groups[i]
        diverges = diverging_frame(grouping, g)
        groups.append(GroupView(new_index, tuple(g.ranks), str(g.summary), tuple(g.frames), str(g.signature),
                                diverges, g.main_summary))
    group_of = {r: g.index for g in groups for r in g.ranks}
    tree = _convert_tree(analysis.tree)
    unreadable: dict[str, list[int]] = {}
    chain = analysis.chain
    if chain is not None:
        for rank, rv in sorted(chain.views.items()):
            if rv.state.value in ("unreadable", "stopped", "not captured"):
                unreadable.setdefault(rv.short(), []).append(rank)
    # Missing means a rank of the job seen without a stack, or one below the known world size: with no rank seen
    # at all there is no world to miss ranks from (it read "missing stacks: ranks 0" for an empty job).
    world = snapshot.world_size
    reported = tuple(r for r in verdict.missing_ranks if world is not None and r < world)
    return StackView(tuple(groups), group_of, tree, verdict, reported or missing, tuple(notes),
                     tuple((tuple(r), why) for why, r in unreadable.items()), round_of(job), job.timing_not_fault,
                     job.progress)


def verdict_text(view: StackView | None) -> str:
    """The verdict as plain text, for `y` and for tickets: ``rankscope analyze``'s suspects and findings
    (``analyzers.render``, every suspect), then the ranks without a stack and the notes."""
    if view is None:
        return "no capture yet"
    v = view.verdict
    lines = [headline(v), *verdict_lines(v)]
    for ranks, why in view.unreadable:
        lines.append(f"ranks {compact_ranks(ranks, 20)}: {why}")
    if view.missing_ranks:
        lines.append(f"missing ranks: {compact_ranks(view.missing_ranks, 20)}")
    lines.extend(f"note: {n}" for n in (*v.notes, *view.notes))
    return "\n".join(lines)
