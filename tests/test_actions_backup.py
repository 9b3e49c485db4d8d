"""Checkpoint backup foundations: the shard store (memory + disk + checksum), the restore choice, action plans."""

from __future__ import annotations

from pathlib import Path

import pytest
from rankscope.actions.evict_backends import SlurmBackend
from rankscope.actions.history import Version
from rankscope.actions.model import (
    ActionKind,
    ActionRequest,
    BackupArgs,
    EvictArgs,
    HotUpdateArgs,
    ProcessRef,
    Targets,
    UpdateMode,
    VersionSource,
    confirmation_matches,
)
from rankscope.actions.planning import plan_backup, plan_eviction, plan_hot_update
from rankscope.actions.shard_store import ShardCorrupt, ShardStore
from rankscope.analyzers.backup_plan import backup_plan, restore_plan
from rankscope.errors import RankscopeError
from rankscope.snapshot import Layout


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


def _procs() -> list[ProcessRef]:
    return [ProcessRef(f"machine-{r // 2}", 1000 + r, r) for r in range(16)]


def test_eviction_plan_names_machines_processes_commands_and_the_phrase(tmp_path: Path) -> None:
    req = ActionRequest("a-9", ActionKind.EVICT, Targets(("machine-6", "machine-7")),
                        EvictArgs("PP group 3 hung in irecv"), "alice")
    plan = plan_eviction(req, SlurmBackend(job_id="77", restart="none", scontrol="/usr/bin/scontrol"), _procs())
    assert plan.machines == ("machine-6", "machine-7")
    assert [p.rank for p in plan.processes] == [12, 13, 14, 15]
    assert plan.commands[0] == ("/usr/bin/scontrol", "update", "nodename=machine-6,machine-7", "state=drain",
                                "reason=PP group 3 hung in irecv")
    assert plan.typed_confirmation and plan.confirm_phrase == "evict machine-6 machine-7"
    assert not confirmation_matches(plan, True) and confirmation_matches(plan, "evict machine-6 machine-7")
    assert "blocklist" in plan.steps[0]


def test_backup_plan_lists_the_fig9_peers() -> None:
    pairing = backup_plan(Layout(tp=2, pp=4, dp=2), ranks_per_machine=2)
    req = ActionRequest("b-1", ActionKind.BACKUP, Targets(ranks=(8, 9)), BackupArgs(), "alice")
    plan = plan_backup(req, pairing, _procs())
    assert plan.backup_peers == ((8, 2), (9, 3))
    assert plan.machines == ("machine-4", "machine-1")
    assert [p.rank for p in plan.processes] == [8, 9]
    everything = plan_backup(ActionRequest("b-2", ActionKind.BACKUP, Targets(), BackupArgs(), "a"), pairing, _procs())
    assert len(everything.backup_peers) == 16 and everything.warnings == ()


def test_hot_update_plan_lazy_touches_no_process_yet() -> None:
    machines = [f"machine-{i}" for i in range(8)]
    req = ActionRequest("u-1", ActionKind.HOT_UPDATE, Targets(), HotUpdateArgs(VersionSource.GIT, "v2"), "alice")
    plan = plan_hot_update(req, machines, _procs(), Version("git:v1 (abc)", "/v/abc"))
    assert len(plan.processes) == 16 and plan.summary == "hot-update (immediate) git:v1 (abc) -> git ref v2"
    lazy = ActionRequest("u-2", ActionKind.HOT_UPDATE, Targets(),
                         HotUpdateArgs(VersionSource.GIT, "v2", UpdateMode.LAZY), "alice")
    plan = plan_hot_update(lazy, machines, _procs(), None)
    assert plan.processes == () and "24 h" in plan.steps[1]
    with pytest.raises(RankscopeError):
        plan_hot_update(ActionRequest("x", ActionKind.BACKUP, Targets(), BackupArgs(), "a"), machines, [], None)
