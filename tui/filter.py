"""What `/` selects: ranks by number or range, machines by name, or ranks whose stacks contain the text."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from rankscope.contract.ranks import compact_ranks
from rankscope.tui.analysis import StackView
from rankscope.tui.digest import MachineView

_RANKS = re.compile(r"^\s*r?(\d+)(?:\s*-\s*(\d+))?\s*$")


@dataclass(frozen=True, slots=True)
class Filter:
    """What `/` selects: ranks by number or range, machines by name, or ranks whose stacks contain the text."""

    text: str
    ranks: frozenset[int]

    @property
    def active(self) -> bool:
        return bool(self.text)


NO_FILTER = Filter("", frozenset())


def compile_filter(text: str, machines: Sequence[MachineView], stacks: StackView | None) -> Filter:
    """The filter ``text`` against the machines polled and the capture shown (its groups' frames)."""
    text = text.strip()
    if not text:
        return NO_FILTER
    hits: set[int] = set()
    for part in (p for p in text.split(",") if p.strip()):
        m = _RANKS.match(part)
        if m:
            a = int(m.group(1))
            b = int(m.group(2)) if m.group(2) else a
            hits.update(range(min(a, b), max(a, b) + 1))
            continue
        needle = part.strip().lower()
        for mv in machines:
            if needle in mv.name.lower() or needle in mv.address.lower():
                hits.update(mv.ranks)
        if stacks is not None:
            for g in stacks.groups:
                if needle in g.signature.lower() or any(needle in f.lower() for f in g.frames):
                    hits.update(g.ranks)
    return Filter(text, frozenset(hits))


def filter_summary(f: Filter) -> str:
    if not f.active:
        return ""
    return f"filter '{f.text}': {len(f.ranks)} ranks ({compact_ranks(f.ranks, 4) or 'none'})"
