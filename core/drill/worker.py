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

The fault plan comes from ``RANKSCOPE_DRILL_FAULT`` (see ``faults.py``). An
injected fault runs inside a function named ``drill_injected_<fault>``, so the
frame a stack capture should show is known in advance.

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
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from rankscope.drill.faults import FAULT_ENV, DrillLayout, FaultPlan
from rankscope.drill.gpu import BACKENDS, DEFAULT_BACKEND
from rankscope.drill.progress import LoadedStep, write_phase, write_progress

# What the launcher tells the ranks it starts (the worker only reads them; the launcher imports them from here).
RUN_ID_ENV = "RANKSCOPE_DRILL_RUN_ID"
STORES_ENV = "RANKSCOPE_DRILL_BACKUP_STORES"  # JSON: the backup store of each machine of the job, by node rank

FEATURES = 16


# --------------------------------------------------------------------------
# Injected faults: each one lives in its own recognisable frame
# --------------------------------------------------------------------------


def _parent_gone(parent: int) -> bool:
    return os.getppid() != parent


def drill_injected_hang_compute() -> None:
    """Spin in compute forever, as a kernel that never returns would."""
    acc = 0.0
    while True:
        for i in range(20000):
            acc += (i % 7) * 0.5
        time.sleep(0.01)


def drill_injected_hang_p2p() -> None:
    """Never issue the pipeline send the next stage waits for."""
    while True:
        time.sleep(0.1)


def drill_injected_skip_send() -> None:
    """Skip this one pipeline send: the caller returns without it, as a rank-dependent branch would."""


def skipping_send(send: Callable[..., None], injector: Injector) -> Callable[..., None]:
    """``send`` (the model's send_forward or send_backward), skipped once at the plan's step on the faulty rank."""
    skipped: list[int] = []

    def maybe_send(*args: Any, **kwargs: Any) -> None:
        if injector.mine() and injector.step == injector.plan.step and not skipped:
            skipped.append(injector.step)
            drill_injected_skip_send()
            return
        send(*args, **kwargs)
    return maybe_send


def drill_injected_hang_collective() -> None:
    """Never join the collective the rest of the group waits in."""
    while True:
        time.sleep(0.1)


def drill_injected_dataloader_stall() -> None:
    """Block the dataloader worker; it leaves when its rank is gone."""
    parent = os.getppid()
    while not _parent_gone(parent):
        time.sleep(0.1)
    os._exit(1)


def drill_injected_dataloader_deadlock() -> None:
    """Deadlock the dataloader worker: two threads take two locks in opposite order.

    This thread holds ``first`` and waits for ``second``; its peer holds
    ``second`` and waits for ``first``. Neither ever gets its lock. The peer
    wakes twice a second only to leave once the rank is gone (a worker whose
    parent died must not linger), which it does with ``os._exit``, since the
    deadlocked thread can never be joined.
    """
    parent = os.getppid()
    first, second = threading.Lock(), threading.Lock()
    peer_holds_second = threading.Event()

    def peer() -> None:
        with second:
            peer_holds_second.set()
            while not first.acquire(timeout=0.5):
                if _parent_gone(parent):
                    os._exit(1)

    with first:
        threading.Thread(target=peer, name="drill-deadlock-peer", daemon=True).start()
        peer_holds_second.wait()
        with second:  # never granted: the peer holds it until it gets ``first``, which this thread holds
            pass


def drill_injected_desync(run_step: Callable[[int], None], step: int) -> None:
    """Run one step more than the rest of the job, which has already left the training loop.

    The step's first communication with a rank outside this group never
    completes: that rank sits in the closing barrier, a different collective.
    """
    run_step(step)


def drill_injected_checkpoint_stall() -> None:
    """Block the checkpoint writer; it leaves when its rank is gone."""
    parent = os.getppid()
    while not _parent_gone(parent):
        time.sleep(0.1)
    os._exit(1)


def drill_injected_crash(rank: int, step: int) -> None:
    raise RuntimeError(f"drill: injected crash on rank {rank} at step {step}")


def drill_injected_slow_compute(seconds: float) -> None:
    """Burn CPU for ``seconds``, as a slower device would take longer."""
    end = time.perf_counter() + seconds
    acc = 0.0
    while time.perf_counter() < end:
        for i in range(200):
            acc += i * 0.5


def drill_injected_slow_gpu(matmuls: int, operand: Any) -> None:
    """Queue ``matmuls`` products of ``operand`` with itself on the rank's current CUDA stream.

    The host does not wait for them: they run on the device ahead of the
    rank's next collective, which starts that much later, as on a slow GPU.
    """
    for _ in range(matmuls):
        operand @ operand


def drill_injected_slow_comm(seconds: float) -> None:
    time.sleep(seconds)


def drill_injected_slow_dataloader(seconds: float) -> None:
    time.sleep(seconds)


def drill_injected_cpu_noise() -> None:
    """The cpu-contention neighbour: spin until killed (or the drill is gone)."""
    parent = os.getppid()
    acc = 0
    while not _parent_gone(parent):
        for i in range(100000):
            acc ^= i


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
# Checkpoints: a separate writer process per rank
# --------------------------------------------------------------------------


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


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------


def _median(values: list[float]) -> float:
    """The middle value (the upper one of an even count): step lengths, robust to one odd step."""
    return sorted(values)[len(values) // 2]


class Injector:
    """Carries out the plan inside the rank's main process.

    A slow compute is defined on the rank's *step*: at ``factor`` the step
    takes ``factor`` times as long. On the drill's small CPU model the forward
    pass is a sliver of a step (communication dominates), so scaling the
    forward would barely show; instead the rank measures its own healthy step
    time (the median of its steps before the fault) and burns ``factor - 1``
    times that much CPU per faulty step, spread over its micro-batches'
    compute. Its peers then wait on it in their next communication, as they
    would on a slower device.

    Steps do not keep their healthy length: observers sampling every rank on a
    loaded machine make every step longer, and a burn fixed from the steps
    before the watch shrinks to a varying sliver of the step being watched
    (the 1.5× case was then missed one run in four). So the burn follows the
    steps the rank takes now: each faulty step's length less what it burned
    is what the step would have taken without the fault, and the rank burns
    ``factor - 1`` times the median of the last few of those, never less than
    the nominal ``factor - 1`` healthy steps (a slow device stays slow) and
    never more than ``3 × factor`` healthy steps (a burn that slows its peers
    on a shared CPU must not feed on itself).
    """

    WARMUP_STEPS = 2  # the first steps pay for lazy set-up; not "healthy" timing
    HEALTHY_STEPS = 15  # how many healthy steps the median is taken over
    RECENT_STEPS = 7  # how many faulty steps' unfaulted lengths the burn follows

    GPU_OPERAND = 2048  # slow-gpu: the side of the square matrix multiplied (~17 GFLOP a product)

    def __init__(self, plan: FaultPlan, rank: int, device: Any = None) -> None:
        self.plan = plan
        self.rank = rank
        self.device = device  # the rank's torch device (slow-gpu: its CUDA device)
        self._operand: Any = None  # slow-gpu: the matrix multiplied, made on the device at the first faulty step
        self._matmul_s = 0.0  # slow-gpu: one product's device time, measured once
        self.step = 0
        self.compute_started = 0.0
        self._step_started: float | None = None
        self._healthy: list[float] = []  # durations of the rank's steps before the fault
        self._calls = 0  # compute-hook calls in the current step
        self._calls_per_step = 1
        self._burn_s: float | None = None  # CPU to burn per faulty step
        self._burned = 0.0  # CPU burned in the current step
        self._unfaulted: list[float] = []  # recent faulty steps' lengths less their burn

    def mine(self) -> bool:
        return self.plan.hits(self.rank, self.step)

    def at_step_start(self) -> None:
        now = time.perf_counter()
        if self._step_started is not None:
            prev = self.step - 1
            took = now - self._step_started
            if self.WARMUP_STEPS <= prev < self.plan.step:
                self._healthy = [*self._healthy, took][-self.HEALTHY_STEPS:]
                self._calls_per_step = max(1, self._calls)
            elif self._burn_s is not None and self.plan.hits(self.rank, prev) and self.plan.name == "slow-compute":
                healthy = self.healthy_step_s() or took
                self._unfaulted = [*self._unfaulted, max(0.0, took - self._burned)][-self.RECENT_STEPS:]
                unfaulted = _median(self._unfaulted)
                nominal = (self.plan.factor - 1.0) * healthy
                self._burn_s = min(3.0 * self.plan.factor * healthy,
                                   max(nominal, (self.plan.factor - 1.0) * unfaulted))
        self._step_started = now
        self._calls = 0
        self._burned = 0.0
        if self.mine() and self.plan.name == "crash" and self.step == self.plan.step:
            drill_injected_crash(self.rank, self.step)

    def healthy_step_s(self) -> float | None:
        """The median of the rank's healthy step durations (None before any)."""
        return _median(self._healthy) if self._healthy else None

    def before_compute(self) -> None:
        self.compute_started = time.perf_counter()

    def after_compute(self) -> None:
        self._calls += 1
        if not self.mine():
            return
        if self.plan.name == "hang-compute" and self.step == self.plan.step:
            drill_injected_hang_compute()
        elif self.plan.name == "slow-compute":
            healthy = self.healthy_step_s()
            if healthy is not None:
                if self._burn_s is None:
                    self._burn_s = (self.plan.factor - 1.0) * healthy
                seconds = self._burn_s / self._calls_per_step
            else:  # no healthy step seen (fault from the first steps): scale the forward, ~1/3 of compute
                seconds = 3.0 * (time.perf_counter() - self.compute_started) * (self.plan.factor - 1.0)
            self._burned += seconds
            drill_injected_slow_compute(seconds)
        elif self.plan.name == "slow-gpu":
            healthy = self.healthy_step_s()
            if healthy is not None:  # before any healthy step there is no step to scale
                seconds = (self.plan.factor - 1.0) * healthy / self._calls_per_step
                drill_injected_slow_gpu(self.gpu_matmuls(seconds), self._operand)

    def gpu_matmuls(self, seconds: float) -> int:
        """How many products of the operand take ``seconds`` of device time (timed once, on first use)."""
        if self._operand is None:
            import torch

            if self.device is None or self.device.type != "cuda":
                raise SystemExit(f"drill worker: {self.plan.name} needs the rank's CUDA device; run the drill with "
                                 "--backend nccl on a GPU machine")
            # constant entries: no random generator of the rank is drawn from, its training stays as it was
            self._operand = torch.full((self.GPU_OPERAND, self.GPU_OPERAND), 1.0 / self.GPU_OPERAND,
                                       device=self.device)
            self._operand @ self._operand  # the first product pays for the library's set-up
            torch.cuda.synchronize(self.device)
            started = time.perf_counter()
            for _ in range(10):
                self._operand @ self._operand
            torch.cuda.synchronize(self.device)
            self._matmul_s = max(1e-6, (time.perf_counter() - started) / 10)
        return max(1, round(seconds / self._matmul_s))

    def before_comm(self, kind: str, op: str) -> None:
        if not self.mine():
            return
        name = self.plan.name
        if name == "hang-p2p" and kind == "pp" and op == "send" and self.step == self.plan.step:
            drill_injected_hang_p2p()
        elif name == "hang-collective" and kind == self.plan.group and op == "all_reduce" and self.step == self.plan.step:
            drill_injected_hang_collective()
        elif name == "slow-comm" and kind == self.plan.group:
            drill_injected_slow_comm(self.plan.delay_ms / 1000.0)


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


def desync_ranks(plan: FaultPlan, layout: DrillLayout) -> frozenset[int]:
    """The ranks that run one step more under the desync fault (none for any other fault)."""
    if plan.name != "desync" or plan.group is None:
        return frozenset()
    return frozenset(layout.group_of(plan.group, plan.rank))


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
