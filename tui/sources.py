"""Where snapshots come from: live agents, a saved bundle, or a test script.

All sources share one small async interface, so the app, the tests and the
benchmark drive the same code. ``poll_loop`` is the refresh loop: it waits
for a poll to finish before it sleeps and polls again (dolphie's rule), so a
slow or lost agent can delay the next poll but never stack polls up; the
client's own deadline bounds each poll.

The TUI reaches agents only through ``rankscope.wire.client`` (imported lazily,
so ``--bundle`` works on a machine without grpc).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from rankscope.actions.journal import JournalEntry
from rankscope.contract.bundle import Bundle
from rankscope.contract.errors import RankscopeError
from rankscope.contract.snapshot import JobSnapshot

if TYPE_CHECKING:
    from rankscope.actions.agent_protocol import ActionError, ActionUpdate, AuditItem, Confirmation
    from rankscope.actions.model import ActionPlan, ActionRequest
    from rankscope.wire.tls import ClientTLS

NEEDS_LIVE_JOB = RankscopeError(
    "actions need a live job: this is a saved bundle",
    "attach to the job's agents (rankscope attach --agents host:port,...) to evict, hot-update or back up")


class Source(Protocol):
    """What the app needs from a data source."""

    live: bool
    label: str

    async def initial(self) -> Sequence[JobSnapshot]:
        """Snapshots to show at start (a bundle's series; a live job's first description)."""
        ...

    async def poll(self) -> JobSnapshot | None:
        """Metrics and counters now (None: nothing new, e.g. a bundle)."""
        ...

    async def capture(self) -> JobSnapshot | None:
        """A snapshot with stacks (None: no stacks to be had)."""
        ...

    async def close(self) -> None: ...


class BundleSource:
    """A saved bundle: its whole series is shown at start; `s` re-reads its last stacks.

    Given a path, the bundle is read in a thread when the app starts: a
    16k-rank bundle takes seconds to decode, and the screen should say so
    instead of staying blank.
    """

    live = False

    def __init__(self, bundle: Bundle | None = None, label: str = "bundle", *, path: str | Path | None = None) -> None:
        if bundle is None and path is None:
            raise ValueError("BundleSource needs a bundle or a path")
        self.bundle = bundle
        self.path = Path(path) if path is not None else None
        self.label = label
        if bundle is None and self.path is not None:
            self.label = f"loading {label} …"
        self._final_label = label

    async def initial(self) -> Sequence[JobSnapshot]:
        if self.bundle is None:
            from rankscope.contract.bundle import read_bundle

            assert self.path is not None
            self.bundle = await asyncio.to_thread(read_bundle, self.path)
            self.label = self._final_label
        return self.bundle.snapshots

    async def poll(self) -> JobSnapshot | None:
        return None

    async def capture(self) -> JobSnapshot | None:
        if self.bundle is None:
            return None
        for snap in reversed(self.bundle.snapshots):
            if any(m.stacks for m in snap.machines):
                return snap
        return None

    async def close(self) -> None:
        return None

    act_problem: tuple[str, str] | None = (NEEDS_LIVE_JOB.message, NEEDS_LIVE_JOB.fix)

    async def plan_action(self, request: ActionRequest) -> Mapping[str, ActionPlan | ActionError]:
        raise NEEDS_LIVE_JOB

    def run_action(self, request: ActionRequest, confirmation: Confirmation) -> AsyncIterator[ActionUpdate]:
        raise NEEDS_LIVE_JOB

    async def watch_audit(self, since: int | None = 0) -> AsyncIterator[AuditItem]:
        """A bundle has no agents, so no audit stream: ends at once."""
        return
        yield


class LiveSource:
    """A job's agents, through ``rankscope.wire.client.JobClient``.

    ``acting``: this session may run actions (not ``--read-only``); the
    client then sends RunAction, which the agents allow only to a token of
    the 'act' role. ``act_problem`` is (message, fix) when it is already
    known that this session cannot act (read-only, or the token file holds
    no 'act' token), so the TUI says so before a person confirms anything.
    """

    live = True

    def __init__(self, agents: Sequence[str], token: str | None, *, deadline_s: float = 10.0,
                 native: bool = False, capture_timeout_s: float = 5.0, acting: bool = False,
                 act_problem: tuple[str, str] | None = None, tls: ClientTLS | None = None,
                 sample_hz: float = 0.0, hostfile: Path | None = None, evicted: Sequence[str] = (),
                 machine_names: Mapping[str, str] | None = None) -> None:
        if not agents:
            raise RankscopeError("no agents to attach to", "pass --agents host:port[,host:port...] or a hostfile")
        self.agents = tuple(agents)
        # The hostfile is re-read when it changes, so agents can be added or marked evicted while attached.
        self.hostfile = hostfile
        self._hostfile_stamp = _stamp(hostfile)
        self.evicted_addresses: frozenset[str] = frozenset(evicted)
        self.native = native
        self.capture_timeout_s = capture_timeout_s
        self.sample_hz = sample_hz  # > 0: each poll keeps the agents sampling stacks (the fail-slow view's test)
        try:
            from rankscope.wire.client import JobClient
        except ImportError as exc:
            raise RankscopeError(f"the agent client is not available ({exc})",
                                 "install rankscope[tui] (grpcio) on this machine") from None
        self._client = JobClient(self.agents, token, deadline_s=deadline_s, acting=acting, tls=tls)
        if evicted:
            self._client.set_agents(self.agents, evicted)
        # An agent evicted before this view attached was never polled: the hostfile names its machine.
        self._client.know_names(machine_names or {})
        self.label = self._members_label()
        self.act_problem = act_problem if acting else (
            "this session is read-only: it does not send actions",
            "attach without --read-only, with a token of the 'act' role (--token-file)")

    async def initial(self) -> Sequence[JobSnapshot]:
        return (await self._client.describe(),)

    async def poll(self) -> JobSnapshot | None:
        self.reread_hostfile()
        return await self._client.poll(sample_hz=self.sample_hz)

    def retire(self, addresses: Sequence[str]) -> None:
        """These agents' machines were evicted: no call reaches them any more (``JobClient.retire``)."""
        self._client.retire(addresses)
        self.evicted_addresses = self.evicted_addresses | frozenset(addresses)
        self.label = self._members_label()

    def _members_label(self) -> str:
        """The agents polled (evicted ones are not): the header read "6 agents" for 4 until the hostfile changed."""
        return f"{len(self._client.members)} agents"

    def reread_hostfile(self) -> bool:
        """Follow the hostfile when it changed: new agents are asked, ones marked evicted are retired."""
        stamp = _stamp(self.hostfile)
        if self.hostfile is None or stamp == self._hostfile_stamp:
            return False
        from rankscope.wire.agents_spec import hostfile_members

        try:
            members, evicted, names = hostfile_members(self.hostfile)
        except RankscopeError:
            return False  # being rewritten, or gone: keep the agents known until it reads again
        self._hostfile_stamp = stamp
        self._client.set_agents(members, evicted)
        self._client.know_names(names)
        self.evicted_addresses = self.evicted_addresses | frozenset(evicted)
        self.agents = tuple(self._client.agents)
        self.label = self._members_label()
        return True

    async def capture(self) -> JobSnapshot | None:
        return await self._client.capture(native=self.native, subprocesses=True, timeout_s=self.capture_timeout_s,
                                          sample_hz=self.sample_hz)

    async def close(self) -> None:
        await self._client.close()

    # Actions: plain passthroughs, so the TUI reaches agents only through the client.

    async def plan_action(self, request: ActionRequest) -> Mapping[str, ActionPlan | ActionError]:
        return await self._client.plan_action(request)

    def run_action(self, request: ActionRequest, confirmation: Confirmation) -> AsyncIterator[ActionUpdate]:
        return self._client.run_action(request, confirmation)

    def watch_audit(self, since: int | None = 0) -> AsyncIterator[AuditItem]:
        """Every agent's audit records, live (read role is enough: a read-only pane sees actions happen)."""
        return self._client.watch_all_audit(since=since)

    async def journal(self, entries: Sequence[JournalEntry] = ()) -> tuple[JournalEntry, ...]:
        """The agents' incident journal as one story; with ``entries``, written to every agent first (act role)."""
        return await self._client.journal(entries)


def _stamp(path: Path | None) -> tuple[int, int] | None:
    try:
        st = path.stat() if path is not None else None
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size) if st is not None else None


async def poll_loop(
    source: Source,
    deliver: Callable[[JobSnapshot], Awaitable[None]],
    interval_s: float,
    on_error: Callable[[BaseException], None],
    *,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Poll, deliver, then sleep what is left of the interval; never two polls at once.

    Runs until cancelled. A failing poll is reported and retried at the next
    interval, so one bad answer does not end live updates.
    """
    while True:
        started = clock()
        try:
            snap = await source.poll()
            if snap is not None:
                await deliver(snap)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # reported in the events view; the loop goes on
            on_error(exc)
        await asyncio.sleep(max(0.0, interval_s - (clock() - started)))
