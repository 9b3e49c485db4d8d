"""Faults carried out inside a drill rank: the plan's fault at its rank and step, each in its own frame.

An injected fault runs inside a function named ``drill_injected_<fault>``, so the frame a stack capture should show
is known in advance (``faults.FaultSpec.frame``). ``Injector`` is called by the rank's training loop at each step,
compute and communication and decides when its rank's fault fires; the dataloader's and the checkpoint writer's
faults fire in those processes (``worker.StepData``, ``checkpoints.run_checkpoint_writer``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from rankscope.drill.faults import DrillLayout, FaultPlan


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


def desync_ranks(plan: FaultPlan, layout: DrillLayout) -> frozenset[int]:
    """The ranks that run one step more under the desync fault (none for any other fault)."""
    if plan.name != "desync" or plan.group is None:
        return frozenset()
    return frozenset(layout.group_of(plan.group, plan.rank))
