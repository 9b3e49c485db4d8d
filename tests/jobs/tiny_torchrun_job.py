"""A tiny torchrun job for the probe tests (not the drill): each rank starts
a DataLoader worker and a checkpoint-writer child, says it is ready, then parks
in a named function until the test releases it.

Usage: torchrun ... tiny_torchrun_job.py <directory>
The rank writes <directory>/ready.<rank> (listing its children's pids) once
everything is up, and returns when <directory>/release exists.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

WRITER = """
import os, sys, time
def write_checkpoint_shard(release):
    while not os.path.exists(release) and os.getppid() != 1:
        time.sleep(0.05)
write_checkpoint_shard(sys.argv[1])
"""


class Numbers(Dataset[int]):
    def __len__(self) -> int:
        return 1000

    def __getitem__(self, index: int) -> int:
        return index


def park_until_released(release: Path) -> None:
    """Where every rank waits; the test looks for this name in the stacks."""
    while not release.exists() and os.getppid() != 1:
        time.sleep(0.05)


def main() -> None:
    directory = Path(sys.argv[1])
    release = directory / "release"
    torch.set_num_threads(1)  # the test machine has two cores shared by everyone
    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    loader = DataLoader(Numbers(), batch_size=1, num_workers=1, multiprocessing_context="fork")
    batches = iter(loader)
    next(batches)  # the worker is running from here on
    env = dict(os.environ, RANKSCOPE_ROLE="checkpoint")
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(release)], env=env)
    dist.barrier()
    workers = [w.pid for w in batches._workers]  # type: ignore[attr-defined]
    ready = {"rank": rank, "pid": os.getpid(), "dataloader": workers, "checkpoint": writer.pid}
    tmp = directory / f".ready.{rank}"
    tmp.write_text(json.dumps(ready))
    tmp.rename(directory / f"ready.{rank}")
    park_until_released(release)
    writer.wait(timeout=10)
    del batches
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
