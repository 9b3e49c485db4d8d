"""Rank -> machine for a capture: what the agents saw, else consecutive blocks of the layout's machine size.

Pure: numpy and the snapshot contract; no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from rankscope.contract.ranks import natural_key
from rankscope.contract.snapshot import JobSnapshot


class Placement:
    """Rank -> machine, as an index array for vector work and names for people."""

    def __init__(self, snapshot: JobSnapshot, world: int, ranks_per_machine: int | None) -> None:
        names: list[str] = []
        index: dict[str, int] = {}
        ids = np.full(world, -1, dtype=np.int64)

        def mid_of(name: str) -> int:
            mid = index.get(name)
            if mid is None:
                mid = index[name] = len(names)
                names.append(name)
            return mid

        for machine in snapshot.machines:  # what the agents saw is the truth
            seen = np.fromiter((*(r.rank for r in machine.ranks), *(s.rank for s in machine.stacks)), dtype=np.int64)
            seen = seen[(seen >= 0) & (seen < world)]
            if seen.size:
                ids[seen] = mid_of(machine.machine)
        if ranks_per_machine:  # ranks no agent reported: consecutive blocks
            unplaced = np.flatnonzero(ids < 0)
            for block in np.unique(unplaced // ranks_per_machine).tolist():
                lo, hi = block * ranks_per_machine, (block + 1) * ranks_per_machine
                span = ids[lo:hi]
                span[span < 0] = mid_of(f"machine-{block}")
        self.ids = ids
        self.names = names

    def machines(self, ranks: np.ndarray | Sequence[int]) -> tuple[str, ...]:
        mids = self._machine_ids(ranks)
        return tuple(sorted((self.names[m] for m in mids.tolist()), key=natural_key))

    def machine_count(self, ranks: np.ndarray | Sequence[int]) -> int:
        """``len(self.machines(ranks))``, without naming them."""
        return int(self._machine_ids(ranks).size)

    def _machine_ids(self, ranks: np.ndarray | Sequence[int]) -> np.ndarray:
        arr = np.asarray(ranks, dtype=np.int64)
        arr = arr[(arr >= 0) & (arr < self.ids.size)]
        mids = np.unique(self.ids[arr])
        return mids[mids >= 0]

    def ranks_of(self, mids: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """Each of the machines ``mids`` (ascending ids) with its ranks, ascending: one pass over the job, not
        one per machine (a hung job of 100,000 ranks has outliers on thousands of machines)."""
        order = np.argsort(self.ids, kind="stable")  # ranks by machine, ascending within each
        sorted_ids = self.ids[order]
        starts = np.searchsorted(sorted_ids, mids, side="left")
        ends = np.searchsorted(sorted_ids, mids, side="right")
        return [(mid, order[a:b]) for mid, a, b in zip(mids.tolist(), starts.tolist(), ends.tolist(), strict=True)]


__all__ = ["Placement"]
