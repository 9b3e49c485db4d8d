"""The client side of the agent protocol: ask every agent of a job at once.

``JobClient`` is what the TUI, ``rankscope snapshot`` and the drill use to
reach agents; nothing else in rankscope outside the agent touches gRPC. Every
call fans out to all agents concurrently, each call with its own deadline,
and always returns a whole ``JobSnapshot``: an agent that cannot be reached,
refuses the token, times out or fails becomes a ``MachineSnapshot`` with
``reachable=False`` and a ``CaptureError`` that says what happened and what to
do, never an exception for the whole call.

Channels are kept per agent and reused (the TUI polls every second); gRPC
reconnects a channel by itself, and the reconnect back-off is capped at a few
seconds so an agent that comes back is seen again quickly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any

import grpc
from rankscope.proto import rankscope_pb2 as pb
from rankscope.proto import rankscope_pb2_grpc as pb_grpc
from rankscope.proto_convert import machine_from_proto
from rankscope.snapshot import CaptureError, CaptureErrorKind, Instant, JobSnapshot, MachineSnapshot

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
)
# A capture may take each py-spy call's full limit; the gRPC deadline leaves room for it.
CAPTURE_MARGIN_S = 2.0

Call = Callable[[Any, Sequence[tuple[str, str]], float], Awaitable[pb.MachineSnapshot]]


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata carrying the bearer token (none when there is no token)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def unreachable(address: str, kind: CaptureErrorKind, message: str, fix: str) -> MachineSnapshot:
    """The stand-in for a machine whose agent gave no snapshot."""
    return MachineSnapshot(
        machine=address, address=address, reachable=False, captured=None,
        error=CaptureError(kind, message, fix),
    )


def error_for_rpc(address: str, exc: grpc.aio.AioRpcError, timeout_s: float) -> MachineSnapshot:
    """A failed call -> the machine marked unreachable, with what happened and the fix."""
    code = exc.code()
    details = (exc.details() or "").strip()
    host, _, port = address.rpartition(":")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return unreachable(
            address, CaptureErrorKind.PERMISSION,
            f"agent at {address} refused the token ({details or 'no reason given'})",
            "pass --token-file with a token the agent accepts (a line of the agent's own --token-file), "
            "or set RANKSCOPE_TOKEN",
        )
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return unreachable(
            address, CaptureErrorKind.PERMISSION,
            f"agent at {address} does not allow this call with this token ({details})",
            "use a token with the 'act' role for actions (a line 'act:<token>' in the agent's token file)",
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return unreachable(
            address, CaptureErrorKind.UNREACHABLE,
            f"agent at {address} did not answer within {timeout_s:.1f} s",
            "the machine may be overloaded or the network slow: raise --deadline, or read the agent's log there",
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


class _Agent:
    """One agent's channel and stub, created inside the event loop that uses them."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel: Any = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub: Any = pb_grpc.RankscopeAgentStub(self.channel)  # type: ignore[no-untyped-call]

    async def close(self) -> None:
        await self.channel.close(grace=None)


class JobClient:
    """All agents of one job; every method returns a whole JobSnapshot."""

    def __init__(self, agents: Sequence[str], token: str | None, *, deadline_s: float = 10.0) -> None:
        self.agents: tuple[str, ...] = tuple(dict.fromkeys(agents))
        self.deadline_s = deadline_s
        self._metadata = auth_metadata(token)
        self._conns: dict[str, _Agent] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- public calls ---------------------------------------------------

    async def describe(self) -> JobSnapshot:
        """Ranks, processes, host and GPU metrics and counters of every machine; no stacks."""
        return await self._fan_out(self._describe_call, self.deadline_s)

    async def poll(self) -> JobSnapshot:
        """The cheap reading the TUI repeats: metrics and counters, no stacks."""
        return await self._fan_out(self._describe_call, self.deadline_s)

    async def capture(self, *, native: bool = False, subprocesses: bool = True, timeout_s: float = 5.0) -> JobSnapshot:
        """Everything ``describe`` gives plus the stacks of every rank (py-spy on each machine)."""
        request = pb.CaptureRequest(native=native, subprocesses=subprocesses, timeout_s=timeout_s)

        def call(stub: Any, metadata: Sequence[tuple[str, str]], timeout: float) -> Awaitable[pb.MachineSnapshot]:
            return stub.Capture(request, metadata=metadata, timeout=timeout)  # type: ignore[no-any-return]

        return await self._fan_out(call, max(self.deadline_s, timeout_s + CAPTURE_MARGIN_S))

    async def stream_metrics(
        self, address: str, *, interval_s: float = 1.0, max_count: int = 0
    ) -> AsyncIterator[MachineSnapshot]:
        """Readings of one machine pushed by its agent every ``interval_s`` (no stacks).

        The stream has no overall deadline (it runs until ``max_count`` readings or
        until the caller stops iterating); if it breaks, one unreachable
        MachineSnapshot saying why is yielded last.
        """
        request = pb.StreamMetricsRequest(interval_s=interval_s, max_count=max_count)
        try:
            stream = self._conn(address).stub.StreamMetrics(request, metadata=self._metadata)
            async for reply in stream:
                yield _with_address(machine_from_proto(reply), address)
        except grpc.aio.AioRpcError as exc:
            yield error_for_rpc(address, exc, 0.0)

    async def close(self) -> None:
        conns, self._conns = list(self._conns.values()), {}
        await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)

    async def __aenter__(self) -> JobClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # ---- machinery --------------------------------------------------------

    @staticmethod
    def _describe_call(stub: Any, metadata: Sequence[tuple[str, str]], timeout: float) -> Awaitable[pb.MachineSnapshot]:
        return stub.Describe(pb.DescribeRequest(), metadata=metadata, timeout=timeout)  # type: ignore[no-any-return]

    def _conn(self, address: str) -> _Agent:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            # grpc.aio channels belong to the loop that made them; a new loop needs new ones.
            self._conns = {}
            self._loop = loop
        conn = self._conns.get(address)
        if conn is None:
            conn = self._conns[address] = _Agent(address)
        return conn

    async def _one(self, address: str, call: Call, timeout_s: float) -> MachineSnapshot:
        try:
            conn = self._conn(address)
            reply = await call(conn.stub, self._metadata, timeout_s)
            machine = machine_from_proto(reply)
        except grpc.aio.AioRpcError as exc:
            return error_for_rpc(address, exc, timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bad address or a reply that does not fit: mark this machine, keep the rest
            return unreachable(
                address, CaptureErrorKind.FAILED, f"agent at {address}: {type(exc).__name__}: {exc}",
                "check the address; run the same rankscope version on the agents and here",
            )
        # The address is the one this client used, whatever the agent thinks it is called.
        return _with_address(machine, address)

    async def _fan_out(self, call: Call, timeout_s: float) -> JobSnapshot:
        started = Instant(wall=time.time(), mono=time.monotonic())
        machines = await asyncio.gather(*(self._one(a, call, timeout_s) for a in self.agents))
        return JobSnapshot(captured=started, machines=tuple(machines), job_id=common_run_id(machines))


def _with_address(machine: MachineSnapshot, address: str) -> MachineSnapshot:
    return machine if machine.address == address else dataclasses.replace(machine, address=address)


def common_run_id(machines: Sequence[MachineSnapshot]) -> str | None:
    """The job's id when all ranks seen agree on one torchrun run id."""
    ids = {r.run_id for m in machines for r in m.ranks if r.run_id}
    return ids.pop() if len(ids) == 1 else None


def capture_once(agents: Sequence[str], token: str | None, *, deadline_s: float = 10.0, **capture_kwargs: Any) -> JobSnapshot:
    """One capture from a synchronous caller (scripts, the CLI)."""

    async def go() -> JobSnapshot:
        async with JobClient(agents, token, deadline_s=deadline_s) as client:
            return await client.capture(**capture_kwargs)

    return asyncio.run(go())
