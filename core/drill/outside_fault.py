"""Faults the drill applies to ranks from outside them (the plan's ``by="orchestrator"`` faults): ``sigstop``
stops a rank at its faulty step, ``cpu-contention`` runs a noisy neighbour on the victim machine's core,
``thermal`` stretches each of the rank's steps by stopping it. A thread watches the progress files and starts,
pauses and resumes the fault at the planned steps; a capture holds it off (``capturing``)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from rankscope.drill.faults import DrillLayout, FaultPlan, machine_name
from rankscope.drill.launcher import Launcher
from rankscope.drill.progress import ProgressWatcher

FAULT_POLL_S = 0.1  # how often the fault looks at the job's progress


class OutsideFault:
    """One drill's outside fault; ``run`` is its thread's body, ended by ``stop_event``."""

    def __init__(self, plan: FaultPlan, layout: DrillLayout, launcher: Launcher, watcher: ProgressWatcher,
                 notes: list[str]) -> None:
        self.plan = plan
        self.layout = layout
        self.launcher = launcher
        self.watcher = watcher
        self.run_dir = launcher.run_dir
        self.notes = notes
        self.stop_event = threading.Event()
        self.capturing = threading.Event()  # set while stacks are read: the fault holds off
        self.throttle_lock = threading.Lock()  # held for one stop/continue cycle of the thermal fault
        self.stopped_pid: int | None = None  # the rank the sigstop fault stopped (continued again at the end)

    def run(self) -> None:
        """Start, pause and resume an orchestrator fault as the job passes the planned steps."""
        plan = self.plan
        noise: list[Any] = []
        pinned: dict[int, set[int]] = {}
        target_pid: int | None = None
        healthy = _HealthyStep(plan.step)
        while not self.stop_event.is_set():
            latest = self.watcher.poll()
            step = self.watcher.max_step()
            mine = latest.get(plan.rank)
            if mine is not None:
                healthy.saw(mine.step, mine.wall)
            on = plan.active(step)
            if plan.name == "sigstop":
                if self.stopped_pid is None and mine is not None and mine.step >= plan.step:
                    self._stop_rank(mine.pid)
            elif plan.name == "cpu-contention":
                if on != bool(pinned):
                    # The victim's ranks stay on the noise's core only while it spins.
                    pinned = self._confine_victims() if on else _restore_threads(pinned)
                noise = self._toggle_noise(noise, on)
            elif plan.name == "thermal" and on and not self.capturing.is_set():
                # A hot device still runs, only slower: never leave the rank
                # stopped while py-spy reads it.
                target_pid = target_pid or self.watcher.pids().get(plan.rank)
                if target_pid is not None:
                    self._throttle_step(target_pid, plan, healthy)
                    continue
            self.stop_event.wait(FAULT_POLL_S)

    def _stop_rank(self, pid: int) -> None:
        """The sigstop fault: stop the rank as it begins its faulty step; it stays stopped until the drill ends.

        The drill reads no stack of it meanwhile (a capture does not continue it, unlike the thermal fault's).
        """
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            self.notes.append(f"sigstop: rank {self.plan.rank} (pid {pid}) was gone before it could be stopped")
            return
        self.stopped_pid = pid
        self.notes.append(f"sigstop: rank {self.plan.rank} (pid {pid}) stopped at step {self.plan.step}")

    def stopped_rank(self) -> dict[str, Any] | None:
        """The rank the sigstop fault stopped, its pid and its process state now (psutil's word: "stopped" is T)."""
        if self.stopped_pid is None:
            return None
        import psutil

        try:
            state = str(psutil.Process(self.stopped_pid).status())
        except psutil.Error:
            state = "gone"
        return {"rank": self.plan.rank, "pid": self.stopped_pid, "state": state}

    def _toggle_noise(self, noise: list[Any], on: bool) -> list[Any]:
        """Start the noisy neighbour on the victim machine's core at onset; pause and resume it with the plan.

        Four drill machines share this host's cores, so a spinner pinned "beside"
        a machine's ranks would land on every machine's CPUs. At onset the
        victim machine's ranks (every thread) are confined to one core, as a
        real machine's ranks are to its own CPUs, and ``NOISE_PROCS`` spinning
        processes are pinned to that core: the victim's compute then competes
        with the noise, the other machines' ranks run where they always did.
        The noise runs at a higher priority (``NOISE_NICE``), like a system
        daemon or another tenant's job: at equal priority the scheduler favours
        the ranks, which sleep in their collectives most of the time, and on a
        host already loaded by other work the noise barely slows them.
        """
        import os
        import signal as sig

        if on and not noise:
            core = _victim_core(self.plan.machine or 0)
            for _ in range(NOISE_PROCS):
                proc = self.launcher.start_helper(
                    [self.launcher.python, "-m", "rankscope.drill.worker", "noise"], "noise.log",
                    env={"RANKSCOPE_ROLE": "other"},
                )
                _pin_like(proc.pid, [], cpus={core})
                with contextlib.suppress(OSError):  # not root: the noise runs at the ranks' priority
                    os.setpriority(os.PRIO_PROCESS, proc.pid, NOISE_NICE)
                noise.append(proc)
            self.notes.append(f"cpu-contention: {NOISE_PROCS} noise processes {[n.pid for n in noise]} on CPU {core} "
                              f"with the ranks of {machine_name(self.plan.machine or 0)}")
        elif noise:
            for proc in noise:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig.SIGCONT if on else sig.SIGSTOP)
        return noise

    def _confine_victims(self) -> dict[int, set[int]]:
        """Confine every thread of the victim machine's ranks to its noise core; their affinity before, per thread."""
        core = _victim_core(self.plan.machine or 0)
        before: dict[int, set[int]] = {}
        for pid in self.rank_pids_of_machine():
            before.update(_pin_threads(pid, {core}))
        return before

    def rank_pids_of_machine(self) -> list[int]:
        pids = self.watcher.pids()
        return [pids[r] for r in self.layout.ranks_on(self.plan.machine or 0) if r in pids]

    def _throttle_step(self, pid: int, plan: FaultPlan, healthy: _HealthyStep) -> None:
        """One throttled step of the thermal fault on CPU: stop the rank ``factor - 1`` healthy steps' worth.

        The rank is stopped as it begins a step (seen on its progress file), so
        every step it takes lasts about ``factor`` times its healthy step, as on
        a device clocked ``factor`` times slower, and its peers wait on it. (A
        duty cycle of tens of milliseconds mostly stops the rank while it
        waits on its peers anyway, and slows a communication-bound step far
        less than ``factor``.) The same on a GPU machine: locking a GPU's clock
        lower needs root, which a drill does not ask for.
        """
        import os
        import signal as sig

        begun = _progress_step(self.run_dir, plan.rank)
        deadline = time.monotonic() + 2.0
        while not self.stop_event.is_set() and not self.capturing.is_set() and time.monotonic() < deadline:
            now = _progress_step(self.run_dir, plan.rank)
            if begun is None or (now is not None and now[0] > begun[0]):
                break
            time.sleep(THROTTLE_POLL_S)
        else:
            return
        if now is None:
            return
        stop_s = healthy.stepped(now[0], now[1], plan.factor)
        with self.throttle_lock:
            try:
                os.kill(pid, sig.SIGSTOP)
                # Woken early by a capture or the drill's end: never leave it stopped.
                self.capturing.wait(stop_s)
                os.kill(pid, sig.SIGCONT)
            except ProcessLookupError:
                return


NOISE_PROCS = 3  # spinning processes of the cpu-contention neighbour (on one core)
NOISE_NICE = -5  # their priority (root only; lower is more favoured)
THROTTLE_POLL_S = 0.005  # how often the thermal fault looks for the rank's next step


def _progress_step(run_dir: Path, rank: int) -> tuple[int, float] | None:
    """(step, wall) one rank last reported, read from its progress file alone (cheap enough to poll fast)."""
    import json

    from rankscope.drill.progress import progress_path

    try:
        data = json.loads(progress_path(run_dir, rank).read_text())
        return int(data["step"]), float(data["wall"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


class _HealthyStep:
    """The faulty rank's healthy step time, and how long the thermal fault stops it per step.

    The healthy step comes from the walls its progress file reports before the
    fault. Stopping the rank ``factor - 1`` healthy steps per step does not
    make its step ``factor`` times as long on a shared CPU (its peers run
    faster while it is stopped), so the stop is steered by the steps it
    really takes: lengthened while they fall short of ``factor`` times the
    healthy step, shortened when they overshoot.
    """

    WARMUP = 2
    DEFAULT_S = 0.2
    GAIN = 0.5

    def __init__(self, fault_step: int) -> None:
        self.fault_step = fault_step
        self.first: tuple[int, float] | None = None
        self.last: tuple[int, float] | None = None
        self.stop_s: float | None = None
        self._prev: tuple[int, float] | None = None

    def saw(self, step: int, wall: float) -> None:
        if not self.WARMUP <= step <= self.fault_step:
            return
        if self.first is None:
            self.first = (step, wall)
        elif step > self.first[0]:
            self.last = (step, wall)

    def seconds(self) -> float:
        if self.first is None or self.last is None:
            return self.DEFAULT_S
        return min(5.0, max(0.01, (self.last[1] - self.first[1]) / (self.last[0] - self.first[0])))

    def stepped(self, step: int, wall: float, factor: float) -> float:
        """The rank reported ``step`` at ``wall``: the stop that steers it toward steps of ``factor`` healthy steps."""
        target = factor * self.seconds()
        if self.stop_s is None:
            self.stop_s = (factor - 1.0) * self.seconds()
        elif self._prev is not None and step > self._prev[0]:
            took = (wall - self._prev[1]) / (step - self._prev[0])
            self.stop_s = min(3.0 * target, max(0.0, self.stop_s + self.GAIN * (target - took)))
        self._prev = (step, wall)
        return self.stop_s


def _restore_threads(before: dict[int, set[int]]) -> dict[int, set[int]]:
    """Give threads back the affinity ``_pin_threads`` recorded; returns {} (nothing pinned any more)."""
    import os

    for tid, cpus in before.items():
        with contextlib.suppress(OSError):
            os.sched_setaffinity(tid, cpus)
    return {}


def _victim_core(machine: int) -> int:
    """The core a machine's contention is pinned to (spread over the CPUs this process may use)."""
    import os

    cpus = sorted(os.sched_getaffinity(0))
    return cpus[machine % len(cpus)]


def _pin_threads(pid: int, cpus: set[int]) -> dict[int, set[int]]:
    """Confine every thread of ``pid`` to ``cpus``; returns each thread's affinity before."""
    import os

    import psutil

    before: dict[int, set[int]] = {}
    with contextlib.suppress(psutil.Error):
        for t in psutil.Process(pid).threads():
            with contextlib.suppress(OSError):
                before[t.id] = set(os.sched_getaffinity(t.id))
                os.sched_setaffinity(t.id, cpus)
    return before


def _pin_like(pid: int, others: list[int], cpus: set[int] | None = None) -> None:
    """Pin ``pid`` to ``cpus``, or to the CPUs the processes ``others`` may run on, so the noise lands on that machine."""
    import os

    import psutil

    allowed: set[int] = set(cpus or ())
    if not allowed:
        for other in others:
            with contextlib.suppress(psutil.Error):
                allowed.update(psutil.Process(other).cpu_affinity() or [])
    if allowed:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(pid, allowed)


# --------------------------------------------------------------------------
# What was captured, against the ground truth
# --------------------------------------------------------------------------
