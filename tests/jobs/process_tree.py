"""A torchrun-shaped process tree without torch, for the cheap probe tests.

    python process_tree.py <directory> <world_size> <run_id>

The "launcher" starts one process per rank with torchrun's environment
variables (RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK, TORCHELASTIC_RUN_ID,
...). Rank 1 is started through ``bash -c`` (a wrapper, as in
``torchrun --no-python bash train.sh``). Each rank forks a child that names
itself ``ckpt_writer`` (inheriting RANK, so it must not count as a rank) and
starts a child with RANKSCOPE_ROLE=dataloader. Every rank writes
<directory>/ready.<rank> (JSON with its pids) and parks in
``park_fake_rank`` until <directory>/release exists or its parent dies.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CHILD = """
import os, sys, time
def load_fake_batches(release, here):
    open(here, "w").close()  # in its loop now: its rank says ready only after this
    while not os.path.exists(release) and os.getppid() != 1:
        time.sleep(0.05)
load_fake_batches(sys.argv[1], sys.argv[2])
"""


def park_fake_rank(release: Path, parent: int) -> None:
    """Where each fake rank waits; tests look for this name in the stacks."""
    while not release.exists() and os.getppid() == parent:
        time.sleep(0.05)


def rank_main(directory: Path, rank: int) -> None:
    release = directory / "release"
    parent = os.getppid()
    me = os.getpid()
    forked = os.fork()
    if forked == 0:
        libc = ctypes.CDLL(None)
        libc.prctl(15, b"ckpt_writer", 0, 0, 0)  # PR_SET_NAME, as a forked writer would
        park_fake_rank(release, me)
        os._exit(0)
    env = dict(os.environ, RANKSCOPE_ROLE="dataloader")
    loader_here = directory / f".loader.{rank}"
    loader = subprocess.Popen([sys.executable, "-c", CHILD, str(release), str(loader_here)], env=env)
    # Ready once the loader sits in load_fake_batches (a capture must find it there, not still importing).
    deadline = time.monotonic() + 60
    while not loader_here.exists() and loader.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    ready = {"rank": rank, "pid": me, "checkpoint": forked, "dataloader": loader.pid}
    tmp = directory / f".ready.{rank}"
    tmp.write_text(json.dumps(ready))
    tmp.rename(directory / f"ready.{rank}")
    park_fake_rank(release, parent)
    loader.wait(timeout=10)
    os.waitpid(forked, 0)


def launcher_main(directory: Path, world_size: int, run_id: str) -> None:
    procs = []
    for rank in range(world_size):
        env = dict(
            os.environ,
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
            GROUP_RANK="0", TORCHELASTIC_RUN_ID=run_id, MASTER_ADDR="127.0.0.1", MASTER_PORT="29999",
        )
        cmd = [sys.executable, __file__, "--rank", str(directory), str(rank)]
        if rank == 1:
            # "; exit" keeps bash alive as the rank's parent instead of exec'ing python.
            cmd = ["bash", "-c", " ".join(cmd) + "; exit $?"]
        procs.append(subprocess.Popen(cmd, env=env))
    for p in procs:
        p.wait()


if __name__ == "__main__":
    if sys.argv[1] == "--rank":
        rank_main(Path(sys.argv[2]), int(sys.argv[3]))
    else:
        launcher_main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
