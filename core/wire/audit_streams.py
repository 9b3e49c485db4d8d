"""Audit streams: each agent's audit log, followed live and resumed after a break.

``watch_audit`` follows one agent's log and reconnects by itself;
``watch_all_audit`` merges every member agent's, following the membership.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from rankscope.actions.agent_protocol import (
    AUDIT_OPEN,
    AgentLost,
    AuditItem,
    AuditResumed,
)
from rankscope.actions.model import (
    AuditRecord,
)
from rankscope.wire.action_client import action_error
from rankscope.wire.action_messages import (
    audit_from_proto,
)
from rankscope.wire.fanout import FanOut
from rankscope.wire.proto import rankscope_pb2 as pb

# Codes after which reconnecting cannot help: the watch stops and says why.
_FINAL_CODES = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED)


class AuditStreams(FanOut):
    """The fan-out, and the agents' audit logs followed live."""

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
