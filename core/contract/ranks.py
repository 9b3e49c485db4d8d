"""Rank sets and machine names as text: the one rank-range format of the tool (verdicts, the CLI, the TUI), the
one order and range of machine names (``machine-2`` before ``machine-10``; ``machine-12..14``).

Below every reader and judge, so a parser or a view that words a rank set needs no analyzer. Stdlib only.
"""

from __future__ import annotations

import re
from collections.abc import Iterable


def compact_ranks(ranks: Iterable[int], limit: int | None = None) -> str:
    """``0,1,2,3,8`` -> ``0-3,8``; past ``limit`` runs, shortened but still exact where it can be.

    Runs of one length that start at a fixed stride (a parallel group of a
    large job: ranks 8-15 of every 32) are written whole as their first two
    runs, the last and the pattern (``8-15,40-47,…,16360-16367 (512 runs of 8,
    one every 32)``); any other set is cut after ``limit`` runs with a count
    (``0-3,… (+5 runs)``). The one rank-range format of the tool: verdicts,
    the CLI, the TUI.
    """
    ordered = sorted(set(ranks))
    runs: list[tuple[int, int]] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        runs.append((ordered[i], ordered[j]))
        i = j + 1
    parts = [str(a) if a == b else f"{a}-{b}" for a, b in runs]
    if limit is None or len(parts) <= limit:
        return ",".join(parts)
    stride = runs[1][0] - runs[0][0]
    width = runs[0][1] - runs[0][0]
    if all(b - a == width and a == runs[0][0] + k * stride for k, (a, b) in enumerate(runs)):
        if len(runs) <= 3:  # the pattern would be longer than the runs themselves
            return ",".join(parts)
        what = f"{len(runs)} ranks" if width == 0 else f"{len(runs)} runs of {width + 1}"
        return f"{parts[0]},{parts[1]},…,{parts[-1]} ({what}, one every {stride})"
    more = len(parts) - limit
    return ",".join(parts[:limit]) + f",… (+{more} {'run' if more == 1 else 'runs'})"


__all__ = ["compact_ranks"]


_TRAILING_NUMBER = re.compile(r"^(.*?)(\d+)$")


def natural_key(name: str) -> tuple[str, int, str]:
    """Sort ``machine-2`` before ``machine-10``."""
    m = _TRAILING_NUMBER.match(name)
    return (m.group(1), int(m.group(2)), name) if m else (name, -1, name)


def compact_machines(names: Iterable[str]) -> str:
    """``machine-12, machine-13, machine-14`` -> ``machine-12..14``; other names listed."""
    ordered = sorted(set(names), key=natural_key)
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        m = _TRAILING_NUMBER.match(ordered[i])
        if not m:
            parts.append(ordered[i])
            i += 1
            continue
        prefix, start = m.group(1), int(m.group(2))
        end, j = start, i + 1
        while j < len(ordered):
            n = _TRAILING_NUMBER.match(ordered[j])
            if not n or n.group(1) != prefix or int(n.group(2)) != end + 1:
                break
            end, j = end + 1, j + 1
        parts.append(ordered[i] if end == start else f"{prefix}{start}..{end}")
        i = j
    return ", ".join(parts)
