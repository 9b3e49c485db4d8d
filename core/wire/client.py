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

Actions: an agent acts only on its own machine, so ``plan_action`` splits a
request by the machines and ranks each agent reports (one ``describe``) and
asks each owner for its plan; ``run_action`` sends each owner its part with a
confirmation naming exactly that agent's planned targets. Only a client made
with ``acting=True`` (and a token of the 'act' role) ever sends RunAction.
``watch_audit`` follows one agent's audit log and reconnects by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import resource
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import grpc
from rankscope.actions.agent_protocol import (
    AUDIT_OPEN,
    ActionError,
    ActionUpdate,
    AgentLost,
    AuditItem,
    AuditResumed,
    Confirmation,
    combined_phrase,
    confirmation_for,
    split_fix,
)
from rankscope.actions.journal import JournalEntry
from rankscope.actions.model import (
    ActionKind,
    ActionPlan,
    ActionRequest,
    ActionResult,
    ActionState,
    AuditRecord,
    EvictArgs,
    Targets,
    confirmation_matches,
    needs_typed_confirmation,
)
from rankscope.contract.errors import RankscopeError
from rankscope.contract.heap import collector_paused
from rankscope.contract.snapshot import CaptureError, CaptureErrorKind, Instant, JobSnapshot, MachineSnapshot
from rankscope.wire.proto import rankscope_pb2 as pb
from rankscope.wire.proto import rankscope_pb2_grpc as pb_grpc
from rankscope.wire.proto_convert import (
    audit_from_proto,
    confirmation_to_proto,
    event_from_proto,
    held_from_proto,
    machine_to_proto,
    plan_from_proto,
    request_to_proto,
)
from rankscope.wire.tls import ClientTLS, channel_credentials, channel_options, handshake_problem

# Room for many ranks' stacks in one reply (gRPC's default is 4 MiB).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Readings kept per agent to decode deltas against: one per call that may be out at once (the TUI's poll, its
# capture, a watcher's), and a spare.
HELD_READINGS = 4
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
UNOWNED = "unowned"  # plan_action's key for targets no agent reports
# A plan is asked once, by a person who waits for it: the poll deadline (made for readings repeated every
# second) must not fail it. An agent's first plan after it (re)started imports its planning code and scans
# /proc; on a loaded machine that took over 10 s and every agent answered "no answer" (the e2e tmux test).
PLAN_DEADLINE_S = 30.0
# Codes after which reconnecting cannot help: the watch stops and says why.
_FINAL_CODES = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED)


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


class JobClient:
    """All agents of one job; every method returns a whole JobSnapshot."""

    def __init__(
        self, agents: Sequence[str], token: str | None, *, deadline_s: float = 10.0, acting: bool = False,
        tls: ClientTLS | None = None, max_channels: int | None = None,
    ) -> None:
        """``acting``: this client may run actions (its token was loaded with ``role=Role.ACT``).

        ``tls``: reach the agents over TLS (``rankscope.wire.tls.client_tls``); None: plaintext.

        A read-only client (the default, and what ``--read-only`` gives) refuses
        ``run_action`` before anything is sent.

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
        self.acting = acting
        self.tls = tls
        self._metadata = auth_metadata(token)
        self._conns: dict[str, _Agent] = {}
        self._names: dict[str, str] = {}  # address -> the machine name its agent last reported
        # address -> the last readings decoded from that agent, by version, oldest first: a call asks for what
        # changed since the newest (DescribeRequest.since), and its reply may come after another call's (a TUI
        # polls while a capture is out), so a few are kept. A relay's children are held under the addresses the
        # relay reported.
        self._held: dict[str, dict[int, MachineSnapshot]] = {}
        self._relayed: dict[str, tuple[str, ...]] = {}  # a relay's address -> the addresses it relayed for
        self._members_key: tuple[tuple[str, ...], frozenset[str]] | None = None
        self._members_len = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        # action id -> (each owner's part of the request, the plans they gave): what run_action sends
        self._planned: dict[str, tuple[dict[str, ActionRequest], dict[str, ActionPlan | ActionError]]] = {}

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
        return await self._fan_out(self._versioned("Describe", pb.DescribeRequest()), self.deadline_s)

    async def poll(self, *, sample_hz: float = 0.0) -> JobSnapshot:
        """The cheap reading the TUI repeats: metrics and counters, no stacks.

        ``sample_hz`` > 0 asks each agent to keep sampling its ranks' main
        threads (non-blocking) at that rate while polls keep coming; the
        sampled windows come back in ``MachineSnapshot.samples``.
        """
        return await self._fan_out(self._versioned("Describe", pb.DescribeRequest(sample_hz=max(0.0, sample_hz))),
                                   self.deadline_s)

    async def capture(self, *, native: bool = False, subprocesses: bool = True, timeout_s: float = 5.0,
                      sample_hz: float = 0.0) -> JobSnapshot:
        """Everything ``describe`` gives plus the stacks of every rank (py-spy on each machine).

        ``sample_hz`` as in ``poll``: a client that samples must say so in its
        captures too, or a run of slow captures lets the agents' sampling lapse.
        """
        request = pb.CaptureRequest(native=native, subprocesses=subprocesses, timeout_s=timeout_s,
                                    sample_hz=max(0.0, sample_hz))
        return await self._fan_out(self._versioned("Capture", request),
                                   max(self.deadline_s, timeout_s + CAPTURE_MARGIN_S))

    # ---- actions ------------------------------------------------------------

    async def plan_action(self, request: ActionRequest) -> dict[str, ActionPlan | ActionError]:
        """Each owning agent's plan (or why it gave none), by agent address.

        Targets that no reachable agent reports come back under the key
        ``UNOWNED``; an agent that refuses its part (targets outside its job,
        no actions configured) or cannot be reached gives an ActionError.
        Planning changes nothing and needs only the 'read' role.
        """
        parts, answers = await self._split(request)
        deadline_s = max(self.deadline_s, PLAN_DEADLINE_S)

        async def one(address: str, part: ActionRequest) -> tuple[str, ActionPlan | ActionError]:
            try:
                reply = await self._conn(address).stub.PlanAction(
                    request_to_proto(part), metadata=self._metadata, timeout=deadline_s)
                return address, plan_from_proto(reply)
            except grpc.aio.AioRpcError as exc:
                return address, action_error(address, exc, deadline_s, using_tls=self.tls is not None)

        for address, answer in await asyncio.gather(*(one(a, p) for a, p in parts.items())):
            answers[address] = answer
        self._planned[request.action_id] = (parts, answers)
        return answers

    async def run_action(self, request: ActionRequest, confirmation: Confirmation) -> AsyncIterator[ActionUpdate]:
        """Run a confirmed action on every owning agent at once: their progress, then one result each.

        ``confirmation`` is what the person confirmed for the whole action:
        every planned machine (``confirmation_for(plans)``) and, for eviction,
        the phrase ``combined_phrase(kind, plans)`` they typed. It must match
        the plans exactly or nothing is sent (RankscopeError). Each agent gets
        its own part and a confirmation of exactly its planned targets, plans
        again and refuses on any difference. An agent lost mid-way gives a
        failed result saying the outcome there is unknown; it never raises.
        """
        if not self.acting:
            raise RankscopeError("this client is read-only: it does not send actions",
                                 "attach without --read-only, with a token of the 'act' role")
        if request.action_id not in self._planned:
            await self.plan_action(request)
        parts, answers = self._planned[request.action_id]
        plans = {a: p for a, p in answers.items() if isinstance(p, ActionPlan)}
        problems = [f"{a}: {e.message}" for a, e in answers.items() if isinstance(e, ActionError)]
        if problems or not plans:
            raise RankscopeError(f"not every target has a plan, so nothing was sent: {'; '.join(problems) or 'none'}",
                                 "fix the targets (or the agents) and plan again")
        self._check_confirmation(request, list(plans.values()), confirmation)
        del self._planned[request.action_id]  # the next call with this id replays; it does not reuse a stale split

        queue: asyncio.Queue[ActionUpdate | None] = asyncio.Queue()

        async def one(address: str) -> None:
            part, plan = parts[address], plans[address]
            mine = Confirmation(plan.machines, tuple(sorted(set(part.targets.ranks))),
                                plan.confirm_phrase if plan.typed_confirmation else "")
            message = pb.RunActionRequest(request=request_to_proto(part), confirmation=confirmation_to_proto(mine))
            ended = heard = False
            try:
                async for reply in self._conn(address).stub.RunAction(message, metadata=self._metadata):
                    event = event_from_proto(reply)
                    ended, heard = isinstance(event, ActionResult), True
                    await queue.put(ActionUpdate(address, event))
                    if ended:
                        return
                reason = "the agent ended the stream without a result"
            except grpc.aio.AioRpcError as exc:
                error = action_error(address, exc, 0.0, using_tls=self.tls is not None)
                if not heard and exc.code() in REFUSED_BEFORE_ACTING:
                    await queue.put(ActionUpdate(address, refused_result(request, error)))
                    return
                reason = error.message
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a reply that does not fit: say so, keep the other agents going
                reason = f"{type(exc).__name__}: {exc}"
            if not ended:
                await queue.put(ActionUpdate(address, lost_result(request, address, reason)))

        tasks = [asyncio.create_task(one(a)) for a in plans]
        gathered = asyncio.gather(*tasks)
        gathered.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            while (update := await queue.get()) is not None:
                yield update
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def journal(self, entries: Sequence[JournalEntry] = ()) -> tuple[JournalEntry, ...]:
        """The incident journal of every agent of the job as one story (``rankscope.actions.journal``); with
        ``entries``, first add them to every agent's (that needs the 'act' role). Agents that keep none (no
        actions configured, older agents) or do not answer add nothing."""
        from rankscope.actions.journal import APPEND, READ, entries_from_bytes, entries_to_bytes, merge

        method, body = (APPEND, entries_to_bytes(entries)) if entries else (READ, b"")
        live = [a for a in self.agents if a not in self.retired]

        async def one(address: str) -> tuple[JournalEntry, ...]:
            call = self._conn(address).channel.unary_unary(method, request_serializer=None,
                                                           response_deserializer=None)
            try:
                return entries_from_bytes(await call(body, metadata=self._metadata, timeout=self.deadline_s))
            except (grpc.aio.AioRpcError, ValueError):
                return ()

        return merge(*await asyncio.gather(*(one(a) for a in live)))

    async def watch_audit(
        self, address: str, *, since: int | None = 0, retry_s: float = 1.0
    ) -> AsyncIterator[AuditRecord | AgentLost | AuditResumed]:
        """One agent's audit records (``seq`` > ``since``; None: only new ones), live, for as long as you iterate.

        A broken stream yields one AgentLost (``retrying=True``) and the client
        reconnects every ``retry_s``, resuming after the last record seen, so
        nothing is missed or repeated; once the agent accepts the stream again it
        yields AuditResumed (agents from before it: the next record says so). A refused token or an agent without
        actions yields AgentLost with ``retrying=False`` and ends. Never raises
        for a lost agent.
        """
        last = since
        lost = False
        while True:
            request = pb.WatchAuditRequest() if last is None else pb.WatchAuditRequest(after_seq=last)
            try:
                call = self._conn(address).stub.WatchAudit(request, metadata=self._metadata)
                if lost and AUDIT_OPEN in tuple(await call.initial_metadata() or ()):
                    lost = False
                    yield AuditResumed(address)
                async for reply in call:
                    record = audit_from_proto(reply)
                    last, lost = record.seq, False
                    yield record
                reason, fix = f"the agent at {address} ended the audit stream (stopping?)", "it is retried"
            except grpc.aio.AioRpcError as exc:
                error = action_error(address, exc, 0.0, using_tls=self.tls is not None)
                if exc.code() in _FINAL_CODES:
                    yield AgentLost(address, error.message, error.fix, retrying=False)
                    return
                reason, fix = error.message, error.fix
            if not lost:
                lost = True
                yield AgentLost(address, reason, fix, retrying=True)
            await asyncio.sleep(retry_s)

    async def watch_all_audit(
        self, *, since: int | None = 0, retry_s: float = 1.0
    ) -> AsyncIterator[AuditItem]:
        """Every member agent's audit stream merged, each record with its agent's address (see ``watch_audit``).

        The set of streams follows the membership: a retired agent's stream is
        closed, an agent added by ``set_agents`` is followed from its start.
        """
        queue: asyncio.Queue[AuditItem] = asyncio.Queue()
        tasks: dict[str, asyncio.Task[None]] = {}

        async def one(address: str) -> None:
            async for item in self.watch_audit(address, since=since, retry_s=retry_s):
                await queue.put((address, item) if isinstance(item, AuditRecord) else item)

        def follow() -> None:
            members = set(self.members)
            for address in [a for a in tasks if a not in members]:
                tasks.pop(address).cancel()
            for address in self.members:
                if address not in tasks:
                    tasks[address] = asyncio.create_task(one(address))

        try:
            while True:
                follow()
                try:
                    yield await asyncio.wait_for(queue.get(), retry_s)
                except TimeoutError:
                    continue
        finally:
            for task in tasks.values():
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)

    async def _split(self, request: ActionRequest) -> tuple[dict[str, ActionRequest], dict[str, ActionPlan | ActionError]]:
        """Each owning agent's part of ``request`` (from one describe, with a plan's deadline), and errors for what
        has no owner."""
        job = await self._fan_out(self._versioned("Describe", pb.DescribeRequest()),
                                  max(self.deadline_s, PLAN_DEADLINE_S))
        parts: dict[str, ActionRequest] = {}
        errors: dict[str, ActionPlan | ActionError] = {}
        members = [m for m in job.machines if m.address not in self.retired]  # evicted machines take no part
        reachable = [m for m in members if m.reachable]
        lost = [m for m in members if not m.reachable]
        wanted_machines = set(request.targets.machines)
        wanted_ranks = set(request.targets.ranks)
        whole_job = not wanted_machines and not wanted_ranks
        if whole_job:  # every agent should take part: a lost one means the action cannot be whole
            for m in lost:
                error = m.error or CaptureError(CaptureErrorKind.UNREACHABLE, f"agent at {m.address} is lost")
                errors[m.address] = ActionError(m.address, error.message, error.fix)
        # In rank order, not the order the agents were listed in (the order they came up in): the plans, the
        # phrase to type and the confirmation all follow it, and the drill's phrase read "machine-3 machine-1".
        for m in sorted(reachable, key=lambda m: (min((i.rank for i in m.ranks), default=1 << 62), m.machine)):
            machines = tuple(n for n in request.targets.machines if n in (m.machine, m.address))
            ranks = tuple(r for r in request.targets.ranks if r in {i.rank for i in m.ranks})
            if not (whole_job or machines or ranks):
                continue
            if machines and machines != (m.machine,):
                machines = (m.machine,)  # named by its address: the agent knows itself by name
            if request.kind == ActionKind.EVICT and not machines:
                machines = (m.machine,)  # an eviction takes the machine of the ranks named
            wanted_machines -= {m.machine, m.address}
            wanted_ranks -= set(ranks)
            parts[m.address] = dataclasses.replace(request, targets=Targets(machines, ranks))
        if request.kind == ActionKind.EVICT and len(parts) > 1:
            # Each agent learns which machines go with its own (a whole-job restart must take them all at once).
            evicted = [m for part in parts.values() for m in part.targets.machines]
            for address, part in parts.items():
                assert isinstance(part.args, EvictArgs)
                others = tuple(m for m in evicted if m not in part.targets.machines)
                parts[address] = dataclasses.replace(part, args=dataclasses.replace(part.args, together=others))
        if wanted_machines or wanted_ranks:
            names = [f"machine {n}" for n in sorted(wanted_machines)] + [f"rank {r}" for r in sorted(wanted_ranks)]
            unreachable = f" (unreachable: {' '.join(m.address for m in lost)})" if lost else ""
            errors[UNOWNED] = ActionError(
                UNOWNED, f"no reachable agent of this job reports {', '.join(names)}{unreachable}",
                "target the machines and ranks the agents list (a lost agent's machine cannot act)")
        return parts, errors

    @staticmethod
    def _check_confirmation(request: ActionRequest, plans: list[ActionPlan], confirmation: Confirmation) -> None:
        expected = confirmation_for(plans, request.targets.ranks)
        if sorted(set(confirmation.machines)) != sorted(set(expected.machines)) \
                or sorted(set(confirmation.ranks)) != sorted(set(expected.ranks)):
            raise RankscopeError(
                f"the confirmation names machines [{' '.join(confirmation.machines)}] ranks {list(confirmation.ranks)} "
                f"but the plans target machines [{' '.join(expected.machines)}] ranks {list(expected.ranks)}; "
                "nothing was sent", "confirm exactly the targets the plan shows")
        if needs_typed_confirmation(request.kind) or any(p.typed_confirmation for p in plans):
            phrase = combined_phrase(request.kind, plans)
            if not confirmation_matches(plans, confirmation.typed):  # the agents apply the same rule
                raise RankscopeError(f"the typed confirmation {confirmation.typed!r} is not {phrase!r}; nothing was sent",
                                     f"type exactly: {phrase}")

    async def close(self) -> None:
        conns, self._conns = list(self._conns.values()), {}
        self._open -= len(conns)
        await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)

    async def __aenter__(self) -> JobClient:
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
            relayed = [(a, v) for a in self._relayed.get(address, ()) if (v := self._newest(a)) is not None]
            return versioned_call(method, request, self._newest(address), relayed)

        return call_for

    def _newest(self, address: str) -> int | None:
        """The version of the newest reading held of the agent at ``address``."""
        readings = self._held.get(address)
        return next(reversed(readings)) if readings else None

    def _hold(self, address: str, machine: MachineSnapshot, version: int | None) -> None:
        if version is None:  # an agent that does not version its readings: nothing to ask a delta against
            self._held.pop(address, None)
            return
        readings = self._held.setdefault(address, {})
        readings.pop(version, None)  # the same reading again is the newest one
        readings[version] = machine
        while len(readings) > HELD_READINGS:
            del readings[next(iter(readings))]

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
            return [reply]
        try:
            held = held_from_proto(reply, address, lambda at, version: self._held.get(at, {}).get(version))
        except Exception as exc:  # a reply that does not fit: mark this machine, keep the rest
            for child in self._relayed.pop(address, ()):
                self._held.pop(child, None)
            self._held.pop(address, None)  # the next call asks for the whole reading again
            return [unreachable(
                address, CaptureErrorKind.FAILED, f"agent at {address}: {type(exc).__name__}: {exc}",
                "check the address; run the same rankscope version on the agents and here",
            )]
        for held_at, machine, version in held:
            self._hold(held_at, machine, version)
        self._relayed[address] = tuple(a for a, _, _ in held[1:])
        machines = [m for _, m, _ in held]
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


def action_error(address: str, exc: grpc.aio.AioRpcError, timeout_s: float, *, using_tls: bool = False) -> ActionError:
    """A failed action call -> what happened and the fix (an agent's refusal carries its own fix)."""
    code = exc.code()
    if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
        message, fix = split_fix(exc.details() or "")
        return ActionError(address, f"agent at {address}: {message}", fix)
    error = error_for_rpc(address, exc, timeout_s, using_tls=using_tls).error
    assert error is not None
    return ActionError(address, error.message, error.fix)


# Codes an agent answers before it does anything (the token's role, a malformed request, no actions configured):
# such a run was refused, not lost.
REFUSED_BEFORE_ACTING = frozenset({grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
                                   grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION})


def refused_result(request: ActionRequest, error: ActionError) -> ActionResult:
    """The result shown for an agent that refused the run before acting: nothing ran there."""
    return ActionResult(request.action_id, request.kind, ActionState.REFUSED,
                        f"refused: {error.message}; nothing was done", None, time.time(),
                        (f"fix: {error.fix}",) if error.fix else ())


def lost_result(request: ActionRequest, address: str, reason: str) -> ActionResult:
    """The result shown for an agent whose run stream broke: the outcome there is unknown, not failed-and-undone."""
    now = time.time()
    return ActionResult(
        request.action_id, request.kind, ActionState.FAILED,
        f"{reason}; the outcome on {address} is unknown: the agent records it in its audit log",
        None, now, (f"send the same action id {request.action_id} again to get the recorded result",))


def _with_address(machine: MachineSnapshot, address: str) -> MachineSnapshot:
    return machine if machine.address == address else dataclasses.replace(machine, address=address)


def common_run_id(machines: Sequence[MachineSnapshot]) -> str | None:
    """The job's id when all ranks seen agree on one torchrun run id."""
    ids = {r.run_id for m in machines for r in m.ranks if r.run_id}
    return ids.pop() if len(ids) == 1 else None


def capture_once(agents: Sequence[str], token: str | None, *, deadline_s: float = 10.0, tls: ClientTLS | None = None,
                 **capture_kwargs: Any) -> JobSnapshot:
    """One capture from a synchronous caller (scripts, the CLI)."""

    got: list[JobSnapshot] = []

    async def go() -> None:
        # The snapshot leaves through `got`, not as the coroutine's result: asyncio.run on Python 3.11 formats
        # a task's result into its repr on the way out, which at 16k ranks cost seconds and a gigabyte.
        async with JobClient(agents, token, deadline_s=deadline_s, tls=tls) as client:
            got.append(await client.capture(**capture_kwargs))

    asyncio.run(go())
    return got[0]


class KeepAlive:
    """Renews the lease of agents started with ``--lease`` while this client lives.

    A thread sends each agent a health check with the session's token every
    ``every_s`` seconds; an agent that hears from nobody for its lease stops by
    itself, so agents outlive a client only by their lease however that client
    ended (SIGKILL, a lost login node). ``agents`` is read at each round, so
    agents that replace others (a requeued Slurm job) are kept too.
    """

    def __init__(self, agents: Callable[[], Sequence[str]], token: str | None, *, tls: ClientTLS | None = None,
                 every_s: float = 5.0) -> None:
        import threading

        self.agents, self.token, self.tls, self.every_s = agents, token, tls, every_s
        self.rounds = 0  # rounds completed (each agent asked once)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rankscope-keep-alive", daemon=True)
        self._channels: dict[str, Any] = {}

    def __enter__(self) -> KeepAlive:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _channel(self, address: str) -> Any:
        if address not in self._channels:
            if self.tls is not None:
                self._channels[address] = grpc.secure_channel(
                    address, channel_credentials(self.tls), options=CHANNEL_OPTIONS + channel_options(self.tls))
            else:
                self._channels[address] = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        return self._channels[address]

    def _run(self) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            while not self._stop.is_set():
                for address in list(self.agents()):
                    stub = health_pb2_grpc.HealthStub(self._channel(address))  # type: ignore[no-untyped-call]
                    # An agent that does not answer is the polls' business; keep renewing the others.
                    with contextlib.suppress(grpc.RpcError):
                        stub.Check(health_pb2.HealthCheckRequest(), metadata=auth_metadata(self.token),
                                   timeout=self.every_s)
                self.rounds += 1
                self._stop.wait(self.every_s)
        finally:
            for channel in self._channels.values():
                channel.close()
