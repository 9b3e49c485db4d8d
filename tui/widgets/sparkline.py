"""Sparklines of a series of readings (metrics, communicator completions)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

_BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float], width: int = 12) -> str:
    vals = list(values)[-width:]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    if hi == lo:
        return _BARS[0] * len(vals)
    return "".join(_BARS[min(7, int((v - lo) / (hi - lo) * 7.999))] for v in vals)


def deltas(values: Sequence[float]) -> list[float]:
    return [float(b - a) for a, b in itertools.pairwise(values)]
