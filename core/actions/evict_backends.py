"""Eviction backends: one interface, one procedure per kind of cluster.

ByteRobust over-evicts the machines of the suspect parallel group and brings
in warm standbys (§5, §6.2). What "evict" means depends on who owns the
machines, so the agent is configured with one backend:

``local``
    The drill: machines are local torchrun nodes. Stop the evicted ones,
    self-check idle standbys, restart the job on the remaining machines plus
    the standbys that passed. The backend drives a :class:`DrillControl` the
    drill provides.
``slurm``
    ``scontrol update nodename=<m1,m2> state=drain reason=<reason>``, then
    ``scontrol requeue <jobid>`` and ``scontrol update jobid=<jobid>
    ExcNodeList=...`` (shrinking ``NumNodes`` when too few idle standbys),
    so the job restarts on its other nodes plus standbys; or ``scancel
    <jobid>.<step>`` for a batch script that relaunches its step.
``kubernetes``
    Per node: ``kubectl cordon <node>``, ``kubectl annotate node <node>
    --overwrite rankscope.io/evict-reason=<reason>``, then ``kubectl delete
    pods --namespace <ns> --selector <job selector> --field-selector
    spec.nodeName=<node> --wait=false``; the job's controller recreates the
    pods on schedulable nodes.
``command``
    A site's own script, called with argv only (never through a shell)::

        <script> evict --job <job> --reason <reason> --machine <m1> [--machine <m2> ...]

    Contract: exit status 0 means the machines are out and the restart is
    under way; non-zero means it failed. stdout is one JSON object
    ``{"ok": bool, "message": str, "replacements": [machine, ...]}`` (all
    keys optional); stderr is shown to the person on failure.

Every command is an argv list run with ``shell=False``, and the plan a person
confirms lists those exact lists. Executable paths are configurable (the
Slurm backend is tested against a real Slurm cluster, the others against
stand-ins that record their argv).
"""

from __future__ import annotations

import copy
import json
import subprocess
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from rankscope.actions.model import check_machine, check_text
from rankscope.contract.errors import RankscopeError

DEFAULT_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class CommandRun:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str


Runner = Callable[[Sequence[str], float], CommandRun]


def run_argv(argv: Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> CommandRun:
    """Run one argv list without a shell; a missing executable or a timeout is a failed run, not an exception."""
    args = tuple(argv)
    try:
        proc = subprocess.run(list(args), shell=False, capture_output=True, text=True, timeout=timeout_s,
                              check=False)
    except FileNotFoundError as exc:
        return CommandRun(args, 127, "", f"executable not found: {exc.filename or args[0]}")
    except PermissionError as exc:
        return CommandRun(args, 126, "", f"not executable: {exc.filename or args[0]}")
    except subprocess.TimeoutExpired:
        return CommandRun(args, 124, "", f"timed out after {timeout_s:g} s")
    return CommandRun(args, proc.returncode, proc.stdout, proc.stderr)


@dataclass(frozen=True, slots=True)
class EvictionPlan:
    """Exactly what an eviction will do; shown before confirmation."""

    backend: str
    machines: tuple[str, ...]
    reason: str
    commands: tuple[tuple[str, ...], ...] = ()
    steps: tuple[str, ...] = ()
    standbys: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class EvictionOutcome:
    ok: bool
    machines: tuple[str, ...]
    message: str
    runs: tuple[CommandRun, ...] = ()
    replacements: tuple[str, ...] = ()


class EvictionBackend(ABC):
    """Takes machines out of the job and gets it running again without them."""

    name: str = ""

    @abstractmethod
    def plan(self, machines: Sequence[str], reason: str) -> EvictionPlan:
        """What :meth:`evict` would do, without doing any of it."""

    def evict(self, machines: Sequence[str], reason: str) -> EvictionOutcome:
        """Run the plan's commands in order; stop at the first that fails (the rest depend on it)."""
        plan = self.plan(machines, reason)
        runs: list[CommandRun] = []
        for argv in plan.commands:
            run = self._run(argv)
            runs.append(run)
            if run.returncode != 0:
                detail = (run.stderr.strip() or run.stdout.strip() or f"exit status {run.returncode}")
                return EvictionOutcome(False, plan.machines, f"{argv[0]} failed: {detail.splitlines()[-1]}",
                                       tuple(runs))
        return EvictionOutcome(True, plan.machines, self._success_message(plan), tuple(runs))

    def _run(self, argv: Sequence[str]) -> CommandRun:
        return run_argv(argv)

    def _success_message(self, plan: EvictionPlan) -> str:
        return f"evicted {' '.join(plan.machines)} via {self.name}"

    def joined(self, together: Sequence[str]) -> EvictionBackend:
        """This backend for an eviction that also takes ``together`` (other agents' machines) out.

        Most backends act per machine and ignore them; one that restarts the
        whole job must take them out in the same step (see SlurmBackend).
        """
        return self


def _checked(machines: Sequence[str], reason: str) -> tuple[tuple[str, ...], str]:
    if not machines:
        raise RankscopeError("nothing to evict", "name the suspect group's machines")
    names = tuple(dict.fromkeys(check_machine(m) for m in machines))
    return names, check_text(reason, "eviction reason")


class _CommandBackend(EvictionBackend):
    def __init__(self, runner: Runner | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self._runner = runner
        self._timeout_s = timeout_s

    def _run(self, argv: Sequence[str]) -> CommandRun:
        return (self._runner or run_argv)(argv, self._timeout_s)


class SlurmBackend(_CommandBackend):
    """Drain the machines with the reason, then requeue the job without them (or cancel the step to relaunch it).

    ``restart="requeue"`` (the default) plans, from the job as Slurm reports it
    (``scontrol show job -o``) and the idle standbys (``sinfo``)::

        scontrol update nodename=<m1,m2> state=drain reason=<reason>
        scontrol requeue <job>
        scontrol update jobid=<job> ExcNodeList=<m1,m2>            # enough standbys: same size
        scontrol update jobid=<job> NumNodes=<n> NumTasks=<t> ExcNodeList=<m1,m2>   # too few: shrink

    The job restarts (its batch script runs again, ``SLURM_RESTART_COUNT``
    one higher) on its remaining nodes plus idle standbys: the idle nodes of
    ``standby_partition``, or of the reservation ``standby_reservation``.
    A job runs in one partition, so the standbys must also belong to the
    job's partition (a "spares" partition is usually a subset of it), and a
    reservation must be one the job may use. Drained nodes are never allocated
    again. A shrunk job's script must size itself from ``$SLURM_JOB_NUM_NODES``.
    """

    name = "slurm"
    RESTARTS = ("requeue", "step", "none")
    # A job another agent already requeued: pending again, or still completing its old run.
    PENDING = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "COMPLETING"})

    def __init__(self, job_id: str, restart: str = "requeue", step_id: str | None = None, scontrol: str = "scontrol",
                 scancel: str = "scancel", sinfo: str = "sinfo", standby_partition: str | None = None,
                 standby_reservation: str | None = None, runner: Runner | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__(runner, timeout_s)
        if restart not in self.RESTARTS:
            raise RankscopeError(f"unknown slurm restart {restart!r}", f"use one of {', '.join(self.RESTARTS)}")
        if restart == "step" and not step_id:
            raise RankscopeError("restart 'step' needs the step id", "pass the job step to cancel, e.g. 0")
        self.job_id = check_machine(job_id)
        self.restart = restart
        self.step_id = check_machine(step_id) if step_id else None
        self.scontrol = scontrol
        self.scancel = scancel
        self.sinfo = sinfo
        self.standby_partition = check_machine(standby_partition) if standby_partition else None
        self.standby_reservation = check_machine(standby_reservation) if standby_reservation else None
        self.together: tuple[str, ...] = ()  # see joined()

    # ---- what Slurm says ---------------------------------------------------------

    def _ask(self, *argv: str) -> str:
        run = self._run(argv)
        if run.returncode != 0:
            words = (run.stderr.strip() or run.stdout.strip() or f"exit status {run.returncode}").splitlines()[-1]
            raise RankscopeError(f"`{' '.join(argv)}` failed: {words}",
                                 "check that the agent's node can reach slurmctld (scontrol ping) and the job exists")
        return run.stdout

    def _hostnames(self, hostlist: str) -> tuple[str, ...]:
        if not hostlist or hostlist in ("(null)", "None"):
            return ()
        return tuple(w for w in self._ask(self.scontrol, "show", "hostnames", hostlist).split() if w)

    def job(self) -> dict[str, str]:
        from rankscope.formats.slurm_fields import parse_fields

        return parse_fields(self._ask(self.scontrol, "show", "job", "-o", self.job_id).strip())

    def _reserved(self) -> tuple[str, ...]:
        from rankscope.formats.slurm_fields import parse_fields

        if not self.standby_reservation:
            return ()
        fields = parse_fields(self._ask(self.scontrol, "show", "reservation", "-o", self.standby_reservation))
        return self._hostnames(fields.get("Nodes", ""))

    def standbys(self) -> tuple[str, ...]:
        """Idle nodes of the standby partition or reservation, in Slurm's order."""
        if self.standby_reservation:
            members = self._reserved()
            if not members:
                return ()
            idle = self._ask(self.sinfo, "-h", "-N", "-t", "idle", "-n", ",".join(members), "-o", "%N").split()
            return tuple(n for n in members if n in idle)
        if self.standby_partition:
            out = self._ask(self.sinfo, "-h", "-N", "-t", "idle", "-p", self.standby_partition, "-o", "%N")
            return tuple(dict.fromkeys(out.split()))
        return ()

    # ---- the plan ----------------------------------------------------------------

    def joined(self, together: Sequence[str]) -> SlurmBackend:
        """A requeue ends every step of the job, the other nodes' agents included, possibly before they
        drained their nodes: so each agent drains and excludes the action's other nodes too (the first
        to run does it all; draining twice is harmless)."""
        other = copy.copy(self)
        other.together = tuple(dict.fromkeys(check_machine(m) for m in together))
        return other

    def plan(self, machines: Sequence[str], reason: str) -> EvictionPlan:
        names, reason = _checked(machines, reason)
        together: tuple[str, ...] = ()
        job: dict[str, str] = {}
        nodes: tuple[str, ...] = ()
        if self.restart == "requeue":
            job = self.job()
            nodes = self._hostnames(job.get("NodeList", ""))
            outside = [m for m in names if m not in nodes]
            if outside:
                raise RankscopeError(f"{' '.join(outside)} are not nodes of job {self.job_id} "
                                     f"(it runs on {' '.join(nodes) or 'no nodes'})",
                                     "evict only the job's own nodes")
            # The action's other nodes that are this job's: their agents would be ended by our requeue.
            together = tuple(m for m in self.together if m in nodes and m not in names)
        drained = (*names, *together)
        joined = ",".join(drained)
        commands: list[tuple[str, ...]] = [
            (self.scontrol, "update", f"nodename={joined}", "state=drain", f"reason={reason}"),
        ]
        steps = [f"drain {' '.join(drained)} with reason {reason!r} (Slurm allocates them to no job until resumed)"
                 + (f"; {' '.join(together)} {'is' if len(together) == 1 else 'are'} evicted in the same action, "
                    "and the requeue would end their agents before they act" if together else "")]
        chosen: tuple[str, ...] = ()
        warnings: list[str] = []
        if self.restart == "requeue":
            names_all = drained
            num_nodes = len(nodes)
            num_tasks = _leading_int(job.get("NumTasks", "")) or num_nodes
            remaining = tuple(n for n in nodes if n not in names_all)
            chosen = tuple(n for n in self.standbys() if n not in nodes)[:len(names_all)]
            size = len(remaining) + len(chosen)
            if size == 0:
                raise RankscopeError(f"evicting {' '.join(names_all)} leaves job {self.job_id} no node to run on",
                                     "name a standby partition or reservation with idle nodes, or evict fewer nodes")
            if self.standby_reservation and chosen:
                # A job may not use reserved nodes: the chosen standbys leave the reservation first.
                rest = [n for n in self._reserved() if n not in chosen]
                commands.append((self.scontrol, "update", f"reservationname={self.standby_reservation}",
                                 f"nodes={','.join(rest)}") if rest else
                                (self.scontrol, "delete", f"reservationname={self.standby_reservation}"))
                steps.append(f"take {' '.join(chosen)} out of reservation {self.standby_reservation} "
                             "so the job may run there")
            commands.append((self.scontrol, "requeue", self.job_id))
            steps.append(f"requeue job {self.job_id}: its steps end and it waits to start again")
            # Keep what the job already excluded.
            excluded = ",".join(dict.fromkeys((*self._hostnames(job.get("ExcNodeList", "")), *names_all)))
            update: tuple[str, ...] = (self.scontrol, "update", f"jobid={self.job_id}")
            if size < num_nodes:
                tasks = max(1, num_tasks // num_nodes) * size
                commands.append((*update, f"NumNodes={size}", f"NumTasks={tasks}", f"ExcNodeList={excluded}"))
                warnings.append(f"only {len(chosen)} idle standby node(s) for {len(names_all)} evicted: job "
                                f"{self.job_id} shrinks from {num_nodes} to {size} nodes; its script must size "
                                "itself from $SLURM_JOB_NUM_NODES")
            else:
                commands.append((*update, f"ExcNodeList={excluded}"))
            steps.append(f"restart on {' '.join((*remaining, *chosen))}"
                         + (f" (standbys {' '.join(chosen)})" if chosen else "")
                         + "; ranks resume from the latest checkpoint")
        elif self.restart == "step":
            commands.append((self.scancel, f"{self.job_id}.{self.step_id}"))
            steps.append(f"cancel step {self.job_id}.{self.step_id}; the batch script relaunches it")
        return EvictionPlan(self.name, names, reason, tuple(commands), tuple(steps), standbys=chosen,
                            warnings=tuple(warnings))

    def evict(self, machines: Sequence[str], reason: str) -> EvictionOutcome:
        """The plan's commands in order; a requeue another agent already did counts as done.

        Evicting several nodes, each node's agent drains its node and requeues
        the job; the first requeue ends the job's steps, the other agents'
        included, so their own requeue is refused ("pending execution") or
        their command is killed by a signal. After a successful drain that is
        not a failure when Slurm shows the job requeued.
        """
        try:
            plan = self.plan(machines, reason)
        except RankscopeError:
            # Planning again asks Slurm about the job, and that query is a child of this step: another node's
            # agent's requeue ends it with a signal. Our nodes drained and the job requeued is the outcome asked.
            names = _checked(machines, reason)[0]
            if self.restart == "requeue" and self._drained(names) and self._requeue_under_way():
                return EvictionOutcome(True, names, f"drained {' '.join(names)}; job {self.job_id} was already "
                                       "requeued (by another node's agent)", ())
            raise
        runs: list[CommandRun] = []
        for index, argv in enumerate(plan.commands):
            run = self._run(argv)
            runs.append(run)
            # Slurm refuses a second requeue with "Job is pending execution" while the first is under way
            # (the job may still read RUNNING until its steps end); a command killed by a signal was ended by
            # that requeue -- our drain too, when an agent drained our nodes with its own.
            refused = index > 0 and "pending execution" in run.stderr.lower()
            killed = run.returncode < 0 and (index > 0 or self._drained(plan.machines)) and self._requeue_under_way()
            if run.returncode != 0 and self.restart == "requeue" and (refused or killed):
                return EvictionOutcome(True, plan.machines,
                                       f"drained {' '.join(plan.machines)}; job {self.job_id} was already requeued "
                                       "(by another node's agent)", tuple(runs), plan.standbys)
            if run.returncode != 0:
                detail = (run.stderr.strip() or run.stdout.strip() or f"exit status {run.returncode}")
                return EvictionOutcome(False, plan.machines, f"{argv[0]} failed: {detail.splitlines()[-1]}",
                                       tuple(runs))
        return EvictionOutcome(True, plan.machines, self._success_message(plan), tuple(runs), plan.standbys)

    def _drained(self, machines: Sequence[str]) -> bool:
        try:
            out = self._ask(self.sinfo, "-h", "-N", "-n", ",".join(machines), "-o", "%N %T")
        except RankscopeError:
            return False
        states = dict(line.split(None, 1) for line in out.splitlines() if len(line.split()) == 2)
        return bool(machines) and all(states.get(m, "").startswith("drain") for m in machines)

    def _requeue_under_way(self) -> bool:
        """The job is requeued, or still ending its run for a requeue (not cancelled, failed or done)."""
        try:
            job = self.job()
        except RankscopeError:
            return False
        return job.get("JobState", "") in self.PENDING or job.get("JobState", "") == "RUNNING"

    def _success_message(self, plan: EvictionPlan) -> str:
        if self.restart == "requeue":
            return (f"drained {' '.join(plan.machines)} and requeued job {self.job_id}"
                    + (f" with standbys {' '.join(plan.standbys)}" if plan.standbys else ""))
        return super()._success_message(plan)


def _leading_int(text: str) -> int:
    digits = ""
    for ch in text:
        if not ch.isdigit():
            break
        digits += ch
    return int(digits) if digits else 0


class KubernetesBackend(_CommandBackend):
    """Cordon each node, note the reason on it, and delete the job's pods there."""

    name = "kubernetes"
    REASON_ANNOTATION = "rankscope.io/evict-reason"

    def __init__(self, namespace: str, selector: str, kubectl: str = "kubectl", context: str | None = None,
                 runner: Runner | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__(runner, timeout_s)
        self.namespace = check_machine(namespace)
        self.selector = check_text(selector, "pod label selector")
        if self.selector.startswith("-"):
            raise RankscopeError(f"bad pod selector {selector!r}", "give a label selector such as job-name=train")
        self.kubectl = kubectl
        self.context = check_machine(context) if context else None

    def _base(self) -> tuple[str, ...]:
        return (self.kubectl, f"--context={self.context}") if self.context else (self.kubectl,)

    def plan(self, machines: Sequence[str], reason: str) -> EvictionPlan:
        names, reason = _checked(machines, reason)
        commands: list[tuple[str, ...]] = []
        steps: list[str] = []
        for node in names:
            commands.append((*self._base(), "cordon", node))
            commands.append((*self._base(), "annotate", "node", node, "--overwrite",
                             f"{self.REASON_ANNOTATION}={reason}"))
        for node in names:
            commands.append((*self._base(), "delete", "pods", "--namespace", self.namespace,
                             "--selector", self.selector, "--field-selector", f"spec.nodeName={node}",
                             "--wait=false"))
        steps.append(f"cordon {' '.join(names)} and record the reason on each node")
        steps.append(f"delete the pods matching {self.selector} in {self.namespace} on those nodes; "
                     "the job's controller recreates them elsewhere")
        return EvictionPlan(self.name, names, reason, tuple(commands), tuple(steps))


class SiteCommandBackend(_CommandBackend):
    """A site's own script, under the argument contract in the module docstring."""

    name = "command"

    def __init__(self, script: str, job_id: str = "", runner: Runner | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__(runner, timeout_s)
        self.script = script
        self.job_id = check_machine(job_id) if job_id else ""

    def plan(self, machines: Sequence[str], reason: str) -> EvictionPlan:
        names, reason = _checked(machines, reason)
        argv: list[str] = [self.script, "evict"]
        if self.job_id:
            argv += ["--job", self.job_id]
        argv += ["--reason", reason]
        for m in names:
            argv += ["--machine", m]
        return EvictionPlan(self.name, names, reason, (tuple(argv),), (f"run the site script {self.script}",))

    def evict(self, machines: Sequence[str], reason: str) -> EvictionOutcome:
        plan = self.plan(machines, reason)
        run = self._run(plan.commands[0])
        reply: dict[str, object] = {}
        if run.stdout.strip():
            try:
                parsed = json.loads(run.stdout)
            except json.JSONDecodeError:
                parsed = None
            if not isinstance(parsed, dict):
                return EvictionOutcome(
                    False, plan.machines,
                    f"{self.script} exited {run.returncode} but did not print one JSON object; "
                    "what it did is unknown: check the machines by hand", (run,))
            reply = parsed
        ok = run.returncode == 0 and reply.get("ok", True) is True
        message = str(reply.get("message") or (
            f"evicted {' '.join(plan.machines)} via {self.script}" if ok
            else f"{self.script} failed: {(run.stderr.strip() or f'exit status {run.returncode}').splitlines()[-1]}"))
        raw = reply.get("replacements", [])
        replacements = tuple(str(m) for m in raw) if isinstance(raw, list) else ()
        return EvictionOutcome(ok, plan.machines, message, (run,), replacements)


# ---- local (the drill) --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SelfCheck:
    """A standby's check before joining: CPU and memory, GPUs via NVML when present, a loopback collective."""

    machine: str
    ok: bool
    checks: tuple[tuple[str, bool, str], ...] = field(default=())  # (name, passed, detail)

    def failed(self) -> tuple[str, ...]:
        return tuple(f"{name}: {detail}" for name, passed, detail in self.checks if not passed)


class DrillControl(Protocol):
    """What the local backend needs from the drill (implemented by the drill, later).

    Machines are the drill's local "machines": one torchrun node and one
    agent each. Every method blocks until done or raises RankscopeError.
    """

    def machines(self) -> tuple[str, ...]:
        """Machines now running the job."""
        ...

    def standbys(self) -> tuple[str, ...]:
        """Idle warm standby machines, in the order they should be used."""
        ...

    def stop(self, machine: str) -> None:
        """Stop every rank (and the torchrun node) on ``machine``."""
        ...

    def self_check(self, machine: str) -> SelfCheck:
        """Check a standby before it joins."""
        ...

    def restart(self, machines: tuple[str, ...]) -> None:
        """Restart the job on exactly ``machines``; ranks resume from the latest checkpoint."""
        ...


class LocalBackend(EvictionBackend):
    """The drill's eviction: stop, self-check standbys, restart on the remaining machines plus standbys."""

    name = "local"

    def __init__(self, control: DrillControl, blocked: Callable[[], frozenset[str]] = lambda: frozenset()) -> None:
        self.control = control
        self._blocked = blocked

    def plan(self, machines: Sequence[str], reason: str) -> EvictionPlan:
        names, reason = _checked(machines, reason)
        running = self.control.machines()
        unknown = [m for m in names if m not in running]
        if unknown:
            raise RankscopeError(f"{' '.join(unknown)} do not run this job",
                                 f"evict only running machines: {' '.join(running)}")
        blocked = self._blocked()
        candidates = tuple(s for s in self.control.standbys() if s not in blocked)
        chosen = candidates[:len(names)]
        warnings: tuple[str, ...] = ()
        if len(chosen) < len(names):
            warnings = (f"only {len(chosen)} warm standby(s) for {len(names)} evicted machine(s): "
                        "the job cannot restart at its size until the pool is replenished",)
        remaining = tuple(m for m in running if m not in names)
        steps = (f"stop the ranks on {' '.join(names)}",
                 f"self-check standbys {' '.join(chosen) or '(none)'}",
                 f"restart on {' '.join(remaining + chosen)}; ranks resume from the latest checkpoint")
        return EvictionPlan(self.name, names, reason, (), steps, standbys=chosen, warnings=warnings)

    def evict(self, machines: Sequence[str], reason: str) -> EvictionOutcome:
        plan = self.plan(machines, reason)
        # Each stop waits for its machine's processes to end: machines stopped side by side, not one after another.
        with ThreadPoolExecutor(max_workers=max(1, len(plan.machines)), thread_name_prefix="evict-stop") as pool:
            list(pool.map(self.control.stop, plan.machines))
        passed: list[str] = []
        rejected: list[str] = []
        blocked = self._blocked()
        # A standby that fails its check is skipped and the next one tried, until enough passed.
        for standby in (s for s in self.control.standbys() if s not in blocked):
            if len(passed) == len(plan.machines):
                break
            check = self.control.self_check(standby)
            if check.ok:
                passed.append(standby)
            else:
                rejected.append(f"{standby} ({'; '.join(check.failed()) or 'failed'})")
        if len(passed) < len(plan.machines):
            return EvictionOutcome(
                False, plan.machines,
                f"stopped {' '.join(plan.machines)} but only {len(passed)} of {len(plan.machines)} standbys passed "
                f"their self-check{': rejected ' + ', '.join(rejected) if rejected else ''}; the job is stopped "
                "until more standbys are ready", replacements=tuple(passed))
        remaining = tuple(m for m in self.control.machines() if m not in plan.machines)
        self.control.restart(remaining + tuple(passed))
        note = f" (rejected {', '.join(rejected)})" if rejected else ""
        return EvictionOutcome(True, plan.machines,
                               f"evicted {' '.join(plan.machines)}; restarted with standbys {' '.join(passed)}{note}",
                               replacements=tuple(passed))


BACKENDS: tuple[str, ...] = ("local", "slurm", "kubernetes", "command")
