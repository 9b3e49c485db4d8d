"""The training script every drill rank runs (``python -m rankscope.drill.worker train``).

Plain torch and torch.distributed on gloo (CPU), or on NCCL with
``--backend nccl`` (each rank on a GPU, see ``gpu.py``), launched by torchrun.
On NCCL every collective and send/recv returns once enqueued, as in a real
GPU job; each step ends at a host sync point (``.item()`` on a parameter, as a
job logging a norm does), where a rank waits for a peer that stopped. It has the
process tree of a real job: a DataLoader with worker processes and a separate
checkpoint writer process. Training is deterministic and resumable bit for
bit: the data of a step is a pure function of (seed, step, dp rank), the RNG
is reseeded at every step, and a checkpoint holds the model, the optimizer
and the step.

The fault plan comes from ``RANKSCOPE_DRILL_FAULT`` (see ``faults.py``) and is
carried out by ``injection.py``; checkpoints and the resume from them or from
the in-memory backups are ``checkpoints.py``. This module is the job: its data,
its training loop, its device, and its entry points.

Two more entry points live here so that they need no extra files:
``checkpoint-writer`` (the writer process, started by each rank, without
torch) and ``noise`` (the spinning neighbour of the cpu-contention fault).
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from rankscope.drill.checkpoints import (
    CheckpointWriter,
    checkpoint_dir,
    latest_checkpoint,
    restore_backup,
    run_checkpoint_writer,
)
from rankscope.drill.faults import FAULT_ENV, DrillLayout, FaultPlan
from rankscope.drill.gpu import BACKENDS, DEFAULT_BACKEND
from rankscope.drill.injection import (
    Injector,
    desync_ranks,
    drill_injected_cpu_noise,
    drill_injected_dataloader_deadlock,
    drill_injected_dataloader_stall,
    drill_injected_desync,
    drill_injected_slow_dataloader,
    skipping_send,
)
from rankscope.drill.progress import LoadedStep, write_phase, write_progress

# What the launcher tells the ranks it starts (the worker only reads it; the launcher imports it from here).
RUN_ID_ENV = "RANKSCOPE_DRILL_RUN_ID"

FEATURES = 16




# --------------------------------------------------------------------------
# Data: a pure function of (seed, step, dp rank)
# --------------------------------------------------------------------------


class StepData:
    """The synthetic dataset, indexed by step; runs in the dataloader workers."""

    def __init__(self, seed: int, dp_rank: int, rows: int, plan: FaultPlan, rank: int) -> None:
        self.seed = seed
        self.dp_rank = dp_rank
        self.rows = rows
        self.plan = plan
        self.rank = rank

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, step: int) -> tuple[Any, Any]:
        import torch

        if self.plan.hits(self.rank, step):
            if self.plan.name == "dataloader-stall" and step == self.plan.step:
                drill_injected_dataloader_stall()
            elif self.plan.name == "dataloader-deadlock" and step == self.plan.step:
                drill_injected_dataloader_deadlock()
            elif self.plan.name == "slow-dataloader":
                drill_injected_slow_dataloader(self.plan.delay_ms / 1000.0)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009 + self.dp_rank)
        x = torch.randn(self.rows, FEATURES, generator=gen)
        w = torch.Generator().manual_seed(self.seed)
        w_true = torch.randn(FEATURES, 1, generator=w)
        y = torch.sin(x @ w_true)
        return x, y


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------


def train(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from rankscope.drill import model as m

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    run_dir = Path(args.run_dir)
    layout = DrillLayout(tp=args.tp, pp=args.pp, dp=args.dp, machines=args.machines)
    if layout.world != world:
        raise SystemExit(f"drill worker: layout needs {layout.world} ranks, torchrun started {world}")
    plan = FaultPlan.from_env(os.environ.get(FAULT_ENV))
    if plan.spec.needs_cuda and args.backend != "nccl":  # the launcher refuses it first; never a traceback here
        raise SystemExit(f"drill worker: {plan.name} acts on the rank's GPU; run the drill with --backend nccl")
    torch.set_num_threads(1)
    from rankscope.ccl_plugin import backup

    if os.environ.get(backup.ENV_REQUEST) and os.environ.get("RANKSCOPE_CCL") != "1":
        # With the CCL plugin loaded (the default) its autoload installs the backup hook with no
        # change to this script; only `--no-counters` drills ask for the same global hook here.
        backup.install()
    (run_dir / "progress").mkdir(parents=True, exist_ok=True)
    write_progress(run_dir, rank, 0, "starting")
    write_phase(run_dir, rank, "entered")
    _, dp_rank, _pp_rank = layout.coords(rank)

    # Processes before threads: the writer and the dataloader workers start
    # before gloo opens its sockets and threads.
    writer = CheckpointWriter(run_dir, rank)
    start = latest_checkpoint(run_dir, rank) if args.resume else 0
    rows = args.micro_batches * args.micro_batch_size

    def make_batches(first: int) -> Iterator[tuple[Any, Any]]:
        return iter(torch.utils.data.DataLoader(
            StepData(args.seed, dp_rank, rows, plan, rank),  # type: ignore[arg-type]
            batch_size=None, sampler=range(first, args.steps),
            num_workers=args.loader_workers, persistent_workers=args.loader_workers > 0,
            prefetch_factor=2 if args.loader_workers > 0 else None,
        ))

    batches = make_batches(start)

    timeout = datetime.timedelta(seconds=args.pg_timeout)
    device = torch.device("cpu")
    if args.backend == "nccl":
        # after the dataloader workers and the writer started: they fork before CUDA is touched
        device = use_gpu(rank, world)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    groups = m.make_groups(layout, rank)
    write_phase(run_dir, rank, "joined")
    model = m.Stage(groups, hidden=args.hidden, features=FEATURES, layers_per_stage=args.layers_per_stage, seed=args.seed)
    model.to(device)  # built on the CPU (its weights come from CPU generators), then moved
    m.set_comm_device(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    source = "start"
    if args.resume:
        # Every rank resumes from the newest step that all ranks have saved.
        agreed = torch.tensor([start], dtype=torch.int64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        agreed_start = int(agreed.item())
        if agreed_start != start:
            # This rank saved a newer step than some other rank: go back with them.
            del batches
            start = agreed_start
            batches = make_batches(start)
        restored = restore_backup(rank, world, start, optimizer)
        if restored is not None:
            del batches
            start = restored
            batches = make_batches(start)
            source = "backup"
        elif start > 0:
            source = "checkpoint"
            state = torch.load(checkpoint_dir(run_dir) / f"rank{rank}-step{start}.pt", weights_only=True,
                               map_location=device)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optim"])
    write_phase(run_dir, rank, "loaded", LoadedStep(start, source))
    backup.set_step(start)  # shards carry the job's step numbers (the hook counts optimizer steps from here)
    # ---- hot-update hook: the user code of the node's code link (none: training exactly as without it) ----
    from rankscope.drill import user_code

    code = user_code.from_env(run_dir, rank, start)
    # ---- end of the hot-update hook ----

    injector = Injector(plan, rank, device)
    m.set_comm_hook(injector.before_comm)
    if plan.name == "skip-send" and plan.rank == rank:
        m.send_forward = skipping_send(m.send_forward, injector)  # type: ignore[assignment]
        m.send_backward = skipping_send(m.send_backward, injector)  # type: ignore[assignment]
    loss_log = None
    if groups.last_stage:
        (run_dir / "loss").mkdir(exist_ok=True)
        loss_log = open(run_dir / "loss" / f"rank{rank}.jsonl", "a", encoding="utf-8")  # noqa: SIM115
    write_progress(run_dir, rank, start, "running")
    desync = desync_ranks(plan, layout)

    def run_step(step: int) -> None:
        injector.step = step
        torch.manual_seed(args.seed * 7919 + step)
        injector.at_step_start()
        if code is not None:  # hot-update hook: the version's learning-rate factor (v1: exactly 1.0)
            for group in optimizer.param_groups:
                group["lr"] = code.lr(args.lr, step)
        x, y = next(batches)
        if device.type != "cpu":
            x, y = x.to(device), y.to(device)
        loss = m.train_step(model, optimizer, x, y, micro_batches=args.micro_batches, hidden=args.hidden,
                            compute_hook=injector.after_compute, before_compute=injector.before_compute)
        if device.type != "cpu":
            step_sync_point(model)
        done = step + 1
        if loss_log is not None and loss is not None:
            record: dict[str, Any] = {"step": done, "loss": loss.hex(), "value": loss}
            if code is not None:  # hot-update hook: which code computed this step
                record["code"] = code.version
            loss_log.write(json.dumps(record) + "\n")
            loss_log.flush()
        if args.checkpoint_every > 0 and done % args.checkpoint_every == 0:
            buf = io.BytesIO()
            torch.save({"step": done, "model": model.state_dict(), "optim": optimizer.state_dict()}, buf)
            writer.save(done, buf.getvalue())
        write_progress(run_dir, rank, done, "running")
        if done == first_done:
            write_phase(run_dir, rank, "stepped")
    first_done = start + 1
    try:
        for step in range(start, args.steps):
            if step == plan.step and desync:
                # The desync fault: its group runs this step too, everyone else has left the loop.
                if rank in desync:
                    drill_injected_desync(run_step, step)
                break
            run_step(step)
        dist.barrier()
        write_progress(run_dir, rank, args.steps, "done")
    finally:
        if loss_log is not None:
            loss_log.close()
        writer.close()
    dist.destroy_process_group()
    return 0


def use_gpu(rank: int, world: int) -> Any:
    """Bind this rank to its GPU and give NCCL what sharing one needs (see ``gpu.py``); the device."""
    import torch
    from rankscope.drill import gpu

    if not torch.cuda.is_available():
        raise SystemExit("drill worker: --backend nccl needs CUDA: torch.cuda.is_available() is False here")
    gpus = torch.cuda.device_count()
    os.environ.update(gpu.not_set(os.environ, gpu.nccl_rank_env(rank, world, gpus, os.environ.get(RUN_ID_ENV, "drill"))))
    index = gpu.rank_device(rank, gpus)
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def step_sync_point(model: Any) -> float:
    """The host waits for the step's GPU work here, as a job that logs a value each step does.

    NCCL calls return once enqueued; without a sync the host would run ahead
    of the device. A rank whose peer stopped waits here, in ``.item()``
    (natively ``cudaStreamSynchronize``), not in the collective's Python call.
    """
    first = next(model.parameters())
    return float(first.detach().norm().item())



def run_noise() -> int:
    drill_injected_cpu_noise()
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rankscope.drill.worker")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="one rank of the drill (started by torchrun)")
    t.add_argument("--run-dir", required=True)
    t.add_argument("--tp", type=int, default=2)
    t.add_argument("--pp", type=int, default=2)
    t.add_argument("--dp", type=int, default=2)
    t.add_argument("--machines", type=int, default=1)
    t.add_argument("--steps", type=int, default=100)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--hidden", type=int, default=64)
    t.add_argument("--layers-per-stage", type=int, default=2)
    t.add_argument("--micro-batches", type=int, default=4)
    t.add_argument("--micro-batch-size", type=int, default=8)
    t.add_argument("--lr", type=float, default=0.01)
    t.add_argument("--loader-workers", type=int, default=1)
    t.add_argument("--checkpoint-every", type=int, default=5)
    t.add_argument("--pg-timeout", type=float, default=900.0)
    t.add_argument("--resume", action="store_true")
    t.add_argument("--backend", choices=BACKENDS, default=DEFAULT_BACKEND,
                   help="gloo: CPU tensors; nccl: each rank on a GPU (shared round-robin when there are fewer)")
    w = sub.add_parser("checkpoint-writer", help="the checkpoint writer process of one rank")
    w.add_argument("--run-dir", required=True)
    w.add_argument("--rank", type=int, required=True)
    sub.add_parser("noise", help="the spinning neighbour of the cpu-contention fault")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "train":
        return train(args)
    if args.cmd == "checkpoint-writer":
        return run_checkpoint_writer(Path(args.run_dir), args.rank)
    return run_noise()


if __name__ == "__main__":
    raise SystemExit(main())
