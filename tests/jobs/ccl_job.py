"""A small gloo job whose collective and p2p calls the CCL tests count exactly.

It imports nothing from rankscope: the counters must come from the .pth hook
that `rankscope run` sets up. Per step (world of 2):
  WORLD: all_reduce (sync), all_reduce (async, waited), all_gather_into_tensor,
         reduce_scatter_tensor, barrier
  PP group (new_group, described PIPELINE_MODEL_PARALLEL_GROUP): broadcast,
         isend 0->1 / irecv on 1, batch_isend_irecv exchange (one send + one recv each)
  one optimizer step.
Environment: CCL_JOB_STEPS (default 3); CCL_JOB_HANG=compute|p2p|async with
CCL_JOB_HANG_RANK / CCL_JOB_HANG_STEP; CCL_JOB_DIR for marker files: the job
writes ready.rank<R> at the end (or hung.rank<R> when hanging) and lingers
until a file named `release` appears there, so a test can read the counters of
live ranks. A hanging compute rank holds the GIL while it sleeps (libc sleep
through ctypes.PyDLL), like a rank stuck in a C extension. With ``async`` the
hanging rank never joins the step's async all_reduce, and the others write
waiting.rank<R> once theirs is issued, before they wait on it.
"""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import all_gather_into_tensor  # bound at import time, like Megatron


def linger(marker: Path, release: Path) -> None:
    marker.write_text(str(os.getpid()))
    deadline = time.monotonic() + 120
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    steps = int(os.environ.get("CCL_JOB_STEPS", "3"))
    hang = os.environ.get("CCL_JOB_HANG", "")
    hang_rank = int(os.environ.get("CCL_JOB_HANG_RANK", "1"))
    hang_step = int(os.environ.get("CCL_JOB_HANG_STEP", "1"))
    out = Path(os.environ["CCL_JOB_DIR"])
    pp = dist.new_group(list(range(world)), group_desc="PIPELINE_MODEL_PARALLEL_GROUP")
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        if hang == "compute" and rank == hang_rank and step == hang_step:
            (out / f"hung.rank{rank}").write_text(str(os.getpid()))
            ctypes.PyDLL(None).sleep(600)  # stuck in C with the GIL held
        loss = model(torch.randn(4, 8)).sum()
        loss.backward()
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
        if hang == "async" and rank == hang_rank and step == hang_step:
            linger(out / f"hung.rank{rank}", out / "release")
            os._exit(3)
        w = dist.all_reduce(torch.ones(16), async_op=True)
        if hang == "async" and step == hang_step:  # issued, not complete: the peer never joins
            (out / f"waiting.rank{rank}").write_text(str(os.getpid()))
        w.wait()
        gathered = torch.empty(16 * world)
        all_gather_into_tensor(gathered, torch.ones(16))
        dist.reduce_scatter_tensor(torch.empty(4), torch.ones(4 * world))
        dist.barrier()
        dist.broadcast(torch.ones(8), src=0, group=pp)
        buf = torch.ones(32)
        if hang == "p2p" and rank == hang_rank and step == hang_step:
            (out / f"hung.rank{rank}").write_text(str(os.getpid()))
            linger(out / f"hung.rank{rank}", out / "release")
            os._exit(3)
        if rank == 0:
            dist.isend(buf, 1, group=pp).wait()
        elif rank == 1:
            work = dist.irecv(buf, 0, group=pp)
            if hang == "p2p" and step == hang_step:  # only once the step's irecv is issued, never a step early
                (out / f"waiting.rank{rank}").write_text(str(os.getpid()))
            work.wait()
        peer = (rank + 1) % world
        ops = [dist.P2POp(dist.isend, torch.ones(8), peer, group=pp),
               dist.P2POp(dist.irecv, torch.empty(8), (rank - 1) % world, group=pp)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        opt.step()
        opt.zero_grad()
    linger(out / f"ready.rank{rank}", out / "release")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
