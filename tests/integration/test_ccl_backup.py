"""The in-process checkpoint backup: the request file, the optimizer hook, the shard format, the restore.

A real torch process (the training side) is started with the environment the
drill gives its ranks; the agent side reads its stores with the real
``ShardStore``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from rankscope.actions.shard_store import ShardCorrupt, ShardStore

# Trains a tiny model 5 steps; the request appears after step 2, so steps 3 and 4 are backed up.
# Then a fresh model is restored from the peer's copy of step 4 and compared with the one that trained.
JOB = r"""
import json, os, sys
from pathlib import Path
import torch
from rankscope.ccl_plugin import backup

assert backup.install()
seen = {}
backup.register_state("cursor", lambda: {"position": 42}, lambda v: seen.update(v))
torch.manual_seed(0)
model = torch.nn.Linear(4, 3)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
kept = {}
for step in range(1, 6):
    model(torch.ones(2, 4) * step).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()
    kept[step] = [p.detach().clone() for p in model.parameters()]
    if step == 4:
        momentum_at_4 = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    if step == 2:
        Path(os.environ["RANKSCOPE_BACKUP_REQUEST"]).write_text(json.dumps({"request_id": "r-1"}))
fresh = torch.nn.Linear(4, 3)
fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
data = backup.read_shard(Path(sys.argv[1]), 0, 4)
step = backup.load(data, [fresh_opt])
same = all(torch.equal(a, b) for a, b in zip(fresh.parameters(), kept[4]))
momentum = all(torch.equal(fresh_opt.state[p]["momentum_buffer"], saved)
               for p, saved in zip(fresh.parameters(), momentum_at_4))
print(json.dumps({"step": step, "same": same, "momentum": momentum, "restored": seen,
                  "status_step": backup.status()["step"], "last": backup.status()["last"]}))
"""


def test_a_request_backs_up_the_next_two_step_boundaries_to_both_stores_and_restores_exactly(tmp_path: Path) -> None:
    own, peer = tmp_path / "own", tmp_path / "peer"
    env = dict(os.environ, RANK="0", OMP_NUM_THREADS="1", RANKSCOPE_BACKUP_REQUEST=str(tmp_path / "backup.request"),
               RANKSCOPE_BACKUP_TARGETS=json.dumps({"0": [str(own), str(peer)]}))
    env.pop("RANKSCOPE_CCL", None)
    done = subprocess.run([sys.executable, "-c", JOB, str(peer)], env=env, capture_output=True, text=True, timeout=240,
                          check=False)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {"step": 4, "same": True, "momentum": True, "restored": {"position": 42}, "status_step": 4,
                   "last": 4}
    for store, origin in ((own, "own"), (peer, "peer")):
        shards = ShardStore(store)
        assert shards.steps(0) == (3, 4)
        got = shards.get(0, 4)
        assert got is not None and got[0].origin == origin and got[0].size == len(got[1])


def test_a_damaged_shard_is_refused_by_both_readers(tmp_path: Path) -> None:
    from rankscope.ccl_plugin import backup

    backup.write_shard(tmp_path, 3, 7, b"state bytes", "own")
    assert backup.read_shard(tmp_path, 3, 7) == b"state bytes"
    backup.shard_path(tmp_path, 3, 7).write_bytes(b"state byteZ")
    assert backup.read_shard(tmp_path, 3, 7) is None
    try:
        ShardStore(tmp_path, in_memory=False).get(3, 7)
    except ShardCorrupt:
        pass
    else:
        raise AssertionError("a damaged shard was loaded")


def test_only_the_newest_two_steps_are_kept(tmp_path: Path) -> None:
    from rankscope.ccl_plugin import backup

    for step in (1, 2, 3):
        backup.write_shard(tmp_path, 0, step, bytes([step]), "own")
    assert backup.stored_steps(tmp_path, 0) == [2, 3]


def test_importing_the_backup_module_does_not_import_torch() -> None:
    code = "import sys, rankscope.ccl_plugin.backup; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.stdout.strip() == "False", done.stderr
