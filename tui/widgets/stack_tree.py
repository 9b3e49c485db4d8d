"""Stacks: the groups, the prefix tree, and an outlier beside the dominant path.

The groups table lists each stack group with its size and rank ranges; the
tree is the prefix tree of call paths (collapsible, ranks at each frame); the
comparison puts the selected group's path beside the dominant one and marks
the frame where they part, which is where an engineer starts reading.
"""

from __future__ import annotations

from typing import ClassVar

from rankscope.contract.ranks import compact_ranks
from rankscope.tui.analysis import GroupView, StackView, TreeNode, diverging_index
from rankscope.tui.filter import Filter
from rankscope.tui.widgets.rank_map import group_glyph, group_style
from rankscope.tui.widgets.table import Cell, LineTable
from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widgets import Static, Tree
from textual.widgets.tree import TreeNode as UiTreeNode

TREE_NODES_MAX = 2_000  # a pathological capture (every rank different) must not freeze the UI


class VimTree(Tree[TreeNode]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("j", "cursor_down", "Down", show=False),
        Binding("k", "cursor_up", "Up", show=False),
        Binding("h", "cursor_parent", "Parent", show=False),
        Binding("l", "toggle_node", "Toggle", show=False),
    ]


def compare_table(dominant: GroupView, other: GroupView, width: int) -> Group:
    """Two call paths side by side, shared frames dim, the first differing frame marked."""
    cut = diverging_index(dominant.frames, other.frames)
    where = other.diverging_frame or (other.frames[cut] if cut < len(other.frames) else "(same path)")
    heading = Text(no_wrap=True, overflow="ellipsis")
    heading.append(f"group {group_glyph(other.index)} diverges at ", "bold")
    heading.append(where, "bold magenta")
    table = Table(box=None, expand=True, show_edge=False, pad_edge=False, padding=(0, 1))
    table.add_column(Text(f"{group_glyph(dominant.index)} dominant ({len(dominant.ranks)} ranks)",
                          group_style(dominant.index)), ratio=1, no_wrap=True, overflow="ellipsis")
    table.add_column(Text(f"{group_glyph(other.index)} group {group_glyph(other.index)} ({len(other.ranks)} ranks:"
                          f" {compact_ranks(other.ranks, 3)})", group_style(other.index)),
                     ratio=1, no_wrap=True, overflow="ellipsis")
    start = max(0, cut - 2)  # a little shared context above the split
    if start:
        table.add_row(Text(f"… {start} shared frames", "dim"), Text(f"… {start} shared frames", "dim"))
    n = max(len(dominant.frames), len(other.frames))
    for i in range(start, n):
        a = dominant.frames[i] if i < len(dominant.frames) else ""
        b = other.frames[i] if i < len(other.frames) else ""
        if i < cut:
            table.add_row(Text(a, "dim"), Text(b, "dim"))
        elif i == cut:
            table.add_row(Text("▶ " + a, "bold"), Text("▶ " + b, "bold magenta"))
        else:
            table.add_row(Text(a), Text(b))
    return Group(heading, table)


class StackTreePanel(Vertical):
    """Groups table on top; prefix tree and comparison below."""

    class GroupChosen(Message):
        def __init__(self, group: GroupView) -> None:
            super().__init__()
            self.group = group

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.view: StackView | None = None
        self.filter: Filter | None = None
        self._groups: list[GroupView] = []
        self._shown: tuple[object, object] = (None, None)

    NARROW = 120  # columns below which the comparison goes under the tree instead of beside it

    def on_resize(self) -> None:
        self.query_one("#stack-lower").set_class(self.size.width < self.NARROW, "narrow")

    def compose(self) -> ComposeResult:
        yield LineTable(id="groups")
        with Horizontal(id="stack-lower"):
            yield VimTree("all ranks", id="prefix-tree")
            yield Static(id="compare")

    @property
    def selected(self) -> GroupView | None:
        table = self.query_one("#groups", LineTable)
        if not self._groups:
            return None
        return self._groups[min(table.cursor_row, len(self._groups) - 1)]

    def show(self, view: StackView | None, flt: Filter) -> None:
        key = (view, flt)
        if key == self._shown:
            return
        self._shown = key
        self.view = view
        self.filter = flt if flt.active else None
        table = self.query_one("#groups", LineTable)
        self._groups = []
        rows: list[tuple[Cell, ...]] = []
        if view is not None:
            for g in view.groups:
                ranks = g.ranks if self.filter is None else tuple(r for r in g.ranks if r in self.filter.ranks)
                if not ranks:
                    continue
                self._groups.append(g)
                rows.append((Text(group_glyph(g.index), group_style(g.index)), str(len(ranks)),
                             compact_ranks(ranks, 3), g.summary))
        # The root's group (the rank the others wait on) is what one came here for, else the first outlier.
        cursor = 1 if len(rows) > 1 and self.filter is None else 0
        top = view.verdict.top if view is not None else None
        if top is not None and top.roots and self.filter is None:
            cursor = next((i for i, g in enumerate(self._groups) if i and set(top.roots) & set(g.ranks)), cursor)
        table.set_rows(("grp", "ranks", "which", "where"), rows, cursor=cursor)
        self._fill_tree()
        self._fill_compare()

    def _count(self, ranks: tuple[int, ...]) -> tuple[int, ...]:
        return ranks if self.filter is None else tuple(r for r in ranks if r in self.filter.ranks)

    def _fill_tree(self) -> None:
        tree = self.query_one("#prefix-tree", VimTree)
        tree.clear()
        if self.view is None:
            return
        root = self.view.tree
        tree.root.set_label(f"all ranks ({len(self._count(root.ranks))})")
        tree.root.data = root
        budget = [TREE_NODES_MAX]
        # The trunk every rank shares (the launcher's runpy and the drill's or the job's own entry frames, a dozen
        # of them) is folded into one line: it led every stack and pushed the branches off the right edge.
        trunk: list[str] = []
        top = root
        while len(top.children) == 1 and top.children[0].children and \
                len(self._count(top.children[0].ranks)) == len(self._count(root.ranks)):
            top = top.children[0]
            trunk.append(top.frame)
        parent_of_rest = tree.root
        if len(trunk) >= 2:
            label = Text(f"⋯ {len(trunk)} frames every rank shares, folded (innermost: {trunk[-1]})", "dim")
            parent_of_rest = tree.root.add(label, data=top, expand=True)
        elif trunk:
            top = root

        def add(under: UiTreeNode[TreeNode], start: TreeNode) -> None:
            # depth first in the children's order, without recursion: a stack can be thousands of frames deep
            pending: list[tuple[UiTreeNode[TreeNode], TreeNode]] = [(under, c) for c in reversed(start.children)]
            while pending:
                parent, child = pending.pop()
                ranks = self._count(child.ranks)
                if not ranks or budget[0] <= 0:
                    continue
                budget[0] -= 1
                label = Text(child.frame)
                label.append(f"  [{len(ranks)}: {compact_ranks(ranks, 3)}]", "dim")
                if child.children:
                    sub = parent.add(label, data=child, expand=True)
                    pending.extend((sub, c) for c in reversed(child.children))
                else:
                    parent.add_leaf(label, data=child)

        add(parent_of_rest, top)
        tree.root.expand()

    def _fill_compare(self) -> None:
        compare = self.query_one("#compare", Static)
        view = self.view
        sel = self.selected
        if view is None or view.dominant is None:
            compare.update(Text("no stacks captured yet (s)", "dim"))
            return
        if sel is None:
            compare.update(Text("no stack group matches the filter (esc clears it)", "dim"))
            return
        if sel.index == view.dominant.index:
            # Compare with the root's group (the rank the others wait on), not merely the first other group: that
            # was a victim group beside the dominant one.
            top = view.verdict.top
            roots = set(top.roots or top.ranks) if top is not None else set()
            other = next((g for g in self._groups if g.index != sel.index and roots & set(g.ranks)), None) or \
                next((g for g in self._groups if g.index != sel.index), None)
            if other is None:
                compare.update(Text("all ranks share one stack: nothing diverges", "dim"))
                return
            sel = other
        compare.update(compare_table(view.dominant, sel, self.size.width))

    def on_line_table_row_highlighted(self, event: LineTable.RowHighlighted) -> None:
        event.stop()
        self._fill_compare()

    def on_line_table_row_selected(self, event: LineTable.RowSelected) -> None:
        event.stop()
        sel = self.selected
        if sel is not None:
            self.post_message(self.GroupChosen(sel))
