"""The node agent: one gRPC server per machine, answering for its ranks.

The agent is the only part of rankscope that touches a machine's processes.
It finds the ranks, captures their stacks and reads metrics and counters
through ``rankscope.probes`` and ships them as snapshots (converted in
``rankscope.wire.snapshot_codec``). It never runs anything a client sends: every
call names a fixed procedure.

Safe by default:
- it listens on 127.0.0.1 unless ``--bind`` names another address, and
  off loopback it serves TLS (``--tls-cert/--tls-key``, mutual TLS with
  ``--tls-client-ca``) or refuses to start unless ``--insecure`` says so;
- every call except the standard health check needs a bearer token, checked
  in one interceptor before any handler runs (``rankscope.wire.access``: each
  method names the role it needs, an unlisted one needs ``act``).

Limits hold before the token is checked: the size of a request, the calls in
flight, the connections and the handshake's time are bounded, and every number
a request carries is checked for range and finiteness before use
(``rankscope.wire.limits``). An agent started with ``--lease`` stops when no
client has called for that long (``rankscope.wire.lease``); its machine name is
made in ``rankscope.wire.identity``.

Stack captures are serialised: two engineers pressing "capture" at once must
not make two py-spy processes ptrace the same rank (the second attach fails).

Actions (PlanAction, RunAction, WatchAudit) are served when the agent was
configured with them (``--state-dir`` / ``--actions-config``) and carried out
by ``rankscope.actions.agent_service`` (plans from ``rankscope.actions.planning``,
procedures in ``rankscope.actions.procedures``). Planning and watching the audit
log need the ``read`` role; RunAction is not in ``METHOD_ROLES`` and so needs
``act``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from rankscope.actions.agent_protocol import AUDIT_OPEN, FIX_SEPARATOR
from rankscope.actions.agent_service import SUPERVISE_INTERVAL_S, ActionService
from rankscope.actions.config import ActionsConfig
from rankscope.actions.journal import journal_service
from rankscope.contract.errors import RankscopeError
from rankscope.contract.snapshot import MachineSnapshot, RankInfo
from rankscope.wire.access import SERVICE, TokenInterceptor, caller_of
from rankscope.wire.action_messages import (
    audit_to_proto,
    confirmation_from_proto,
    event_to_proto,
    plan_to_proto,
    request_from_proto,
)
from rankscope.wire.delta import ReadingVersions
from rankscope.wire.gate import Gate
from rankscope.wire.identity import container_id, machine_identity
from rankscope.wire.lease import Lease, lease_expired
from rankscope.wire.limits import (
    CALL_WAIT_S,
    DEFAULT_PYSPY_TIMEOUT_S,
    MAX_CONCURRENT_RPCS,
    MAX_PYSPY_TIMEOUT_S,
    MAX_SAMPLE_HZ,
    checked_number,
    connection_limit,
    raise_descriptor_limit,
    refused_waiting_limit,
    server_options,
)
from rankscope.wire.merge import Behind, fold
from rankscope.wire.proto import rankscope_pb2 as pb
from rankscope.wire.proto import rankscope_pb2_grpc as pb_grpc
from rankscope.wire.rank_progress import ProgressTracker
from rankscope.wire.snapshot_codec import machine_to_proto
from rankscope.wire.tls import ClientTLS, ServerTLS, server_credentials
from rankscope.wire.tokens import MAKE_TOKEN, TokenSet

if TYPE_CHECKING:
    from rankscope.wire.fanout import Call, CallFor

DEFAULT_PORT = 50051
BIND_RETRY_S = 10.0  # a fixed port still held by a predecessor's closing connections is tried this long
STOP_TIMEOUT_S = 5.0  # SIGTERM: what is still running after this is left behind and the process exits
ANNOUNCE_PREFIX = "RANKSCOPE_AGENT_READY"
# The agent reads its ranks at least this often on its own, so a client that attaches later finds its memory
# current (rankscope.wire.rank_progress): new pids, when ranks were last seen. Progress itself carries the
# plugin's own timestamps, so this need not be frequent; a client's polls count as readings.
WATCH_INTERVAL_S = 10.0
BIND_FIX = ("another process (an agent?) may hold the port: pick another --port, or --port 0 for a free one; "
            "or --bind names an address this machine does not have (see `ip addr`)")


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """How one agent runs; ``rankscope agent``'s options map onto these fields."""

    tokens: TokenSet | None
    bind: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    machine_name: str = field(default_factory=socket.gethostname)
    launcher_pid: int | None = None
    run_id: str | None = None
    counter_dir: Path | None = None
    insecure_no_token: bool = False
    capture_concurrency: int = 8
    actions: ActionsConfig | None = None  # None: this agent plans and runs no actions
    tls: ServerTLS | None = None  # None: plaintext (loopback, or off loopback with ``insecure``)
    insecure: bool = False  # serve plaintext beyond loopback: only when a person said so explicitly
    slurm_job: str | None = None  # only ranks of this Slurm job (SLURM_JOB_ID)...
    slurm_node: str | None = None  # ...on this Slurm node (SLURMD_NODENAME)
    auto_name: bool = False  # True: machine_name is replaced at start by machine_identity (no --machine-name)
    # Relaying (a two-level tree at scale): every Describe/Capture is also forwarded to these agents and their
    # replies travel inside this one's, so a client talks to a few hundred relays instead of thousands of agents.
    relay_to: tuple[str, ...] = ()
    relay_token: str | None = None  # the token this agent presents to the agents it relays to
    relay_tls: ClientTLS | None = None  # how it reaches them; None: plaintext
    # > 0: the agent stops by itself when no call with an accepted token came for this long (its client is
    # gone: killed, or its machine lost). ``rankscope.wire.lease.KeepAlive`` renews it while a client lives.
    lease_s: float = 0.0
    # Whose processes may be ranks (``--job-user``); empty: the agent's own user, or for a root agent root and the
    # user of a rank's launcher (rankscope.probes.discovery). Claiming torchrun's variables makes no rank.
    job_users: frozenset[int] = frozenset()


# What an agent reads its machine with; the probes by default. Called with stacks=True for a capture.
Source = Callable[[bool], Awaitable[MachineSnapshot]]
# A relay leaves its children this much of the caller's deadline to answer in, to send the merged reply back.
RELAY_MARGIN_S = 1.0


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_config(config: AgentConfig) -> None:
    """Refuse unsafe or impossible setups before anything listens."""
    if config.tokens is None and not config.insecure_no_token:
        raise RankscopeError(
            "no token configured: the agent refuses to serve without one",
            f"make a token file and pass it with --token-file (or set RANKSCOPE_TOKEN): {MAKE_TOKEN}",
        )
    if config.tokens is None and not is_loopback(config.bind):
        raise RankscopeError(
            f"--insecure-no-token is only allowed on a loopback address, not {config.bind}",
            "use --token-file, or drop --bind so the agent listens on 127.0.0.1",
        )
    if config.tls is None and not config.insecure and not is_loopback(config.bind):
        raise RankscopeError(
            f"refusing to listen on {config.bind} without TLS: the token and the snapshots would cross the network "
            "in plaintext",
            "give --tls-cert and --tls-key (and clients --tls-ca); or, on a trusted network only, add --insecure",
        )
    if not 0 <= config.port < 65536:
        raise RankscopeError(f"--port {config.port} is not a port number", "use 1-65535, or 0 to pick a free port")


# --------------------------------------------------------------------------
# the service
# --------------------------------------------------------------------------


class AgentService(pb_grpc.RankscopeAgentServicer):  # type: ignore[misc]
    """The RPCs; each one is a capture of this machine with fixed options."""

    def __init__(self, config: AgentConfig, address: str, source: Source | None = None) -> None:
        self.config = config
        self.address = address
        self.source = source
        self.relay: Any = None  # a rankscope.wire.client.JobClient over config.relay_to
        if config.relay_to:
            from rankscope.wire.client import JobClient

            self.relay = JobClient(config.relay_to, config.relay_token, tls=config.relay_tls)
        self.behind: Behind = {}  # the machines last heard behind each agent relayed to (rankscope.wire.merge)
        self._stack_lock = asyncio.Lock()
        self._sampler: Any = None  # a probes.sampler.StackSampler, made on the first request to sample
        self.progress = ProgressTracker()
        self.versions = ReadingVersions()
        self.last_reading_mono = 0.0
        self.actions: ActionService | None = None
        if config.actions is not None:
            self.actions = ActionService(config.actions, config.machine_name, self.ranks)

    def ranks(self) -> tuple[RankInfo, ...]:
        """This machine's ranks, in the agent's scope (blocking: discovery scans /proc)."""
        from rankscope.probes.discovery import discover_ranks

        return discover_ranks(launcher_pid=self.config.launcher_pid, run_id=self.config.run_id,
                              slurm_job=self.config.slurm_job, slurm_node=self.config.slurm_node,
                              users=self.config.job_users or None)

    async def capture(
        self, *, stacks: bool, native: bool = False, subprocesses: bool = True, timeout_s: float = DEFAULT_PYSPY_TIMEOUT_S,
        sample_hz: float = 0.0,
    ) -> MachineSnapshot:
        """One reading of this machine through the probes (imported here: only the agent needs them).

        ``sample_hz`` > 0 renews the stack sampler's lease on this machine's
        ranks (a Describe or a Capture: a watching client's stack rounds keep
        the lease as its polls do); while the sampler runs, every reply
        carries its windows.
        """
        if self.source is not None:
            reading = await self.source(stacks)
            self.last_reading_mono = time.monotonic()
            return self.progress.observe(reading)
        from rankscope.probes.machine import CaptureOptions, Scope, capture_machine

        scope = Scope(launcher_pid=self.config.launcher_pid, run_id=self.config.run_id, counter_dir=self.config.counter_dir,
                      slurm_job=self.config.slurm_job, slurm_node=self.config.slurm_node,
                      users=self.config.job_users or None)
        options = CaptureOptions(
            stacks=stacks, native=native, subprocesses=subprocesses, timeout_s=timeout_s,
            concurrency=self.config.capture_concurrency,
        )

        def sample(ranks: tuple[RankInfo, ...]) -> None:
            # Demanded as soon as the ranks are known, before a capture's py-spy dumps: those can take longer
            # than the lease on a loaded machine, and a client that samples must not see its sampling lapse
            # (or start only after the dumps) while it waits for its reply.
            if self._sampler is None:
                from rankscope.probes.sampler import StackSampler

                self._sampler = StackSampler()
            self._sampler.demand(ranks, sample_hz)

        reading = await capture_machine(self.config.machine_name, self.address, scope, options,
                                        found=sample if sample_hz > 0 else None)
        self.last_reading_mono = time.monotonic()
        machine = self.progress.observe(reading)
        if self._sampler is not None:
            machine = dataclasses.replace(machine, samples=self._sampler.windows())
        return machine

    async def close(self) -> None:
        if self._sampler is not None:
            await self._sampler.close()
        if self.relay is not None:
            await self.relay.close()

    async def watch(self, interval_s: float = WATCH_INTERVAL_S) -> None:
        """Read the ranks whenever no client did for ``interval_s``, so the progress memory stays current."""
        while True:
            idle = time.monotonic() - self.last_reading_mono
            # Not while a capture runs: its py-spy calls hold the worker threads, and it is a reading itself.
            if idle >= interval_s and not self._stack_lock.locked():
                try:
                    await self.capture(stacks=False)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the next reading tries again; clients' calls report their own failures
                    log(f"background reading failed: {type(exc).__name__}: {exc}")
                idle = 0.0
            await asyncio.sleep(max(0.05, interval_s - idle))

    async def _reply(self, context: grpc.aio.ServicerContext, reading: Awaitable[MachineSnapshot],
                     forward: CallFor | None = None,
                     since: int | None = None, merge: bool = False) -> pb.MachineSnapshot:
        """``forward(address)``: the call a relay makes to the agent at ``address``; ``merge``: fold the replies
        into one (``rankscope.wire.merge``) rather than forward each.

        ``since``: the version of this agent's reply the caller holds; the reply is then a delta against it.
        """
        try:
            if self.relay is None or forward is None:
                msg = machine_to_proto(await reading)
                self.versions.stamp(msg, since)
                return msg
            remaining = context.time_remaining()
            budget = max(0.5, remaining - RELAY_MARGIN_S) if remaining is not None else self.relay.deadline_s
            own, children = await asyncio.gather(reading, self.relay.forward(forward, budget))
            msg = machine_to_proto(own)
            self.versions.stamp(msg, since)
            if merge:
                msg.merged.CopyFrom(fold(children, self.behind))
            else:
                msg.relayed.extend(children)
            return msg
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the probes should mark failures in place; anything else is our bug
            log(f"capture failed: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            await context.abort(grpc.StatusCode.INTERNAL, f"the agent's capture failed: {type(exc).__name__}: {exc}")
            raise  # unreachable: abort raises

    @staticmethod
    async def _number(context: grpc.aio.ServicerContext, value: float, name: str, low: float, high: float) -> float:
        try:
            return checked_number(value, name, low, high)
        except RankscopeError as exc:
            await AgentService._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, exc)
            raise  # unreachable: abort raises

    async def Describe(self, request: pb.DescribeRequest, context: grpc.aio.ServicerContext) -> pb.MachineSnapshot:
        sample_hz = await self._number(context, request.sample_hz, "sample_hz", 0.0, MAX_SAMPLE_HZ)
        return await self._reply(context, self.capture(stacks=False, sample_hz=sample_hz),
                                 _relaying(request, "Describe"), _since(request), request.merge)

    async def Capture(self, request: pb.CaptureRequest, context: grpc.aio.ServicerContext) -> pb.MachineSnapshot:
        sample_hz = await self._number(context, request.sample_hz, "sample_hz", 0.0, MAX_SAMPLE_HZ)
        timeout_s = await self._number(context, request.timeout_s, "timeout_s", 0.0, 1e9)
        timeout_s = min(timeout_s if timeout_s > 0 else DEFAULT_PYSPY_TIMEOUT_S, MAX_PYSPY_TIMEOUT_S)
        async with self._stack_lock:
            return await self._reply(
                context,
                self.capture(stacks=True, native=request.native, subprocesses=request.subprocesses, timeout_s=timeout_s,
                             sample_hz=sample_hz),
                _relaying(request, "Capture"), _since(request), request.merge,
            )

    # ---- actions ------------------------------------------------------------------

    async def _actions(self, context: grpc.aio.ServicerContext) -> ActionService:
        if self.actions is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the agent on {self.config.machine_name} has no actions configured"
                f"{FIX_SEPARATOR}start it with --state-dir DIR (and --actions-config FILE for the procedures)",
            )
        assert self.actions is not None
        return self.actions

    def _caller(self, context: grpc.aio.ServicerContext) -> str:
        return caller_of(self.config.tokens, context.invocation_metadata())

    @staticmethod
    async def _refuse(context: grpc.aio.ServicerContext, code: grpc.StatusCode, exc: RankscopeError) -> None:
        await context.abort(code, f"{exc.message}{FIX_SEPARATOR}{exc.fix}" if exc.fix else exc.message)

    async def PlanAction(self, request: pb.ActionRequest, context: grpc.aio.ServicerContext) -> pb.ActionPlan:
        actions = await self._actions(context)
        try:
            decoded = request_from_proto(request)
        except RankscopeError as exc:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, exc)
            raise  # unreachable: abort raises
        decoded = dataclasses.replace(decoded, caller=self._caller(context))
        try:
            return plan_to_proto(await actions.plan(decoded))
        except RankscopeError as exc:
            await self._refuse(context, grpc.StatusCode.FAILED_PRECONDITION, exc)
            raise

    async def RunAction(
        self, request: pb.RunActionRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ActionEvent]:
        actions = await self._actions(context)
        try:
            decoded = request_from_proto(request.request)
            confirmation = confirmation_from_proto(request.confirmation)
        except RankscopeError as exc:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, exc)
            raise
        decoded = dataclasses.replace(decoded, caller=self._caller(context))
        async for event in actions.run(decoded, confirmation):
            yield event_to_proto(event)

    async def WatchAudit(
        self, request: pb.WatchAuditRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.AuditRecord]:
        actions = await self._actions(context)
        await context.send_initial_metadata((AUDIT_OPEN,))  # the client's lost note can go before any record
        after = request.after_seq if request.HasField("after_seq") else None
        async for record in actions.watch(after):
            yield audit_to_proto(record)


def _since(request: pb.DescribeRequest | pb.CaptureRequest) -> int | None:
    return request.since if request.HasField("since") else None


def _relaying(request: pb.DescribeRequest | pb.CaptureRequest, method: str) -> CallFor:
    """The call a relay forwards to the agent at an address: the client's request, with the version the client
    holds of that agent's reply (``relayed_since``) as its own ``since``, and the versions of the agents further
    down passed on, for an agent that relays in turn."""
    from rankscope.wire.fanout import versioned_call

    below = tuple(request.relayed_since.items())

    def forward_to(address: str) -> Call:
        return versioned_call(method, request, request.relayed_since.get(address), below)

    return forward_to


# --------------------------------------------------------------------------
# running it
# --------------------------------------------------------------------------


def log(message: str) -> None:
    print(f"rankscope agent: {message}", file=sys.stderr, flush=True)


@dataclass(slots=True)
class RunningAgent:
    """A started agent: its server, the port it got and its health servicer."""

    server: Any
    port: int
    address: str
    health: Any
    service: AgentService | None = None
    supervisor: asyncio.Task[None] | None = None  # applies a pending lazy hot-update when it is due
    watcher: asyncio.Task[None] | None = None  # keeps the ranks' progress memory current (AgentService.watch)
    lease: Lease | None = None  # set when the agent serves under a lease (AgentConfig.lease_s)
    gate: Gate | None = None  # admits the client connections (rankscope.wire.gate)

    async def stop(self, grace_s: float = 2.0) -> None:
        for task in (self.supervisor, self.watcher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.health.enter_graceful_shutdown()
        if self.gate is not None:
            await self.gate.stop_listening()
        await self.server.stop(grace_s)
        if self.gate is not None:
            await self.gate.close()
        if self.service is not None:
            await self.service.close()  # the sampling loops and their py-spy processes end with the agent
        if self.service is not None and self.service.actions is not None:
            await self.service.actions.close()  # a running action ends and is recorded, never cut half way


ServiceRegistrar = Callable[[Any], None]


async def start_agent(config: AgentConfig, *, extra_services: Sequence[ServiceRegistrar] = (),
                      source: Source | None = None) -> RunningAgent:
    """Check the config, bind and start serving; returns once the port is open.

    ``extra_services`` are called with the server before it starts, to add more
    handlers (``add_XServicer_to_server(servicer, server)``). They sit behind the
    same token check; a method not named in ``METHOD_ROLES`` needs the ``act`` role.
    ``source``: read the machine with this instead of the probes (benchmarks serve synthetic ranks).
    """
    check_config(config)
    # The probes and the sampler are imported before serving, not by the first call that needs them: on a loaded
    # machine their imports take seconds (4-5 s at load 70 on 2 cores), spent with the event loop blocked, and
    # that first call (a watch's first stack round) would miss its deadline.
    import rankscope.probes.machine
    import rankscope.probes.sampler  # noqa: F401
    from rankscope.probes.ccl_counters import ensure_directory

    # Made now, mode 0700, so no other local user can make the shared default first (the reader refuses one
    # that is theirs or that others can write).
    await asyncio.to_thread(ensure_directory, config.counter_dir)
    lease = Lease() if config.lease_s > 0 else None
    host = f"[{config.bind}]" if ":" in config.bind and not config.bind.startswith("[") else config.bind
    # An agent restarted on its fixed port (a drill's restart, a supervisor) may find its predecessor's connections
    # still closing: with SO_REUSEPORT off (a second agent must not share the port) the bind fails until they have.
    # So a fixed port is tried again for a while; a port another live process listens on still fails, later.
    deadline = time.monotonic() + (BIND_RETRY_S if config.port else 0.0)
    # Clients reach gRPC through the gate, which listens on the agent's address and passes each connection it
    # admits to the gRPC server's private Unix socket (rankscope.wire.gate says why).
    gate = Gate(connection_limit(len(config.relay_to)), call_wait_s=CALL_WAIT_S, inspect_calls=config.tls is None,
                waiting_max=refused_waiting_limit(len(config.relay_to)))
    while True:
        server = grpc.aio.server(
            interceptors=[TokenInterceptor(config.tokens, lease)],
            options=server_options(len(config.relay_to)),
            maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
        )
        problem = ""
        try:
            if config.tls is not None:
                inner = server.add_secure_port(gate.backend_target, server_credentials(config.tls))
            else:
                inner = server.add_insecure_port(gate.backend_target)
            if not inner:
                await gate.close()
                raise RankscopeError(f"cannot make the agent's private socket {gate.backend_path}",
                                     "check that the temporary directory ($TMPDIR) is writable")
            port = await gate.listen(config.bind, config.port)
        except OSError as exc:
            port, problem = 0, f" ({exc.strerror or exc})"
        if port:
            break
        await server.stop(None)
        if time.monotonic() >= deadline:
            await gate.close()
            raise RankscopeError(f"cannot listen on {host}:{config.port}{problem}", BIND_FIX)
        await asyncio.sleep(0.25)
    address = f"{host}:{port}"
    if config.auto_name:
        config = dataclasses.replace(config, machine_name=await asyncio.to_thread(_identity, config, port))
    service = AgentService(config, address, source)
    pb_grpc.add_RankscopeAgentServicer_to_server(service, server)  # type: ignore[no-untyped-call]
    if service.actions is not None:  # the incident journal, beside the audit log (rankscope.actions.journal)
        journal_service(service.actions.config.state_dir)(server)
    for register in extra_services:
        register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await server.start()
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    supervisor = asyncio.create_task(supervise(service.actions)) if service.actions is not None else None
    watcher = asyncio.create_task(service.watch())
    return RunningAgent(server=server, port=port, address=address, health=health_servicer, service=service,
                        supervisor=supervisor, watcher=watcher, lease=lease, gate=gate)


def _identity(config: AgentConfig, port: int) -> str:
    from rankscope.probes.discovery import discover_ranks

    try:
        cgroup = Path("/proc/self/cgroup").read_text()
    except OSError:
        cgroup = ""
    ranks = discover_ranks(launcher_pid=config.launcher_pid, run_id=config.run_id, users=config.job_users or None)
    return machine_identity(socket.gethostname(), ranks, container_id(cgroup), port)


async def supervise(actions: ActionService, interval_s: float = SUPERVISE_INTERVAL_S) -> None:
    """Every ``interval_s``: apply a pending lazy hot-update whose window expired or whose ranks died.

    A failed round is logged and the next one tried: the agent's other work
    must not end because one check did (the history and audit log say what
    happened to the update itself).
    """
    while True:
        try:
            await actions.supervise_once()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log(f"hot-update supervision failed: {type(exc).__name__}: {exc}")
        await asyncio.sleep(interval_s)


def write_port_file(path: Path, port: int) -> None:
    """Atomically, so a script polling for the file never reads half a number."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{port}\n", encoding="utf-8")
    os.replace(tmp, path)


def announcement(agent: RunningAgent, config: AgentConfig) -> str:
    """The line ``--announce`` prints on stdout once listening: how a launcher (``--slurm``) learns the address."""
    fields = {"machine": config.machine_name, "host": socket.gethostname(), "port": str(agent.port),
              "step": f"{os.environ.get('SLURM_JOB_ID', '')}.{os.environ.get('SLURM_STEP_ID', '')}".strip(".")}
    return ANNOUNCE_PREFIX + " " + " ".join(f"{k}={v}" for k, v in fields.items() if v)


async def serve(config: AgentConfig, *, port_file: Path | None = None, announce: bool = False) -> None:
    """Run until SIGTERM or SIGINT, then stop: cleanly when that takes under ``STOP_TIMEOUT_S``, else at once.

    A worker thread can be stuck where no timeout reaches (a read of a file that never answers, a py-spy
    attach), and Python waits for its worker threads at exit; the process then leaves without them, saying so.
    """
    raise_descriptor_limit()
    loop = asyncio.get_running_loop()
    # The agent's own worker pool (asyncio.to_thread uses it), so that stopping can wait for it with a bound.
    workers = ThreadPoolExecutor(thread_name_prefix="asyncio")
    loop.set_default_executor(workers)
    agent = await start_agent(config)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        if port_file is not None:
            write_port_file(port_file, agent.port)
        if announce:
            # One write for the whole line: srun interleaves its tasks' writes, and print() writes the text and
            # its newline separately when stdout is unbuffered.
            sys.stdout.write(announcement(agent, config) + "\n")
            sys.stdout.flush()
        auth = "token required" if config.tokens is not None else "NO TOKEN (--insecure-no-token)"
        name = agent.service.config.machine_name if agent.service is not None else config.machine_name
        transport = ("mutual TLS" if config.tls.client_ca_pem else "TLS") if config.tls is not None else "plaintext"
        log(f"listening on {agent.address} as machine {name!r}, {auth}, {transport}")
        actions = agent.service.actions if agent.service is not None else None
        if actions is not None:
            log(f"actions enabled (eviction: {actions.config.eviction.backend}; state in {actions.config.state_dir})")
            for action_id in actions.interrupted():
                log(f"warning: action {action_id} was started by an earlier run and never finished: "
                    "check this machine by hand")
        if not is_loopback(config.bind) and config.tls is None:
            log("warning: listening beyond loopback without TLS (--insecure); the token and snapshots cross the "
                "network unencrypted, so keep the agents' port on a trusted network")
        expiry = asyncio.create_task(lease_expired(agent.lease, config.lease_s)) if agent.lease is not None else None
        waiting = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait([t for t in (waiting, expiry) if t is not None],
                                     return_when=asyncio.FIRST_COMPLETED)
        for task in (waiting, expiry):
            if task is not None and task not in done:
                task.cancel()
        if expiry is not None and expiry in done:
            log(f"stopping: no client called for {config.lease_s:g} s (--lease); its client is gone")
        else:
            log("stopping")
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await stop_within(agent, workers, STOP_TIMEOUT_S)


async def stop_within(agent: RunningAgent, workers: ThreadPoolExecutor, timeout_s: float) -> None:
    """Stop the agent; whatever still runs after ``timeout_s`` (a stuck worker, an action) is left behind: the
    process exits at once (an action cut short is reported as interrupted at the next start)."""
    try:
        await asyncio.wait_for(agent.stop(), timeout_s)
        # asyncio.run and the interpreter's exit wait for the worker threads without a bound; one stuck in a
        # system call (a read that never answers, a py-spy attach) would hold the process for good.
        await asyncio.wait_for(_drained(workers), timeout_s)
    except TimeoutError:
        log(f"stopping took longer than {timeout_s:g} s (a worker is stuck, or an action runs); "
            "exiting without waiting for it")
        _exit_now()
    except Exception as exc:  # stopping must end the process whatever failed on the way
        log(f"stopping failed: {type(exc).__name__}: {exc}")
        _exit_now()


async def _drained(workers: ThreadPoolExecutor) -> None:
    """Returns once every worker thread has ended; the waiting happens in a daemon thread, so a caller that stops
    waiting (a timeout) leaves nothing behind that the process must wait for."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def finished() -> None:
        if not done.done():
            done.set_result(None)

    def shut_down() -> None:
        workers.shutdown(wait=True)
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            loop.call_soon_threadsafe(finished)

    threading.Thread(target=shut_down, name="rankscope-stop", daemon=True).start()
    await done


def _exit_now() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
