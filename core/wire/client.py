"""The client side of the agent protocol: ask every agent of a job at once.

``JobClient`` is what the TUI, ``rankscope snapshot`` and the drill use to
reach agents; nothing else in rankscope outside the agent touches gRPC. It is
made of one part per role: the fan-out that polls and captures
(``rankscope.wire.fanout``), the action client (``rankscope.wire.action_client``)
and the audit streams (``rankscope.wire.audit_streams``); the lease of agents
started for a session is ``rankscope.wire.lease``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rankscope.contract.snapshot import JobSnapshot
from rankscope.wire.action_client import ActionClient
from rankscope.wire.audit_streams import AuditStreams
from rankscope.wire.sync_loop import run_sync
from rankscope.wire.tls import ClientTLS


class JobClient(ActionClient, AuditStreams):
    """All agents of one job: readings (every one a whole JobSnapshot), actions and their audit."""


def capture_once(agents: Sequence[str], token: str | None, *, deadline_s: float = 10.0, tls: ClientTLS | None = None,
                 **capture_kwargs: Any) -> JobSnapshot:
    """One capture from a synchronous caller (scripts, the CLI), on the process's gRPC loop (``sync_loop``)."""

    got: list[JobSnapshot] = []

    async def go() -> None:
        # The snapshot leaves through `got`, not as the coroutine's result: asyncio on Python 3.11 may format
        # a task's result into its repr on the way out, which at 16k ranks cost seconds and a gigabyte.
        async with JobClient(agents, token, deadline_s=deadline_s, tls=tls) as client:
            got.append(await client.capture(**capture_kwargs))

    run_sync(go())
    return got[0]
