"""Checkpoint backup: ask this machine's ranks for a snapshot through a request file, then verify their shards.

The ranks' in-process plugin (``rankscope.ccl_plugin.backup``) watches the
file at every optimizer step boundary, snapshots parameters and optimizer
state into CPU memory and writes each shard with its SHA-256 to this agent's
store (``<state dir>/shards``) and to its backup peer's. The agent never
talks to a rank, so a hung rank costs a timeout here, not a hung agent.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from rankscope.actions.model import ActionRequest, ActionState
from rankscope.actions.planning import Planned
from rankscope.actions.procedures import Outcome, Report
from rankscope.actions.shard_store import ShardCorrupt, ShardStore
from rankscope.ccl_plugin.backup import REQUEST_FILE, SHARDS_DIR

POLL_S = 0.1  # how often the store is looked at for the ranks' new shards


def back_up(request: ActionRequest, planned: Planned, report: Report, machine: str, state_dir: Path,
            wait_s: float, align_steps: int, clock: Callable[[], float]) -> Outcome:
    """Wait up to ``wait_s`` for a new shard of every targeted rank (else failed, naming the late ranks)."""
    store = ShardStore(state_dir / SHARDS_DIR)
    ranks = sorted(set(request.targets.ranks) or {r.rank for r in planned.ranks})
    if not ranks:
        return ActionState.SUCCEEDED, f"no ranks on {machine}: nothing to back up", ()
    newest_before = {r: max(store.steps(r), default=-1) for r in ranks}
    path = state_dir / REQUEST_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"request_id": request.action_id, "written": clock(), "align": align_steps}))
    os.replace(tmp, path)
    report(f"asked ranks {' '.join(map(str, ranks))} for a backup at their next step boundary ({path})")
    deadline = time.monotonic() + wait_s
    while True:
        newest = {r: max(store.steps(r), default=-1) for r in ranks}
        late = [r for r in ranks if newest[r] <= newest_before[r]]
        if not late:
            break
        if time.monotonic() > deadline:
            return (ActionState.FAILED,
                    f"rank(s) {' '.join(map(str, late))} on {machine} wrote no backup within "
                    f"{wait_s:g} s: they are not reaching a step boundary (hung?), or the backup hook is "
                    "not loaded in them (start the job with `rankscope run`, which loads it)", ())
        time.sleep(POLL_S)
    details: list[str] = []
    for r in ranks:
        try:
            got = store.get(r, newest[r])
        except ShardCorrupt as exc:
            return ActionState.FAILED, exc.message, tuple(details)
        if got is None:
            return ActionState.FAILED, f"the shard of rank {r} step {newest[r]} vanished before it was read", ()
        info = got[0]
        details.append(f"rank {r}: step {info.step}, {info.size} bytes, sha256 {info.sha256[:16]}")
    report(f"verified {len(ranks)} shard(s)")
    held = {r: s for r, s in store.inventory().items() if r not in ranks and s}
    if held:
        details.append("peer copies held here: " + ", ".join(f"rank {r} steps {list(s)}" for r, s in held.items()))
    steps = sorted({newest[r] for r in ranks})
    return (ActionState.SUCCEEDED,
            f"backed up ranks {' '.join(map(str, ranks))} on {machine} at step {' '.join(map(str, steps))} "
            "(own copy here, peer copy on the backup peer's machine)", tuple(details))
