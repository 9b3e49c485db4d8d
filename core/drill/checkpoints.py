"""Where a drill rank saves its training state and resumes from: checkpoint files and the in-memory backups.

Each rank hands its checkpoints to a writer process of its own (``python -m rankscope.drill.worker
checkpoint-writer``), as large jobs' asynchronous savers do; a restart resumes from the newest step every rank holds,
or from the CCL plugin's in-memory backups when they are newer (``restore_backup``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

from rankscope.drill.faults import FAULT_ENV, FaultPlan
from rankscope.drill.injection import drill_injected_checkpoint_stall

# What the launcher tells the ranks it starts (the worker only reads it; the launcher imports it from here).
STORES_ENV = "RANKSCOPE_DRILL_BACKUP_STORES"  # JSON: the backup store of each machine of the job, by node rank


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


class CheckpointWriter:
    """The rank's side of its writer process: hand over bytes, wait for the ack.

    The writer is a real child process (``RANKSCOPE_ROLE=checkpoint`` in its
    environment so discovery names its role) that does the file I/O, like the
    asynchronous checkpoint savers of large jobs. The rank waits for the ack
    before going on, so a stalled writer stalls the rank.
    """

    def __init__(self, run_dir: Path, rank: int) -> None:
        env = dict(os.environ, RANKSCOPE_ROLE="checkpoint")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rankscope.drill.worker", "checkpoint-writer", "--run-dir", str(run_dir),
             "--rank", str(rank)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
        )

    def save(self, step: int, payload: bytes) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"step": step, "size": len(payload)}).encode() + b"\n")
        self.proc.stdin.write(payload)
        self.proc.stdin.flush()
        wait_for_checkpoint_writer(self.proc.stdout, step)

    def close(self) -> None:
        # An explicit goodbye: forked dataloader workers hold a copy of the
        # pipe, so end-of-file alone may never reach the writer.
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.write(b'{"quit": true}\n')
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def wait_for_checkpoint_writer(stdout: IO[bytes], step: int) -> None:
    line = stdout.readline()
    if line.strip() != f"ok {step}".encode():
        raise RuntimeError(f"checkpoint writer failed at step {step}: {line!r}")


def run_checkpoint_writer(run_dir: Path, rank: int) -> int:
    """The writer process: read (header, bytes) records from stdin, write files, ack."""
    plan = FaultPlan.from_env(os.environ.get(FAULT_ENV))
    out_dir = checkpoint_dir(run_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        header = stdin.readline()
        if not header:
            return 0
        meta = json.loads(header)
        if meta.get("quit"):
            return 0
        step, size = int(meta["step"]), int(meta["size"])
        payload = stdin.read(size)
        if plan.name == "checkpoint-stall" and plan.rank == rank and step >= plan.step:
            drill_injected_checkpoint_stall()
        target = out_dir / f"rank{rank}-step{step}.pt"
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_bytes(payload)
        os.replace(tmp, target)
        prune_checkpoints(out_dir, rank, CHECKPOINTS_KEPT)
        stdout.write(f"ok {step}\n".encode())
        stdout.flush()


# Ranks move in lock step (their collectives tie them), so their newest checkpoints differ by a step or
# two; the restart resumes from the newest step every rank holds, which the last few always contain.
CHECKPOINTS_KEPT = 4


def prune_checkpoints(out_dir: Path, rank: int, keep: int) -> None:
    """Delete this rank's checkpoints but the newest ``keep`` (a long drill would otherwise fill the disk)."""
    found = sorted((int(p.stem.split("-step")[1]), p) for p in out_dir.glob(f"rank{rank}-step*.pt"))
    for _, path in found[:-keep]:
        path.unlink(missing_ok=True)


def latest_checkpoint(run_dir: Path, rank: int) -> int:
    steps = [int(p.stem.split("-step")[1]) for p in checkpoint_dir(run_dir).glob(f"rank{rank}-step*.pt")]
    return max(steps, default=0)


def restore_backup(rank: int, world: int, checkpoint_step: int, optimizer: Any) -> int | None:
    """Resume from the in-memory backups when they are newer than the checkpoint; the step, or None.

    Every rank says which steps it can find for itself in the store of the
    machine it now runs on (local) and in the stores of the job's other
    machines (its backup peer's); ``restore_plan`` over what all ranks said
    picks the newest step held for every rank, the same answer on every rank.
    Each rank then loads its local copy, else the peer's (checksums verified).
    """
    import torch.distributed as dist
    from rankscope.analyzers.backup_plan import restore_plan
    from rankscope.ccl_plugin import backup

    raw = os.environ.get(STORES_ENV)
    if not raw:
        return None
    stores = [Path(d) for d in json.loads(raw)]
    here = stores[int(os.environ.get("GROUP_RANK", "0"))]
    others = [d for d in stores if d != here]
    mine = (backup.stored_steps(here, rank), sorted({s for d in others for s in backup.stored_steps(d, rank)}))
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    plan = restore_plan(world, {r: v[0] for r, v in enumerate(everyone)}, {r: v[1] for r, v in enumerate(everyone)})
    if plan.step is None or plan.step <= checkpoint_step:
        # Said in the log: a restart from the checkpoint instead of the backup is otherwise silent.
        why = "; ".join(plan.notes) or f"step {plan.step} is not newer than checkpoint step {checkpoint_step}"
        print(f"drill worker: rank {rank} restored no backup (local {mine[0]}, peers {mine[1]}): {why}",
              file=sys.stderr, flush=True)
        return None
    source = dict(plan.sources)[rank]
    for store in ([here] if source == "local" else []) + others + [here]:
        data = backup.read_shard(store, rank, plan.step)
        if data is not None:
            backup.load(data, [optimizer])
            print(f"drill worker: rank {rank} restored step {plan.step} from the backup in {store} ({source})",
                  file=sys.stderr, flush=True)
            return plan.step
    raise RuntimeError(f"rank {rank}: no verified copy of step {plan.step} although the plan had one")
