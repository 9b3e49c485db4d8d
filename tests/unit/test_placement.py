"""Placement: rank -> machine as the agents saw it, else consecutive blocks; its per-machine lookups agree with
the plain scans they replace."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from rankscope.analyzers.placement import Placement
from rankscope.contract.snapshot import Instant, JobSnapshot, MachineSnapshot, RankInfo


def _job(owners: list[int], world: int) -> JobSnapshot:
    """Rank r reported by machine ``owners[r]`` (-1: by no agent)."""
    machines = [MachineSnapshot(f"node{m}", f"10.0.0.{m}:7000", True, Instant(1.0, 1.0),
                                ranks=tuple(RankInfo(r, 0, world, 100 + r) for r, o in enumerate(owners) if o == m))
                for m in sorted(set(owners) - {-1})]
    return JobSnapshot(Instant(1.0, 1.0), tuple(machines))


def test_ranks_of_gives_each_machine_its_ranks_and_blocks_place_the_unreported() -> None:
    world = 12
    owners = [1, 0, 1, 0, 2, 2, -1, -1, 2, 0, 1, -1]
    p = Placement(_job(owners, world), world, ranks_per_machine=4)
    named = {p.names[mid]: ranks.tolist() for mid, ranks in p.ranks_of(np.arange(len(p.names)))}
    assert named == {"node0": [1, 3, 9], "node1": [0, 2, 10], "node2": [4, 5, 8],
                     "machine-1": [6, 7], "machine-2": [11]}
    assert p.machines([0, 1, 6, 11]) == ("machine-1", "machine-2", "node0", "node1")
    assert p.machine_count([0, 1, 6, 11]) == 4
    assert p.machine_count([-3, 99]) == 0 and p.machines([-3, 99]) == ()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-1, 5), min_size=1, max_size=40), st.data())
def test_lookups_agree_with_a_scan_of_the_job(owners: list[int], data: st.DataObject) -> None:
    world = len(owners)
    p = Placement(_job(owners, world), world, ranks_per_machine=None)
    present = np.unique(p.ids[p.ids >= 0])
    mids = np.asarray(sorted(data.draw(st.sets(st.sampled_from(present.tolist()))) if present.size else []),
                      dtype=np.int64)
    got = p.ranks_of(mids)
    assert [m for m, _ in got] == mids.tolist()
    for mid, ranks in got:
        assert ranks.tolist() == np.flatnonzero(p.ids == mid).tolist()
    ranks = data.draw(st.lists(st.integers(-2, world + 2), max_size=10))
    assert p.machine_count(ranks) == len(p.machines(ranks))
