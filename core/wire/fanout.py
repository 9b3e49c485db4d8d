"""Ask every agent of a job at once: the fan-out that polls and captures.

Every call fans out to all agents concurrently, each call with its own deadline,
and always returns a whole ``JobSnapshot``: an agent that cannot be reached,
refuses the token, times out or fails becomes a ``MachineSnapshot`` with
``reachable=False`` and a ``CaptureError`` that says what happened and what to
do, never an exception for the whole call.

Channels are kept per agent and reused (the TUI polls every second); gRPC
reconnects a channel by itself, and the reconnect back-off is capped at a few
seconds so an agent that comes back is seen again quickly. Each reply is
decoded against what this client holds of its agent (``rankscope.wire.delta``).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import resource
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Self

import grpc
from rankscope.contract.heap import collector_paused
from rankscope.contract.snapshot import CaptureError, CaptureErrorKind, Instant, JobSnapshot, MachineSnapshot
from rankscope.wire.delta import HeldReadings
from rankscope.wire.merge import ranks_text
from rankscope.wire.proto import rankscope_pb2 as pb
from rankscope.wire.proto import rankscope_pb2_grpc as pb_grpc
from rankscope.wire.snapshot_codec import machine_to_proto
from rankscope.wire.tls import ClientTLS, channel_credentials, channel_options, handshake_problem

# Room for many ranks' stacks in one reply (gRPC's default is 4 MiB).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # gRPC's default back-off grows to two minutes; an agent restarted during an
    # incident must show up again within a couple of polls. (Not min_reconnect_backoff_ms:
    # gRPC also uses it as the connect timeout, and a slow handshake must still connect.)
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 3000),
    # By default every channel of a process to one address shares one connection (gRPC's global subchannel
    # pool), back-off included: a client opened just after an agent restarted (the action that follows a warm
    # restart, back in about a second) would fail at once with the old client's "connection refused".
    ("grpc.use_local_subchannel_pool", 1),
)
# A capture may take each py-spy call's full limit; the gRPC deadline leaves room for it.
CAPTURE_MARGIN_S = 2.0

# File descriptors this process keeps for everything but agent channels (logs, bundles, the TUI, gRPC's own).
RESERVED_FDS = 128

Call = Callable[[Any, Sequence[tuple[str, str]], float], Awaitable[pb.MachineSnapshot]]
CallFor = Callable[[str], Call]  # the call to make to the agent at an address

def versioned_call(method: str, request: pb.DescribeRequest | pb.CaptureRequest, since: int | None,
                   relayed_since: Sequence[tuple[str, int]] = ()) -> Call:
    """``method`` with ``request`` as a call, asking for what changed since reading ``since`` of the agent called
    (and ``relayed_since``: of each agent it relays for); no versions: the request as it is."""
    req = request
    if since is not None or relayed_since or request.HasField("since") or request.relayed_since:
        req = copy.deepcopy(request)
        req.ClearField("since")
        req.ClearField("relayed_since")
        if since is not None:
            req.since = since
        for child, version in relayed_since:
            req.relayed_since[child] = version

    def call(stub: Any, metadata: Sequence[tuple[str, str]], timeout: float) -> Awaitable[pb.MachineSnapshot]:
        return getattr(stub, method)(req, metadata=metadata, timeout=timeout)  # type: ignore[no-any-return]

    return call


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata carrying the bearer token (none when there is no token)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def unreachable(address: str, kind: CaptureErrorKind, message: str, fix: str) -> MachineSnapshot:
    """The stand-in for a machine whose agent gave no snapshot."""
    return MachineSnapshot(
        machine=address, address=address, reachable=False, captured=None,
        error=CaptureError(kind, message, fix),
    )


def evicted_stand_in(address: str) -> MachineSnapshot:
    """A retired agent in a poll: not asked, and said to be out of the job rather than lost."""
    return unreachable(address, CaptureErrorKind.FAILED, f"the agent at {address} is out of the job: its machine "
                       "was evicted", "nothing to do: its ranks run on other machines now")


# What gRPC says, in an UNAVAILABLE status's details, when the far side is no agent speaking our protocol.
_HANDSHAKE_HINTS = ("handshake", "ssl", "tls", "http1.x", "socket closed", "reset by peer", "wrong_version_number",
                    "end of tcp stream")


def error_for_rpc(address: str, exc: grpc.aio.AioRpcError, timeout_s: float, *,
                  using_tls: bool = False) -> MachineSnapshot:
    """A failed call -> the machine marked unreachable, with what happened and the fix.

    Each cause has its own first words (the TUI's header and `rankscope
    snapshot` print them as they are): "token refused", "not allowed",
    "nothing listening", "handshake failed", "no such host", "no answer".
    """
    code = exc.code()
    details = (exc.details() or "").strip()
    host, _, port = address.rpartition(":")
    lowered = details.lower()
    if out_of_descriptors(details):
        return own_limit(address, details)
    if code == grpc.StatusCode.UNAVAILABLE and (tls := handshake_problem(details, using_tls=using_tls)) is not None:
        return unreachable(address, CaptureErrorKind.UNREACHABLE,
                           f"handshake failed with {address}: {tls[0]} ({details})", tls[1])
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return unreachable(
            address, CaptureErrorKind.PERMISSION,
            f"token refused: the agent at {address} refused the token ({details or 'no reason given'})",
            "pass --token-file with a token the agent accepts (a line of the agent's own --token-file), "
            "or set RANKSCOPE_TOKEN",
        )
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return unreachable(
            address, CaptureErrorKind.PERMISSION,
            f"not allowed: the agent at {address} does not allow this call with this token ({details})",
            "use a token with the 'act' role for actions (a line 'act:<token>' in the agent's token file)",
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return unreachable(
            address, CaptureErrorKind.UNREACHABLE,
            f"no answer: the agent at {address} did not answer within {timeout_s:.1f} s",
            "the machine may be overloaded or the network slow: raise --deadline, or read the agent's log there",
        )
    if code == grpc.StatusCode.UNAVAILABLE and "refused" in lowered:
        return unreachable(
            address, CaptureErrorKind.UNREACHABLE,
            f"nothing listening at {address} (connection refused)",
            f"start `rankscope agent` on {host or address} with --port {port or '?'}, or fix the address; agents "
            "listen on 127.0.0.1 only unless started with --bind",
        )
    if code == grpc.StatusCode.UNAVAILABLE and any(h in lowered for h in _HANDSHAKE_HINTS):
        return unreachable(
            address, CaptureErrorKind.UNREACHABLE,
            f"handshake failed with {address}: something listens there but does not speak to this client "
            f"({details})",
            "check that the port is a rankscope agent's, and that both sides use TLS or neither does "
            "(the agent's TLS options and this client's must match)",
        )
    if code == grpc.StatusCode.UNAVAILABLE and any(h in lowered for h in ("dns", "resolv", "lookup")):
        return unreachable(
            address, CaptureErrorKind.UNREACHABLE,
            f"no such host: {host or address} does not resolve ({details})",
            "check the host name in --agents or the hostfile",
        )
    if code == grpc.StatusCode.UNAVAILABLE:
        return unreachable(
            address, CaptureErrorKind.UNREACHABLE,
            f"no agent answered at {address} ({details or 'unavailable'})",
            f"is `rankscope agent` running on {host or address} with --port {port or '?'}? Agents listen on "
            "127.0.0.1 only unless started with --bind; also check --token-file and any firewall",
        )
    return unreachable(
        address, CaptureErrorKind.FAILED,
        f"agent at {address} failed the call: {code.name if code else 'UNKNOWN'}: {details}",
        "read the agent's log on that machine; restart the agent if it keeps failing",
    )


def out_of_descriptors(text: str) -> bool:
    """Whether a failure was this process running out of file descriptors (EMFILE), not the agent."""
    lowered = text.lower()
    return "too many open files" in lowered or "emfile" in lowered


def own_limit(address: str, details: str) -> MachineSnapshot:
    """The agent at ``address`` was not reached because of a limit of this client, and what to change here."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return unreachable(
        address, CaptureErrorKind.FAILED,
        f"not asked: this client ran out of file descriptors (open-file limit {soft}) before it reached "
        f"{address}; the agent itself may be fine ({details})",
        f"raise the hard limit this client starts under (`ulimit -Hn`, now {hard}; e.g. `ulimit -n 65536` as root or in "
        "/etc/security/limits.conf) and retry; beyond a few thousand agents, let agents relay "
        "(`rankscope agent --relay-to`)",
    )


def raise_open_file_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (one channel per agent needs one each).

    Returns the soft limit in force afterwards. Raising the soft limit up to the
    hard one needs no privilege; a platform that refuses keeps what it had.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return int(soft) if soft != resource.RLIM_INFINITY else 1 << 30


def channel_budget(soft_limit: int) -> int:
    """How many agent channels may be open at once under an open-file limit of ``soft_limit``."""
    return max(8, soft_limit - RESERVED_FDS)


class _Agent:
    """One agent's channel and stub, created inside the event loop that uses them."""

    def __init__(self, address: str, tls: ClientTLS | None = None) -> None:
        self.address = address
        if tls is not None:
            self.channel: Any = grpc.aio.secure_channel(address, channel_credentials(tls),
                                                        options=CHANNEL_OPTIONS + channel_options(tls))
        else:
            self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub: Any = pb_grpc.RankscopeAgentStub(self.channel)  # type: ignore[no-untyped-call]

    async def close(self) -> None:
        await self.channel.close(grace=None)


class FanOut:
    """All agents of one job, asked at once; every reading is a whole JobSnapshot."""

    def __init__(
        self, agents: Sequence[str], token: str | None, *, deadline_s: float = 10.0,
        tls: ClientTLS | None = None, max_channels: int | None = None, merge: bool = True,
    ) -> None:
        """``tls``: reach the agents over TLS (``rankscope.wire.tls.client_tls``); None: plaintext.

        ``merge``: ask relaying agents to fold what they relay into one merged reply (``rankscope.wire.merge``);
        False: each relayed reply forwarded as it came.

        ``max_channels``: at most this many agent channels open at once (default:
        what the open-file limit allows once raised to its hard limit). With more
        agents than that, a fan-out opens a channel per call and closes it after,
        so every agent is still asked.
        """
        budget = channel_budget(raise_open_file_limit())
        self.max_channels = min(max_channels, budget) if max_channels is not None else budget
        self.peak_channels = 0  # the most channels open at once so far (what the limit bounds)
        self._open = 0
        self._gate_sem: asyncio.Semaphore | None = None
        self._gate_loop: asyncio.AbstractEventLoop | None = None
        self.agents: tuple[str, ...] = tuple(dict.fromkeys(agents))
        # Agents taken out of the job (their machines evicted): no fan-out reaches them any more -- no plan,
        # run, backup, hot-update or audit stream -- and polls report them as evicted without asking.
        self.retired: frozenset[str] = frozenset()
        self.deadline_s = deadline_s
        self.tls = tls
        self.merge = merge
        self._metadata = auth_metadata(token)
        self._conns: dict[str, _Agent] = {}
        self._names: dict[str, str] = {}  # address -> the machine name its agent last reported
        self._held = HeldReadings()  # what deltas are decoded against (rankscope.wire.delta)
        self._members_key: tuple[tuple[str, ...], frozenset[str]] | None = None
        self._members_len = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- membership ---------------------------------------------------------

    @property
    def members(self) -> tuple[str, ...]:
        """The agents every call fans out to: all given, less the retired ones."""
        return tuple(a for a in self.agents if a not in self.retired)

    def retire(self, addresses: Sequence[str]) -> None:
        """Take these agents out of every fan-out (their machines were evicted); they stay listed as evicted."""
        self.retired = self.retired | frozenset(addresses)

    def set_agents(self, agents: Sequence[str], retired: Sequence[str] = ()) -> None:
        """A new list of agents (a re-read hostfile): new ones are asked from the next call on."""
        self.agents = tuple(dict.fromkeys([*agents, *retired]))
        self.retired = self.retired | frozenset(retired)

    def know_names(self, names: Mapping[str, str]) -> None:
        """Machine names of agents (address -> name) this client may never hear from itself (a hostfile's
        evicted lines): their stand-ins carry the name, not the address. A name an agent gave wins."""
        for address, name in names.items():
            self._names.setdefault(address, name)

    # ---- public calls ---------------------------------------------------

    async def describe(self) -> JobSnapshot:
        """Ranks, processes, host and GPU metrics and counters of every machine; no stacks."""
        return await self._fan_out(self._versioned("Describe", pb.DescribeRequest(merge=self.merge)), self.deadline_s)

    async def poll(self, *, sample_hz: float = 0.0) -> JobSnapshot:
        """The cheap reading the TUI repeats: metrics and counters, no stacks.

        ``sample_hz`` > 0 asks each agent to keep sampling its ranks' main
        threads (non-blocking) at that rate while polls keep coming; the
        sampled windows come back in ``MachineSnapshot.samples``.
        """
        request = pb.DescribeRequest(sample_hz=max(0.0, sample_hz), merge=self.merge)
        return await self._fan_out(self._versioned("Describe", request), self.deadline_s)

    async def capture(self, *, native: bool = False, subprocesses: bool = True, timeout_s: float = 5.0,
                      sample_hz: float = 0.0) -> JobSnapshot:
        """Everything ``describe`` gives plus the stacks of every rank (py-spy on each machine).

        ``sample_hz`` as in ``poll``: a client that samples must say so in its
        captures too, or a run of slow captures lets the agents' sampling lapse.
        """
        request = pb.CaptureRequest(native=native, subprocesses=subprocesses, timeout_s=timeout_s,
                                    sample_hz=max(0.0, sample_hz), merge=self.merge)
        return await self._fan_out(self._versioned("Capture", request),
                                   max(self.deadline_s, timeout_s + CAPTURE_MARGIN_S))

    async def close(self) -> None:
        conns, self._conns = list(self._conns.values()), {}
        self._open -= len(conns)
        await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # ---- machinery --------------------------------------------------------

    def _versioned(self, method: str, request: pb.DescribeRequest | pb.CaptureRequest) -> CallFor:
        """``method`` with ``request``, asking each agent (and each one it relays for) for what changed since
        the reading this client holds of it."""

        def call_for(address: str) -> Call:
            return versioned_call(method, request, self._held.newest(address), self._held.relayed_since(address))

        return call_for

    def _conn(self, address: str) -> _Agent:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            # grpc.aio channels belong to the loop that made them; a new loop needs new ones.
            self._open -= len(self._conns)
            self._conns = {}
            self._loop = loop
        conn = self._conns.get(address)
        if conn is None:
            conn = self._conns[address] = _Agent(address, self.tls)
            self._count_open(+1)
        return conn

    async def _raw_one(self, address: str, call: Call, timeout_s: float) -> pb.MachineSnapshot | MachineSnapshot:
        """One agent's reply as it came (not decoded), or the stand-in saying why there is none."""
        persistent = self._member_count() <= self.max_channels
        async with self._gate():
            conn: _Agent | None = None
            try:
                conn = self._conn(address) if persistent else _Agent(address, self.tls)
                self._count_open(+1 if not persistent else 0)
                return await call(conn.stub, self._metadata, timeout_s)
            except grpc.aio.AioRpcError as exc:
                return error_for_rpc(address, exc, timeout_s, using_tls=self.tls is not None)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bad address, or this process out of descriptors: mark this machine
                if out_of_descriptors(str(exc)):
                    return own_limit(address, str(exc))
                return unreachable(
                    address, CaptureErrorKind.FAILED, f"agent at {address}: {type(exc).__name__}: {exc}",
                    "check the address; run the same rankscope version on the agents and here",
                )
            finally:
                if not persistent and conn is not None:
                    await conn.close()
                    self._count_open(-1)

    async def _one(self, address: str, call: Call, timeout_s: float) -> list[MachineSnapshot]:
        """One agent's machine, and the machines it relayed for (decoded once the channel is free again)."""
        reply = await self._raw_one(address, call, timeout_s)
        if isinstance(reply, MachineSnapshot):
            return [reply, *self._behind(reply)]
        try:
            machines = self._held.decode(reply, address)
        except Exception as exc:  # a reply that does not fit: mark this machine, keep the rest
            return [unreachable(
                address, CaptureErrorKind.FAILED, f"agent at {address}: {type(exc).__name__}: {exc}",
                "check the address; run the same rankscope version on the agents and here",
            )]
        # The address is the one this client used, whatever the agent thinks it is called.
        return [_with_address(machines[0], address), *machines[1:]]

    async def forward(self, call_for: CallFor, timeout_s: float) -> list[pb.MachineSnapshot]:
        """Every member's reply as it came, for an agent that relays: a failed one as an encoded stand-in."""
        replies = await asyncio.gather(*(self._raw_one(a, call_for(a), timeout_s) for a in self.members))
        out: list[pb.MachineSnapshot] = []
        for address, reply in zip(self.members, replies, strict=True):
            if isinstance(reply, MachineSnapshot):
                reply = machine_to_proto(self._named(reply))
            else:
                reply.address = address
            out.append(reply)
        return out

    def _behind(self, relay: MachineSnapshot) -> list[MachineSnapshot]:
        """For a relay that gave no reply: a stand-in for each machine last heard behind it, naming its ranks
        (a relay gone takes its whole subtree with it, and none of it may vanish from the reading)."""
        out = []
        for address, held in self._held.behind(relay.address):
            name = held.machine if held is not None else self._names.get(address, address)
            ranks = tuple(r.rank for r in held.ranks) if held is not None else ()
            error = relay.error
            out.append(MachineSnapshot(
                machine=name, address=address, reachable=False, captured=None,
                error=CaptureError(CaptureErrorKind.UNREACHABLE,
                                   f"not heard: {name} ({ranks_text(ranks)}) is behind the relay at {relay.address}, "
                                   f"which gave no reply ({error.message if error else 'no reason given'})",
                                   (f"{error.fix} " if error else "") +
                                   f"(the relay at {relay.address} forwards for this machine)")))
        return out

    def _member_count(self) -> int:
        """len(self.members), counted once per change of the lists rather than once per agent asked (which made a
        fan-out quadratic: 4 million steps a poll at 2,048 agents)."""
        key = self._members_key
        if key is None or key[0] is not self.agents or key[1] is not self.retired:  # identity: no O(N) compare
            self._members_key, self._members_len = (self.agents, self.retired), len(self.members)
        return self._members_len

    def _gate(self) -> asyncio.Semaphore:
        """Bounds the calls in flight (so the channels open) to ``max_channels``."""
        loop = asyncio.get_running_loop()
        gate = self._gate_sem
        if gate is None or self._gate_loop is not loop:
            gate = self._gate_sem = asyncio.Semaphore(self.max_channels)
            self._gate_loop = loop
        return gate

    def _count_open(self, delta: int) -> None:
        self._open += delta
        self.peak_channels = max(self.peak_channels, self._open)

    async def _fan_out(self, call_for: CallFor, timeout_s: float) -> JobSnapshot:
        started = Instant(wall=time.time(), mono=time.monotonic())
        asked = self.members
        with collector_paused():  # ~400,000 objects at 16,384 ranks, none in a cycle (rankscope.contract.heap)
            answers = await asyncio.gather(*(self._one(a, call_for(a), timeout_s) for a in asked))
        machines = [self._named(m) for ms in answers for m in ms]
        machines += [self._named(evicted_stand_in(a)) for a in self.agents if a in self.retired]
        return JobSnapshot(captured=started, machines=tuple(machines), job_id=common_run_id(machines))

    def _named(self, m: MachineSnapshot) -> MachineSnapshot:
        """An agent that stops answering keeps the machine name it last gave, not its address.

        Otherwise a restarting agent shows up twice (once by name, once by
        address) and the machine it speaks for looks gone and new again.
        """
        if m.reachable:
            self._names[m.address] = m.machine
            return m
        name = self._names.get(m.address)
        return dataclasses.replace(m, machine=name) if name is not None and m.machine == m.address else m


def _with_address(machine: MachineSnapshot, address: str) -> MachineSnapshot:
    return machine if machine.address == address else dataclasses.replace(machine, address=address)


def common_run_id(machines: Sequence[MachineSnapshot]) -> str | None:
    """The job's id when all ranks seen agree on one torchrun run id."""
    ids = {r.run_id for m in machines for r in m.ranks if r.run_id}
    return ids.pop() if len(ids) == 1 else None
