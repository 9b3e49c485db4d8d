"""A drill run from start to stop: launch, wait, inject, detect the stall, capture, score.

``DrillSession`` is a context manager: whatever happens inside the ``with``
(an exception, Ctrl-C, SIGTERM, interpreter exit), every process the drill
started is stopped. ``run_headless`` is the whole headless drill as one call;
it returns the report that ``rankscope drill --headless --json`` prints.

Faults that the ranks inject themselves are fixed at launch (the plan rides
in their environment); faults that act from outside (``sigstop``,
``cpu-contention``, ``thermal``) are carried out by ``outside_fault``, in a
thread the session starts and stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import tempfile
import threading
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rankscope.contract.errors import RankscopeError
from rankscope.contract.snapshot import JobSnapshot, ProcessRole, main_thread
from rankscope.drill.control import DrillMachines, Recovery, RecoveryEvent, standby_name
from rankscope.drill.faults import FAULT_ENV, DrillLayout, FaultPlan, GroundTruth, ground_truth
from rankscope.drill.launcher import Launcher, TrainingOptions, node_logs
from rankscope.drill.outside_fault import OutsideFault
from rankscope.drill.progress import ProgressWatcher

POLL_S = 0.1
PARK_WAIT_S = 600.0  # the standbys' self-checks wait this long at most for the parked nodes to finish importing


@dataclass(frozen=True, slots=True)
class DrillConfig:
    layout: DrillLayout = field(default_factory=DrillLayout)
    plan: FaultPlan = field(default_factory=lambda: FaultPlan(name="none", rank=-1, step=0))
    training: TrainingOptions = field(default_factory=TrainingOptions)
    run_dir: Path | None = None
    agents: bool = True  # False: capture in this process with the probes (no gRPC)
    stall_seconds: float = 5.0
    start_timeout_s: float = 180.0  # until every rank has finished its first step
    stall_timeout_s: float = 120.0  # from the fault step until progress stopped
    capture_timeout_s: float = 5.0  # per py-spy call
    counters: bool = True  # CCL counters in the ranks (the plugin of rankscope.ccl_plugin)
    standbys: int = 0  # idle warm standbys; > 0 also turns on the agents' actions and the recovery (drill.control)
    warm: bool = True  # with standbys: nodes are parked, pre-imported interpreters (rankscope.drill.warm)


@dataclass
class StallInfo:
    """How waiting for the stall ended."""

    reason: str  # "stalled", "job-exited", "finished", "timeout"
    idle_s: float
    steps: dict[int, int]
    node_exit_codes: dict[str, int | None]


class DrillInterrupted(RankscopeError):
    def __init__(self, signum: int) -> None:
        super().__init__(f"drill stopped by signal {signal.Signals(signum).name}; every process it started was stopped")


class DrillSession:
    """One drill: a running job, its agents, its fault and its ground truth."""

    def __init__(self, config: DrillConfig) -> None:
        self.config = config
        self.layout = config.layout
        self.plan = config.plan
        self.truth: GroundTruth = ground_truth(config.plan, config.layout,
                                               checkpoint_every=config.training.checkpoint_every)
        self.run_dir = config.run_dir or Path(tempfile.mkdtemp(prefix="rankscope-drill-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.launcher = Launcher(self.run_dir, self.layout, config.training, counters=config.counters,
                                 actions=config.standbys > 0, warm=config.warm and config.standbys > 0)
        self.recovery: Recovery | None = None
        self._precheck: threading.Thread | None = None
        self.watcher = ProgressWatcher(self.run_dir, self.layout.world)
        self.notes: list[str] = self.launcher.notes  # one list: launcher and session notes together
        self.times: dict[str, float] = {}  # event -> monotonic seconds
        self.fault_started_mono: float | None = None
        self._stop_event = threading.Event()
        self.outside_fault = OutsideFault(self.plan, self.layout, self.launcher, self.watcher, self.notes)
        self._outside: threading.Thread | None = None
        self._old_handlers: dict[int, Any] = {}
        self._stopped = False
        self.leftovers: list[int] = []  # pids the final sweep had to kill

    # ---- lifecycle ------------------------------------------------------------

    def __enter__(self) -> DrillSession:
        self._install_signal_handlers()
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: types.TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        import atexit

        atexit.register(self.stop)
        self.times["launch"] = time.monotonic()
        env = {FAULT_ENV: self.plan.to_env()} if self.plan.spec.by == "rank" else {}
        self.launcher.start_nodes(env=env)
        if self.config.agents:
            try:
                self.launcher.start_agents()
            except RankscopeError as exc:
                self.notes.append(f"agents unavailable, capturing in-process instead: {exc.message}")
            else:
                if self.config.standbys > 0:
                    self.launcher.start_standbys([standby_name(i) for i in range(self.config.standbys)])
                    control = DrillMachines(self.launcher)
                    standbys = tuple(self.launcher.standbys)
                    slots = (*self.launcher.machines(), *standbys)
                    parked = (lambda: self.launcher.wait_parked(slots, PARK_WAIT_S)) if self.launcher.warm else None
                    self._precheck = control.precheck(standbys, after=parked)
                    self.recovery = Recovery(self.launcher, control, on_event=self.notes.append)
                    self.recovery.start()
        if self.plan.spec.by == "orchestrator":
            self._outside = threading.Thread(target=self.outside_fault.run, name="drill-outside-fault", daemon=True)
            self._outside.start()

    def stop(self) -> list[int]:
        """Stop everything this drill started; safe to call twice. Returns pids the sweep found."""
        if self._stopped:
            return []
        self._stopped = True
        self._hold_signals()  # a second Ctrl-C or SIGTERM must not cut the cleanup short
        self._stop_event.set()
        self.outside_fault.stop_event.set()
        if self._outside is not None:
            self._outside.join(timeout=5)
        if self.outside_fault.stopped_pid is not None:
            # Never leave a stopped rank behind: a stopped process acts on SIGTERM only once continued.
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.outside_fault.stopped_pid, signal.SIGCONT)
        if self.recovery is not None:
            self.recovery.stop()
        if self._precheck is not None:
            self._precheck.join(timeout=30)  # its gloo pair ends on its own within the check's timeout
        self.leftovers = self.launcher.stop()
        self._restore_signal_handlers()
        return self.leftovers

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, frame: types.FrameType | None) -> None:
            raise DrillInterrupted(signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, handler)

    def _hold_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            old = signal.signal(sig, signal.SIG_IGN)
            self._old_handlers.setdefault(sig, old)

    def _restore_signal_handlers(self) -> None:
        for sig, old in self._old_handlers.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, old)
        self._old_handlers.clear()

    # ---- where the job is -------------------------------------------------

    @property
    def agents(self) -> dict[str, str]:
        return self.launcher.addresses()

    def token(self) -> str:
        return self.launcher.token()

    def _poll(self) -> None:
        self.watcher.poll()
        if self.fault_started_mono is None and self.plan.name != "none":
            # The fault acts during step ``plan.step``, which begins once the
            # faulty rank has completed that many steps.
            p = self.watcher.latest.get(self.plan.rank)
            fault_step = self.truth.step if self.truth.step is not None else self.plan.step
            if self.plan.name == "checkpoint-stall":
                # The checkpoint of ``step`` steps is written as the rank ends its step number ``step`` (counting
                # from 1), before it reports it: it has reported one step less when the writer stalls.
                fault_step -= 1
            if p is not None and p.step >= fault_step:
                self.fault_started_mono = time.monotonic()
                self.times["fault"] = self.fault_started_mono

    def _job_exited(self) -> bool:
        return not any(self.launcher.nodes_alive().values())

    def wait_for_steps(self, step: int, timeout_s: float) -> None:
        """Block until every rank has completed ``step`` steps."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._poll()
            if self.watcher.min_step() >= step:
                return
            if self._job_exited():
                raise RankscopeError(
                    f"the drill job exited before every rank reached step {step} (exit codes {self.launcher.node_exit_codes()})",
                    f"read the logs in {self.run_dir / 'logs'}",
                )
            if time.monotonic() > deadline:
                raise RankscopeError(
                    f"ranks did not reach step {step} within {timeout_s:.0f} s (steps now: {self.steps()})",
                    f"read the logs in {self.run_dir / 'logs'}; on a busy machine pass a longer --start-timeout",
                )
            time.sleep(POLL_S)

    def standbys_checked(self, timeout_s: float) -> bool:
        """Wait for the background self-check of the idle standbys; True when it finished."""
        if self._precheck is not None:
            self._precheck.join(timeout_s)
            return not self._precheck.is_alive()
        return True

    def wait_for_recovery(self, count: int = 1, timeout_s: float = 120.0) -> RecoveryEvent:
        """Block until the drill has handled ``count`` evictions (restarted with standbys, or failed to)."""
        if self.recovery is None:
            raise RankscopeError("this drill has no standbys, so an eviction does not restart it",
                                 "run the drill with --standbys 1 or more")
        event = self.recovery.wait(count, timeout_s)
        self.times["restarted"] = event.restarted_mono
        return event

    def steps(self) -> dict[int, int]:
        return {r: p.step for r, p in sorted(self.watcher.latest.items())}

    def wait_until_stalled(self, stall_s: float | None = None, timeout_s: float | None = None) -> StallInfo:
        """Block until no rank advanced for ``stall_s`` seconds, the job exited or finished."""
        stall_s = self.config.stall_seconds if stall_s is None else stall_s
        timeout_s = self.config.stall_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        reason = "timeout"
        while time.monotonic() < deadline:
            self._poll()
            if self.watcher.all_done():
                reason = "finished"
                break
            if self._job_exited():
                reason = "job-exited"
                break
            if self.watcher.idle_seconds() >= stall_s and len(self.watcher.latest) == self.layout.world:
                reason = "stalled"
                break
            time.sleep(POLL_S)
        self.times["stall_detected"] = time.monotonic()
        return StallInfo(reason=reason, idle_s=self.watcher.idle_seconds(), steps=self.steps(),
                         node_exit_codes=self.launcher.node_exit_codes())

    # ---- capture ------------------------------------------------------------

    def capture(self, *, native: bool = False, subprocesses: bool = True) -> JobSnapshot:
        """One snapshot of the whole job: through the agents, else with the probes in this process."""
        started = time.monotonic()
        timeout_s = self.config.capture_timeout_s
        fault = self.outside_fault
        fault.capturing.set()
        with fault.throttle_lock:  # let a running stop/continue cycle finish first
            pass
        try:
            return self._capture(native=native, subprocesses=subprocesses, timeout_s=timeout_s, started=started)
        finally:
            fault.capturing.clear()

    def _capture(self, *, native: bool, subprocesses: bool, timeout_s: float, started: float) -> JobSnapshot:
        if self.agents:
            from rankscope.wire.client import capture_once

            snap = capture_once(list(self.agents.values()), self.token(), native=native, subprocesses=subprocesses,
                                timeout_s=timeout_s)
        else:
            snap = asyncio.run(self._capture_in_process(native=native, subprocesses=subprocesses, timeout_s=timeout_s))
        from dataclasses import replace

        snap = replace(snap, layout=self.layout.to_snapshot_layout(), job_id=snap.job_id or self.launcher.run_id)
        self.times["captured"] = time.monotonic()
        self.times["capture_s"] = self.times["captured"] - started
        return snap

    async def _capture_in_process(self, *, native: bool, subprocesses: bool, timeout_s: float) -> JobSnapshot:
        from rankscope.contract.snapshot import Instant
        from rankscope.probes.machine import CaptureOptions, Scope, capture_machine

        options = CaptureOptions(native=native, subprocesses=subprocesses, timeout_s=timeout_s)
        started = Instant(wall=time.time(), mono=time.monotonic())
        counter_dir = self.launcher.counter_dir if self.config.counters else None
        machines = await asyncio.gather(*(
            capture_machine(name, "in-process", Scope(launcher_pid=node.proc.pid, counter_dir=counter_dir), options)
            for name, node in self.launcher.nodes.items()
        ))
        return JobSnapshot(captured=started, machines=tuple(machines), job_id=self.launcher.run_id)

def innermost(frames: Any, count: int = 4) -> list[str]:
    return [f"{f.name} ({Path(f.filename).name}:{f.line})" for f in list(frames)[:count]]


def capture_summary(snap: JobSnapshot, truth: GroundTruth, frames: int = 8) -> dict[str, Any]:
    """Per machine and rank what the capture holds, and whether the injected frame is where it should be."""
    machines: list[dict[str, Any]] = []
    found_frame_in: list[dict[str, Any]] = []
    ranks_with_stacks: set[int] = set()
    for m in snap.machines:
        ranks: dict[str, Any] = {}
        for rs in sorted(m.stacks, key=lambda s: s.rank):
            main = main_thread(rs.main)
            if main is not None and main.frames:
                ranks_with_stacks.add(rs.rank)
            subs = []
            for sp in rs.subprocesses:
                sub_main = main_thread(sp)
                subs.append({"pid": sp.pid, "role": str(sp.role), "top": innermost(sub_main.frames if sub_main else (), 2),
                             "error": sp.error.message if sp.error else None})
            for proc in (rs.main, *rs.subprocesses):
                for t in proc.threads or ():
                    if truth.frame and any(f.name == truth.frame for f in t.frames):
                        found_frame_in.append({"rank": rs.rank, "machine": m.machine, "pid": proc.pid,
                                               "role": str(proc.role)})
            ranks[str(rs.rank)] = {
                "pid": rs.main.pid,
                "main": innermost(main.frames, frames) if main is not None else [],
                "error": rs.main.error.message if rs.main.error else None,
                "subprocesses": subs,
            }
        machines.append({
            "machine": m.machine, "address": m.address, "reachable": m.reachable,
            "ranks_seen": sorted(r.rank for r in m.ranks), "stacks_captured": len(ranks_with_stacks & {r.rank for r in m.ranks}),
            "error": m.error.message if m.error else None, "ranks": ranks,
        })
    world = snap.world_size or 0
    frame_ok = None
    if truth.frame and truth.rank is not None:
        frame_ok = any(f["rank"] == truth.rank and f["role"] == _role_value(truth.role) for f in found_frame_in)
    return {
        "machines": machines,
        "ranks_with_stacks": sorted(ranks_with_stacks),
        "ranks_missing": sorted(set(range(world)) - ranks_with_stacks),
        "injected_frame": truth.frame,
        "injected_frame_found_in": found_frame_in,
        "injected_frame_at_faulty_rank": frame_ok,
    }


def _role_value(role: str) -> str:
    try:
        return str(ProcessRole(role))
    except ValueError:
        return role


def score(snap: JobSnapshot, truth: GroundTruth) -> dict[str, Any] | None:
    """Where the analyzers' verdict meets the ground truth: ``analyze_snapshot`` graded by ``score_verdict``.

    Returns None when the analyzers are not installed.
    """
    analyze = _analyzer_entry()
    if analyze is None:
        return None
    from rankscope.analyzers.topology import placement_of
    from rankscope.drill.scoring import score_verdict

    started = time.monotonic()
    verdict = analyze(snap)
    graded = score_verdict(verdict, truth, placement_of(snap))
    graded["analysis_s"] = round(time.monotonic() - started, 3)
    return graded


def _analyzer_entry() -> Callable[[JobSnapshot], Any] | None:
    """The analyzers' one-call verdict over a snapshot, once it exists."""
    try:
        from rankscope.analyzers import analysis as v
    except ImportError:
        return None
    entry = getattr(v, "analyze_snapshot", None)
    return entry if callable(entry) else None


# --------------------------------------------------------------------------
# The headless drill
# --------------------------------------------------------------------------


def _seconds(times: dict[str, float], a: str, b: str) -> float | None:
    return round(times[b] - times[a], 3) if a in times and b in times else None


def run_headless(config: DrillConfig, *, bundle_path: Path | None = None,
                 on_event: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Start, inject, wait until progress stops (or the capture step for slow faults), capture, write the bundle."""
    from rankscope.contract.bundle import Bundle, write_bundle

    say = on_event or (lambda _msg: None)
    with DrillSession(config) as s:
        say(f"drill {s.launcher.run_id}: {config.layout.world} ranks on {config.layout.machines} machines, "
            f"fault {config.plan.name} (run dir {s.run_dir})")
        s.wait_for_steps(1, config.start_timeout_s)
        s.times["running"] = time.monotonic()
        say(f"job running; agents: {s.agents or 'none (in-process capture)'}")
        if s.truth.category == "hang":
            stall = s.wait_until_stalled()
            say(f"progress stopped ({stall.reason}) at steps {stall.steps}")
        else:
            capture_step = min(config.plan.step + max(5, config.training.steps // 4), config.training.steps - 1) \
                if config.plan.name != "none" else max(1, config.training.steps // 2)
            s.wait_for_steps(capture_step, config.stall_timeout_s)
            s.times["capture_step"] = time.monotonic()
            stall = StallInfo(reason="capture-step", idle_s=s.watcher.idle_seconds(), steps=s.steps(),
                              node_exit_codes=s.launcher.node_exit_codes())
        stopped = s.outside_fault.stopped_rank()  # read before the capture: its state while py-spy tries to read it
        snap = s.capture()
        say(f"captured in {s.times['capture_s']:.2f} s")
        truth = s.truth.to_dict()
        summary = capture_summary(snap, s.truth)
        bundle_path = bundle_path or s.run_dir / "bundle.json"
        meta = {"drill": {"run_id": s.launcher.run_id, "run_dir": str(s.run_dir), "agents": s.agents,
                          "stall": stall.reason, "steps": stall.steps, "notes": s.notes}}
        write_bundle(Bundle(snapshots=(snap,), created_wall=time.time(), ground_truth=truth, meta=meta), bundle_path)
        report: dict[str, Any] = {
            "run_id": s.launcher.run_id,
            "run_dir": str(s.run_dir),
            "bundle": str(bundle_path),
            "layout": {"tp": config.layout.tp, "pp": config.layout.pp, "dp": config.layout.dp,
                       "machines": config.layout.machines, "world": config.layout.world},
            "ground_truth": truth,
            "stall": {"reason": stall.reason, "idle_s": round(stall.idle_s, 2), "steps": stall.steps,
                      "node_exit_codes": stall.node_exit_codes},
            "captured": summary,
            "verdict": score(snap, s.truth),
            "step_seconds": _step_times(s),
            "times_s": {
                "launch_to_running": _seconds(s.times, "launch", "running"),
                "fault_to_stall_detected": _seconds(s.times, "fault", "stall_detected"),
                "stall_detected_to_captured": _seconds(s.times, "stall_detected", "captured"),
                "fault_to_capture_step": _seconds(s.times, "fault", "capture_step"),  # slow faults, baseline
                "fault_to_captured": _seconds(s.times, "fault", "captured"),
                "capture": round(s.times["capture_s"], 3),
            },
            "notes": s.notes,
            "stopped_rank": stopped,
            "errors_in_logs": log_errors(s.run_dir) if stall.reason == "job-exited" else {},
        }
    report["leftover_processes"] = s.leftovers
    return report


def log_errors(run_dir: Path, limit: int = 3) -> dict[str, list[str]]:
    """The error lines of each node's log: what a crash left behind."""
    out: dict[str, list[str]] = {}
    for log in node_logs(run_dir):
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines()
                 if "Error:" in ln or "exitcode" in ln]
        if lines:
            out[log.name.split(".")[0]] = lines[:limit]
    return out


def _step_times(s: DrillSession) -> dict[str, Any]:
    """Mean seconds per step of the faulty rank (or rank 0) before and after the fault step."""
    rank = s.plan.rank if s.plan.rank >= 0 else 0
    fault_step = s.plan.step if s.plan.name != "none" else 1
    before = s.watcher.step_seconds(rank, 1, fault_step) if fault_step > 1 else None
    after = s.watcher.step_seconds(rank, fault_step, s.watcher.max_step())
    return {"rank": rank, "before_fault": before, "after_fault": after}


@contextlib.contextmanager
def drill(config: DrillConfig) -> Iterator[DrillSession]:
    """``with drill(config) as s:`` — the session, stopped at the end whatever happens."""
    with DrillSession(config) as s:
        yield s
