"""The app's data workers and the handlers of what they (and the services) post.

- the first load reads the source's initial snapshots (a bundle's series, a live job's first reading), digests them
  in a thread and starts the rest;
- the poll worker (async) awaits ``Source.poll``, digests the snapshot in a thread, posts ``SnapshotReceived`` and
  only then schedules the next poll, so polls never overlap and a lost agent only delays the next one;
- captures (`s`, a stop in progress, or every 10 s in fail-slow mode) run in their own worker; the stack analysis
  runs in a thread;
- each handler folds its message into the store by a reducer of ``rankscope.tui.state`` and redraws.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import replace

from rankscope.contract.errors import RankscopeError
from rankscope.contract.heap import settle
from rankscope.contract.snapshot import JobSnapshot, Layout
from rankscope.tui import digest as dg
from rankscope.tui import health as hl
from rankscope.tui import schedule, staleness
from rankscope.tui import state as st
from rankscope.tui.analysis import StackView, build_stack_view
from rankscope.tui.app_part import AppPart
from rankscope.tui.failslow_state import FailSlowUpdated
from rankscope.tui.messages import (
    ActionChanged,
    AgentFound,
    AgentLost,
    AuditNoted,
    AuditReceived,
    CaptureAnalyzed,
    CaptureFailed,
    PollFailed,
    SnapshotReceived,
)
from rankscope.tui.screens.pair import pair_hint
from rankscope.tui.sources import poll_loop
from textual import work

FAIL_SLOW_CAPTURE_S = 10.0  # ByteRobust's fail-slow rounds: aggregate every 10 s


class WorkersPart(AppPart):
    def _now(self, snapshot_wall: float | None = None) -> float:
        # Offline, "now" is the bundle's own time, so a replay draws the same screen every time.
        if not self.source.live and snapshot_wall is not None:
            return snapshot_wall
        return self.clock()

    @work(group="load")
    async def _load(self) -> None:
        try:
            initial = list(await self.source.initial())
        except RankscopeError as exc:
            if not self.source.live:  # a bundle that cannot be read: leave with the reason and the fix, like the CLI
                self.exit(return_code=2, message=f"rankscope attach: error: {exc.message}\n  fix: {exc.fix}")
                return
            self.state = st.apply_failure(self.state, "poll-failed", f"first contact failed: {exc.message}",
                                          self.clock())
            initial = []
        except Exception as exc:
            self.state = st.apply_failure(self.state, "poll-failed", f"first contact failed: {exc}", self.clock())
            initial = []
        layout = self.options.layout
        if self.options.pair_command:
            self.state = st.apply_info(self.state, f"key P shows it in full: {pair_hint(self.options.pair_command)}",
                                       self.clock())
        settle()  # what the last snapshot made, out of the collector's way (rankscope.contract.heap)
        steps = await asyncio.to_thread(_digest_series, initial, layout)
        # Agents the hostfile marks evicted (before this view attached) are evicted from the first reading on,
        # never "lost": the first poll's stand-ins for them read as agents that stopped answering.
        self._fold_evicted_addresses()
        self.state = st.apply_series(self.state, ((d, view, self._now(d.wall)) for d, view in steps))
        before = sorted(m.name for m in self.state.machines if m.evicted)
        if before:
            self.state = st.apply_info(self.state, f"evicted before this view attached (the hostfile marks them): "
                                                   f"{' '.join(before)}", self.clock())
        self.failslow.feed_series((d.snapshot, view) for d, view in steps)  # a recorded series replays through them
        self.redraw()
        self.main.focus_view()
        self.loaded.set()
        self.actions.start_watch()  # read-only sessions too: a pair's second pane sees actions happen
        self._read_journal_at_attach()
        if self.source.live:
            self._poll()
            if self.options.capture_on_start:
                # Only ranks known to be before their first step (counters without one) wait: a young rank with
                # no counters may be hung already, and its stack is all there is to tell.
                clock = self.state.clock
                if clock is not None and clock.starting and \
                        hl.health(self.state).kind == "starting":
                    self.state = st.apply_await_start(self.state)
                else:
                    self.action_capture()

    @work(group="poll", exclusive=True)
    async def _poll(self) -> None:
        async def deliver(snap: JobSnapshot) -> None:
            settle()
            d = await asyncio.to_thread(dg.digest, snap)
            self.post_message(SnapshotReceived(d, self.clock()))

        def failed(exc: BaseException) -> None:
            self.post_message(PollFailed(f"{type(exc).__name__}: {exc}", self.clock()))

        await poll_loop(self.source, deliver, self.options.poll_interval_s, failed)

    # -- messages -----------------------------------------------------------

    def retire_machines(self, machines: Iterable[str]) -> None:
        """Evicted machines leave every fan-out of the source (plans, backups, hot-updates, audit streams)."""
        names = set(machines)
        addresses = [m.address for m in self.state.machines if m.name in names]
        retire = getattr(self.source, "retire", None)
        if addresses and callable(retire):
            retire(addresses)

    def _fold_evicted_addresses(self) -> None:
        """The agents the source marks evicted (its hostfile, read at attach or re-read since) into the state."""
        evicted: frozenset[str] = getattr(self.source, "evicted_addresses", frozenset())
        if evicted - self.state.evicted_addresses:
            self.state = st.apply_evicted(self.state, (), self.clock(), evicted)

    def on_snapshot_received(self, message: SnapshotReceived) -> None:
        self._fold_evicted_addresses()  # a re-read hostfile may have marked agents evicted
        before = {m.name: m.reachable for m in self.state.machines}
        quiet = self.state.restarting  # agents away for a restart: no "lost"/"is back" toasts for them
        restarts = self.state.restarts
        self.state = st.apply_poll(self.state, message.digest, self._now(message.digest.wall))
        if self.state.restarts > restarts:
            # A restarted job is a new series: the old one's ranks, machines and slow history (an evicted slow
            # machine above all) would be judged again on the new processes.
            self.failslow.restart()
        self._follow_journal()  # the story others write while it may still change (schedule.journal_read_due)
        if schedule.started_capture_due(self.state):
            self.state = st.apply_started_captured(self.state)
            self.action_capture()
        quiet |= self.state.restarting
        for m in self.state.machines:
            if m.name in quiet:
                continue
            if before.get(m.name) is True and not m.reachable and not m.evicted:
                self.post_message(AgentLost(m.name))
            elif before.get(m.name) is False and m.reachable:
                self.post_message(AgentFound(m.name))
        if not self.state.awaiting_restart:
            # Between an eviction or a hot-update and the restart it brings, a poll reads a job being stopped (its
            # ranks exiting machine by machine): nothing to judge for slowness. By hand the detectors named a
            # survivor's low CPU there, a suspicion a slow restart (a requeue) would have made confident.
            self.failslow.feed(message.digest.snapshot)
        self.redraw()
        self._maybe_capture()

    def on_capture_analyzed(self, message: CaptureAnalyzed) -> None:
        self.state = st.apply_capture_analyzed(self.state, message.digest, message.view,
                                               self._now(message.digest.wall))
        mark = self.state.verdict
        if self.options.on_verdict is not None and message.view.verdict.suspects and mark is not None \
                and not mark.running and staleness.verdict_stale(self.state) is None:
            self.options.on_verdict(message.view.verdict, message.digest.wall, self.state.machine_of_rank())
        if not self.state.awaiting_restart:  # (as a poll: the job is being stopped for its restart)
            self.failslow.feed(message.digest.snapshot, message.view)  # a capture is also a stack-aggregation round
        self.redraw()

    def on_fail_slow_updated(self, message: FailSlowUpdated) -> None:
        before = st.slow_machines(self.state.failslow)
        self.state = st.apply_failslow(self.state, message.view)
        if self.options.on_verdict is not None and st.slow_machines(self.state.failslow) not in ((), before):
            slow, _ = staleness.failslow_target(self.state)
            fs = self.state.failslow.verdict if self.state.failslow is not None else None
            if slow is not None and fs is not None:
                # Graded as `e` would act on it: the machine, its degrader group one key away.
                verdict = replace(fs.verdict, suspects=(slow, *fs.verdict.suspects[1:]))
                self.options.on_verdict(verdict, self.state.now_wall, self.state.machine_of_rank())
        self.redraw()

    def on_capture_failed(self, message: CaptureFailed) -> None:
        self.state = st.apply_failure(st.apply_capture_ended(self.state), "capture-failed", message.error,
                                      message.received_wall)
        self.notify(f"capture failed: {message.error}", severity="error", timeout=6)
        self.redraw()

    def on_poll_failed(self, message: PollFailed) -> None:
        self.state = st.apply_failure(self.state, "poll-failed", message.error, message.received_wall)
        self.redraw()

    def on_audit_received(self, message: AuditReceived) -> None:
        before = self.state.evicted
        self.state = st.apply_audit(self.state, message.address, message.record)
        if self.state.evicted != before:
            self.retire_machines(self.state.evicted - before)
        self.redraw()

    def on_audit_noted(self, message: AuditNoted) -> None:
        self.state = st.apply_audit_note(self.state, message.address, message.text)
        self.redraw()

    def on_action_changed(self, message: ActionChanged) -> None:
        self.state = st.apply_actions(self.state, message.change(self.state.actions))
        self.redraw()

    # -- captures -----------------------------------------------------------

    def _maybe_capture(self) -> None:
        """Capture when progress stopped (once per stop), when the capture on screen misses running ranks (after a
        restart or a hot-update, once per set), and every 10 s in fail-slow mode."""
        if not self.source.live or self.state.capturing:
            return
        if schedule.hang_capture_due(self.state):
            self.state = st.apply_hang_captured(self.state)
            self.action_capture()
            return
        if schedule.refresh_capture_due(self.state):
            self.state = st.apply_refresh_captured(self.state, schedule.uncaptured_ranks(self.state))
            self.action_capture()
            return
        if self.options.fail_slow:
            last = self.state.capture_wall
            if last is None or self.state.now_wall - last >= FAIL_SLOW_CAPTURE_S:
                self.action_capture()

    def action_capture(self) -> None:
        if self.state.capturing:
            self.notify("a capture is already running", timeout=2)
            return
        self.state = st.apply_capture_begun(self.state)
        self._capture()

    @work(group="capture")
    async def _capture(self) -> None:
        try:
            snap = await self.source.capture()
            if snap is None:
                self.post_message(CaptureFailed("no stacks to capture from this source", self.clock()))
                return
            settle()
            d, view = await asyncio.to_thread(_digest_capture, snap, self.options.layout)
            self.post_message(CaptureAnalyzed(d, view, self.clock()))
        except Exception as exc:  # one failed capture is an event, not the end of the session
            self.post_message(CaptureFailed(f"{type(exc).__name__}: {exc}", self.clock()))
        # Either message ends the capture in the state (apply_capture_ended): no flag is set behind the store's back.


def _digest_capture(snap: JobSnapshot, layout: Layout | None) -> tuple[dg.PollDigest, StackView]:
    return dg.digest(snap), build_stack_view(snap, layout)


def _digest_series(snaps: Sequence[JobSnapshot], layout: Layout | None,
                   analyze_limit: int = 4096) -> list[tuple[dg.PollDigest, StackView | None]]:
    """Digest a bundle's series; analyze each capture while cheap, else only the last one."""
    with_stacks = [i for i, s in enumerate(snaps) if any(m.stacks for m in s.machines)]
    world = max((s.world_size or 0 for s in snaps), default=0)
    analyze = set(with_stacks) if world * len(with_stacks) <= analyze_limit else set(with_stacks[-1:])
    out: list[tuple[dg.PollDigest, StackView | None]] = []
    for i, s in enumerate(snaps):
        out.append((dg.digest(s), build_stack_view(s, layout) if i in analyze else None))
    return out
