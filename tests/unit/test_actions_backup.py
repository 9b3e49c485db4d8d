"""Checkpoint backup foundations: the shard store (memory + disk + checksum) and the restore choice.

The backup plan itself is tested with the other plans in test_actions_planning.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from rankscope.actions.shard_store import ShardCorrupt, ShardStore
from rankscope.analyzers.backup_plan import restore_plan


def test_shards_survive_a_new_store_and_only_the_newest_two_steps_are_kept(tmp_path: Path) -> None:
    store = ShardStore(tmp_path / "shards")
    for step in (10, 11, 12):
        store.put(3, step, f"rank3-step{step}".encode())
    store.put(8, 12, b"backup of rank 8", origin="peer")
    assert store.steps(3) == (11, 12)
    reopened = ShardStore(tmp_path / "shards")  # an agent restart: memory is gone, the disk copy is not
    got = reopened.get(3)
    assert got is not None and got[1] == b"rank3-step12" and got[0].step == 12
    peer = reopened.get(8, 12)
    assert peer is not None and peer[0].origin == "peer" and peer[1] == b"backup of rank 8"
    assert reopened.inventory() == {3: (11, 12), 8: (12,)}
    assert reopened.get(5) is None and reopened.get(3, 10) is None


def test_a_corrupt_disk_copy_is_reported_not_loaded(tmp_path: Path) -> None:
    ShardStore(tmp_path / "shards").put(2, 7, b"good bytes")
    shard = next((tmp_path / "shards").rglob("*.shard"))
    shard.write_bytes(b"bad bytes!")
    with pytest.raises(ShardCorrupt, match="does not match its checksum") as err:
        ShardStore(tmp_path / "shards").get(2, 7)
    assert "peer" in err.value.fix


def test_restore_takes_the_newest_common_step_local_first_then_peer() -> None:
    # Ranks 2-3 were on an evicted machine: their new standby holds nothing, their peers (8-9) hold steps 11-12.
    local = {0: [11, 12], 1: [11, 12], 2: [], 3: [], 4: [11], 5: [11, 12]}
    peer = {0: [11, 12], 1: [12], 2: [11, 12], 3: [11, 12], 4: [11, 12], 5: []}
    plan = restore_plan(6, local, peer)
    assert plan.step == 12
    assert dict(plan.sources) == {0: "local", 1: "local", 2: "peer", 3: "peer", 4: "peer", 5: "local"}
    lagging = restore_plan(2, {0: [5, 6], 1: [5]}, {})
    assert lagging.step == 5 and "step 6 is not held for every rank" in lagging.notes[0]
    lost = restore_plan(3, {0: [1], 1: [1]}, {})
    assert lost.step is None and lost.missing == (2,)
