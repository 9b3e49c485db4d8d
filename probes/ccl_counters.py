"""Reading the CCL plugin's per-rank counter files (filled in by the CCL work).

``read_counters(ranks)`` returns one ``RankCounters`` per rank whose counter
file exists; a corrupt or stale file comes back with ``error`` / ``stale`` set,
never as an exception.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rankscope.snapshot import RankCounters, RankInfo


def read_counters(ranks: Sequence[RankInfo], directory: Path | None = None) -> tuple[RankCounters, ...]:
    """Counters of the given ranks; empty until the CCL plugin lands."""
    return ()
