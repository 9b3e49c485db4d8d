"""A source the tests push snapshots into: the app's poll loop runs against it as against agents."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from rankscope.contract.snapshot import JobSnapshot


class QueueSource:
    """Snapshots pushed by a script or a test; a poll waits for the next one.

    ``live`` is True so the app runs its poll loop against it exactly as it
    would against agents (the pilot tests of a lost and regained agent use it).
    """

    live = True

    def __init__(self, label: str = "script", initial: Sequence[JobSnapshot] = ()) -> None:
        self.label = label
        self._initial = tuple(initial)
        self._polls: asyncio.Queue[JobSnapshot] = asyncio.Queue()
        self._captures: asyncio.Queue[JobSnapshot] = asyncio.Queue()
        self.polls_started = 0
        self.captures_started = 0

    def push_poll(self, snap: JobSnapshot) -> None:
        self._polls.put_nowait(snap)

    def push_capture(self, snap: JobSnapshot) -> None:
        self._captures.put_nowait(snap)

    async def initial(self) -> Sequence[JobSnapshot]:
        return self._initial

    async def poll(self) -> JobSnapshot | None:
        self.polls_started += 1
        return await self._polls.get()

    async def capture(self) -> JobSnapshot | None:
        self.captures_started += 1
        if self._captures.empty():
            return None
        return self._captures.get_nowait()

    async def close(self) -> None:
        return None
