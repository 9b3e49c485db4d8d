"""The store: the app's state as a pure function of what it received, and the reducers that fold it.

Every snapshot (a poll or a capture) is first digested into a ``PollDigest``
(off the UI thread: it walks every rank's counters), then folded into an
immutable ``AppState`` by ``apply_*`` reducers. Widgets draw from the state
only, so the same sequence of snapshots always draws the same screens: two
engineers attached to the same agents see the same thing, and a recorded
bundle replays exactly.

The other ideas live beside it: the digest of one snapshot
(``rankscope.tui.digest``), the health rules (``rankscope.tui.health``), the
filter (``rankscope.tui.filter``), start-up classification
(``rankscope.tui.startup``), whether a verdict is stale
(``rankscope.tui.staleness``), the events told once (``rankscope.tui.story``)
and the sparklines' history (``rankscope.tui.series``).

Times shown are taken from the snapshots, never from the clock here: ``now``
is passed in (the receive time when live, the bundle's own time offline).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from rankscope.actions.model import RESTART_REQUESTED, ActionKind, ActionState, AuditRecord
from rankscope.analyzers.findings import VerdictStatus
from rankscope.analyzers.progress import HangThreshold
from rankscope.contract.ranks import compact_ranks
from rankscope.contract.snapshot import JobSnapshot, Layout
from rankscope.tui import health as hl
from rankscope.tui.analysis import StackView
from rankscope.tui.digest import CommView, JobClock, MachineView, MetricRow, PollDigest, job_clock
from rankscope.tui.failslow_state import FailSlowView
from rankscope.tui.filter import NO_FILTER, Filter, compile_filter
from rankscope.tui.health import collectives_settled, fmt_time, health, making_steps, running_capture_text
from rankscope.tui.series import HISTORY, Series
from rankscope.tui.startup import importing_stack
from rankscope.tui.state_actions import ActionsState, audit_line_text, drop_notes, log_note, log_record
from rankscope.tui.story import RESTART_SETTLE_S, Event, before_its_resumption, merged, same_moments, when_found

# Snapshots kept for `w`: bounded by ranks so 16k-rank jobs do not eat the memory.
KEPT_RANK_SNAPSHOTS = 65_536


@dataclass(frozen=True, slots=True)
class VerdictMark:
    """What the job was doing when the capture behind the verdict was taken (see ``verdict_stale``)."""

    wall: float  # the capture's time
    restarts: int  # the job's launches seen before it
    progress_mark: float | None  # the job's last progress per its agents then (with clock info)
    progress_count: int  # the summed counters then (without)
    clock_info: bool
    starting: tuple[int, ...] = ()  # ranks caught before their first step
    # The job was making steps when captured: ranks caught at different points of a step differ by timing, so
    # the capture names no suspect (a restart's first step, a view attached to a healthy job, `s` on one).
    running: bool = False
    restarting: bool = False  # taken while the job restarted (an eviction's or a hot-update's): no steady state


@dataclass(frozen=True, slots=True)
class AppState:
    now_wall: float = 0.0
    layout: Layout | None = None
    job_id: str | None = None
    world_size: int | None = None
    machines: tuple[MachineView, ...] = ()
    comms: tuple[CommView, ...] = ()
    metric_rows: tuple[MetricRow, ...] = ()
    comm_history: Series = field(default_factory=Series)  # completions per communicator
    metric_history: Series = field(default_factory=Series)  # "<machine>/cpu" and "<machine>/gpu<i>" utilisation
    progress_points: tuple[tuple[float, int], ...] = ()
    step_points: tuple[tuple[float, int], ...] = ()
    last_progress_wall: float | None = None
    stacks: StackView | None = None
    capture_wall: float | None = None
    events: tuple[Event, ...] = ()
    kept: tuple[JobSnapshot, ...] = ()
    polls: int = 0
    hung_reported: bool = False
    evicted: frozenset[str] = frozenset()  # machines an eviction took out of the job (from the audit logs)
    restarts: int = 0  # times the job's ranks came back with new pids (an eviction, a hot-update, a relaunch)
    rank_pids: Mapping[int, int] = field(default_factory=dict)  # each rank's pid in the launch seen last (_restarted)
    rank_machines: Mapping[int, str] = field(default_factory=dict)  # the machine each rank was last seen on
    clock: JobClock | None = None  # the job's state per its agents (None: they do not report it)
    verdict: VerdictMark | None = None  # what the job was doing when ``stacks`` was captured
    evicted_addresses: frozenset[str] = frozenset()  # agents taken out of the job (hostfile, audit)
    awaiting_restart: bool = False  # an eviction succeeded and the job has not come back yet: not "finished"
    restart_seen_wall: float | None = None  # when this view last saw the job restart (new pids)
    # The launch before the restart last progressed then: a restarted rank's mark no newer than it is that launch's
    # (a parked process of a warm restart read with its rank's counters of before), not the new launch's first step.
    progress_before_restart: float | None = None
    # Machines whose agents went away while the job restarted: "restarting" (not lost) until they answer again,
    # also after the job's ranks came back (an idle standby's agent, one slower than the rest).
    restarting: frozenset[str] = frozenset()
    # What the session is (fixed at start): drawn in the header and deciding what the screens offer.
    source_label: str = ""
    read_only: bool = False
    hang_after_s: float = 30.0  # no progress this long is a hang at the latest (the one setting: --hang-after)
    # The job's rhythm, which sets the hang threshold, read from the latest reading alone (``health.hang_threshold``):
    # the longest step its ranks' counters last timed, and whether every collective they launched has completed.
    rhythm_step_s: float | None = None
    collectives_settled: bool = False
    # What the person and the services set (apply_filter, apply_failslow, apply_audit, ...).
    filter: Filter = NO_FILTER
    failslow: FailSlowView | None = None  # the fail-slow detectors' latest view (view 7)
    actions: ActionsState = field(default_factory=ActionsState)
    # Capture scheduling (see ``capture_due``): a capture is running; the automatic capture waits for the job's
    # first step; the job's ranks have shown counters; the progress mark whose stop was captured already.
    capturing: bool = False
    capture_after_start: bool = False
    job_counts: bool = False
    hang_captured_for: float | None = None
    refreshed_for: frozenset[int] = frozenset()  # the running ranks a refresh capture was taken for
    refresh_tries: int = 0  # how many refresh captures were taken for that same set

    @property
    def hang(self) -> HangThreshold:
        """No progress this long is a hang: the job's own rhythm, at most ``hang_after_s``."""
        return hl.hang_threshold(self.rhythm_step_s, self.collectives_settled, self.hang_after_s)

    @property
    def hang_threshold_s(self) -> float:
        return self.hang.seconds

    @property
    def lost(self) -> tuple[str, ...]:
        """Machines whose agent does not answer; evicted ones are not lost, they were taken out on purpose."""
        return tuple(m.name for m in self.machines if not m.reachable and not m.evicted and m.name not in self.restarting)

    @property
    def job_machines(self) -> tuple[MachineView, ...]:
        return tuple(m for m in self.machines if not m.evicted)

    def machine_of_rank(self) -> dict[int, str]:
        return {r: m.name for m in self.machines for r in m.ranks}


def apply_journal(state: AppState, entries: Iterable[Event | tuple[float, str, str]]) -> AppState:
    """The agents' journal (events, or (wall, kind, text)): what happened before this view attached, as events, each
    once. A hang or a restart this view also saw for itself is told in the journal's words (the acting view's), so
    the views of a pair tell one story; a restart is told before the resumption the journal stamped earlier."""
    told = [e if isinstance(e, Event) else Event(*e) for e in entries]
    # What starts a new chapter is looked for in the journal too: read before this view saw the hot-update's
    # restart itself, the journal's "training runs again" after it read as this view's own line of the eviction's
    # restart (no restart between them in this view's events), and that line was dropped.
    pool = (*state.events, *told)
    mine = {id(e) for e in state.events}
    own = {id(m) for e in told for m in same_moments(pool, e) if id(m) in mine}
    if own:
        state = replace(state, events=tuple(e for e in state.events if id(e) not in own))
    events = merged(state.events, told)
    moved = tuple(replace(e, wall=before_its_resumption(events, e.wall)) if e.kind == "restarted" else e
                  for e in events)
    if moved != events:
        events = tuple(sorted(moved, key=lambda e: e.wall))
    return replace(state, events=events)


_UPDATE_TARGET = re.compile(r" to (.+) \((?:immediate|lazy)\)$")


def code_version(state: AppState) -> str | None:
    """The code the job runs since its latest hot-update or rollback that succeeded (None: none seen)."""
    for record in reversed(state.actions.log.history()):
        if record.result == ActionState.SUCCEEDED.value:
            m = _UPDATE_TARGET.search(record.what)
            return m.group(1) if m else None
    return None


def apply_snapshot(state: AppState, d: PollDigest, now_wall: float) -> AppState:
    """Fold one poll (or the counters and metrics of a capture) into the state."""
    hang_after_s = state.hang_after_s
    events: list[Event] = []
    before = {m.name: m.reachable for m in state.machines}
    # Just after a restart a view saw, the old agents finish their grace and the new ones take their ports: an agent
    # may answer, go and come back. One view caught that flap, its pair did not; it is still the restart.
    settling = state.awaiting_restart or (state.restart_seen_wall is not None
                                          and now_wall - state.restart_seen_wall < RESTART_SETTLE_S)
    for m in d.machines:
        if m.name in state.evicted or m.address in state.evicted_addresses:
            continue  # its agent going away is the eviction's doing, not news
        was = before.get(m.name)
        if (was is False and m.reachable and m.name in state.restarting) or \
                (was is True and not m.reachable and settling):
            # The launcher restarts the job's agents with it (an eviction, a hot-update): the header and the map say
            # "restarting", and Events tell the restart once ("restarted", in the journal's words). Which agents one
            # view happened to find away or back at its polls is no part of the story: two views of a pair listed
            # different "restarting with the job" rows for one restart.
            continue
        if was is True and not m.reachable:
            events.append(Event(now_wall, "lost", f"agent {m.name} ({m.address}) lost: {m.error or 'no answer'}"))
        elif was is False and m.reachable:
            events.append(Event(now_wall, "found", f"agent {m.name} ({m.address}) is back"))
        elif was is None and not m.reachable:
            events.append(Event(now_wall, "lost", f"agent {m.name} ({m.address}) unreachable: {m.error or 'no answer'}"))
    # A lost machine keeps its last known ranks and metrics so the map keeps its shape.
    old = {m.name: m for m in state.machines}
    machines = tuple(
        replace(old[m.name], reachable=False, error=m.error) if not m.reachable and m.name in old else m
        for m in d.machines
    )
    names = {m.name for m in machines}
    addresses = {m.address for m in machines}
    # A machine missing from this poll is kept (lost), unless its agent now answers under its name: an agent that
    # did not answer a view's first poll was known by its address, and that stand-in stayed as a 7th machine.
    machines += tuple(replace(m, reachable=False, error="missing from the last poll") for m in state.machines
                      if m.name not in names and m.address not in addresses)
    machines = _mark_evicted(machines, state.evicted, state.evicted_addresses)
    metric_rows = _mark_evicted_rows(d.metric_rows, frozenset(m.name for m in machines if m.evicted))
    # Ranks whose machine answers and runs none of the job's ranks now: they ended, and no new process of theirs
    # is seen yet.
    answering = {m.name for m in machines if m.reachable and not m.evicted and not m.ranks}
    emptied = frozenset(r for r, name in state.rank_machines.items() if name in answering)
    restarted, between, rank_pids = _restarted(state.rank_pids, machines, emptied)
    rank_machines = {**state.rank_machines, **{r: m.name for m in machines if m.reachable for r in m.ranks}}
    clock = job_clock(machines)
    restarting = frozenset(
        m.name for m in machines if not m.reachable and not m.evicted
        and ((m.name in state.restarting and settling) or (settling and before.get(m.name) is not False)))
    for m in machines:
        if m.name in state.restarting and m.name not in restarting and not m.reachable and not m.evicted:
            # The restart settled without it: now it is news.
            events.append(Event(now_wall, "lost", f"agent {m.name} ({m.address}) did not come back after the "
                                                  f"restart: {m.error or 'no answer'}"))
    if restarted:
        # A warm restart resumes the job before every machine's agent is back: those are named too, in place.
        on = ", ".join(m.name if m.reachable else f"{m.name} (agent not back yet)" for m in machines
                       if not m.evicted and (m.ranks or not m.reachable))
        # The machines first: at the end of a long line a notification covered the standbys that joined.
        version = code_version(state)
        code = f"; code {version}" if version else ""
        # Ranks that now run on another machine (a standby took an evicted machine's place): said, not left to
        # the rank map to show silently. Where each rank was last seen: between the launches its machine answers
        # with no ranks, and every rank read as moved to where it had always been.
        was_on = state.rank_machines
        moved_ranks: dict[str, list[int]] = {}
        for m in machines:
            if m.reachable and not m.evicted:
                for r in m.ranks:
                    if was_on.get(r) != m.name:
                        moved_ranks.setdefault(m.name, []).append(r)
        placed = "".join(f"; ranks {compact_ranks(sorted(rs), 6)} now on {name}"
                         for name, rs in sorted(moved_ranks.items()))
        # Told before the journal's "resumed from step N" of this restart when that came first: the ranks report
        # their step before a view's poll finds their new pids. (Not at the ranks' start: a warm restart's ranks
        # were parked processes, started long before.)
        events.append(Event(before_its_resumption(state.events, now_wall), "restarted",
                            f"the job restarted on {on}: its ranks run under new pids{placed}{code}"))
        # Counters start again in the new processes: the old progress and step points would read as a
        # hang or a negative rate.
        state = replace(state, progress_points=(), step_points=(), last_progress_wall=None, hung_reported=False,
                        progress_before_restart=state.last_progress_wall)
    metric_history = state.metric_history.pushed(d.metric_keys, d.metric_values)
    comms = d.comms if d.comms else state.comms
    comm_history = state.comm_history.pushed(d.comm_keys, d.comm_values) if d.comms else state.comm_history
    progress_points = (*state.progress_points, (d.wall, d.progress))[-HISTORY:]
    step_points = state.step_points
    if d.steps is not None:
        step_points = (*step_points, (d.wall, d.steps))[-HISTORY:]
    last_progress = state.last_progress_wall
    hung_reported = state.hung_reported
    # Settled: the counters stand still (no more completions than the reading before: a rank's file gone at its
    # exit is none) and every collective launched has completed. While the job moves, the rhythm alone.
    still = not state.progress_points or d.progress <= state.progress_points[-1][1]
    settled = still and collectives_settled(comms)
    threshold = hl.hang_threshold(d.longest_step_s, settled, hang_after_s).seconds
    if clock is not None:
        # The agents remember when the job last progressed: a view attached late says what an early one says.
        # After a restart, a mark no newer than the launch before's last progress is that launch's: by hand after a
        # hot-update's warm restart it was taken for the first step, stamped at the restart, and told nowhere.
        floor = state.progress_before_restart if last_progress is None else None
        mark = clock.progress_mark if floor is None or (clock.progress_mark or 0.0) > floor else None
        moved = mark is not None and (last_progress is None or mark > last_progress)
        if moved and last_progress is None and state.restarts + restarted > 0:
            # No time in the words: each view saw the first step at its own poll ("first step at 07:53:02" in one
            # view, "07:53:00" in its pair), and the row's time says when.
            # Stamped at the first step itself, as the restart at its start: in the order things happened.
            events.append(Event(when_found(mark, now_wall, (*state.events, *events)), "resumed",
                                "training runs again after the restart", observed=True))
        elif moved and hung_reported and not between and not state.awaiting_restart:
            # Not between an eviction and the restart it brings, nor in a poll that caught two launches: the new
            # launch's first step is the restart's, told once the restart is seen (a pair's read-only view logged
            # "progress resumed" there, its acting view the restart).
            events.append(Event(now_wall, "resumed", "progress resumed", observed=True))
        if moved and not between and not state.awaiting_restart:
            hung_reported = False
        last_progress = mark
        age: float | None
        since: float | None
        if mark is None and clock.progress_mark is not None:
            # Restarted, no step of the new launch yet: its start is the restart this view saw, judged by the ceiling.
            seen = now_wall if restarted or state.restart_seen_wall is None else state.restart_seen_wall
            age, known, limit, since = now_wall - seen, True, hang_after_s, seen
        else:
            age = clock.progress_age_s if mark is not None else clock.start_age_s
            known = mark is not None or bool(clock.starting)  # else: nothing tells a hang from a start
            # A stall is judged by the job's rhythm; a start (no progress yet) by the ceiling: imports take their time.
            limit = threshold if mark is not None else hang_after_s
            since = mark if mark is not None else clock.start_mark
        # Not between an eviction or hot-update and its restart: no progress then is the restart's (health: "restarting").
        if clock.running and known and not moved and not hung_reported and age is not None and age >= limit \
                and not state.awaiting_restart:
            events.append(Event(now_wall, "hung", f"no progress since {fmt_time(since)}"))
            hung_reported = True
    else:
        moved = not state.progress_points or d.progress != state.progress_points[-1][1]
        if moved or last_progress is None:
            last_progress = d.wall
        if moved and hung_reported and state.progress_points and not between and not state.awaiting_restart:
            events.append(Event(now_wall, "resumed", "progress resumed", observed=True))
            hung_reported = False
        elif not moved and not hung_reported and d.wall - last_progress >= threshold and d.progress > 0 \
                and not state.awaiting_restart:
            events.append(Event(now_wall, "hung", f"no progress since {fmt_time(last_progress)}"))
            hung_reported = True
    world = d.world_size or state.world_size
    limit = max(2, KEPT_RANK_SNAPSHOTS // max(1, world or 1))
    kept = (*state.kept, d.snapshot)[-limit:]
    return replace(
        state,
        now_wall=now_wall,
        layout=d.snapshot.layout or state.layout,
        job_id=d.snapshot.job_id or state.job_id,
        world_size=world,
        machines=machines,
        comms=comms,
        metric_rows=metric_rows,
        comm_history=comm_history,
        metric_history=metric_history,
        progress_points=progress_points,
        step_points=step_points,
        rhythm_step_s=d.longest_step_s,
        collectives_settled=settled,
        last_progress_wall=last_progress,
        events=merged(state.events, events),
        kept=kept,
        polls=state.polls + 1,
        hung_reported=hung_reported,
        restarts=state.restarts + (1 if restarted else 0),
        rank_pids=rank_pids,
        rank_machines=rank_machines,
        clock=clock,
        awaiting_restart=state.awaiting_restart and not restarted,
        restart_seen_wall=now_wall if restarted else state.restart_seen_wall,
        restarting=restarting,
    )


def _mark_evicted(machines: tuple[MachineView, ...], evicted: frozenset[str],
                  addresses: frozenset[str] = frozenset()) -> tuple[MachineView, ...]:
    """Evicted machines (by name, or by agent address) hold no ranks (theirs run elsewhere now) and go last."""
    out = [m for m in machines if m.name in evicted or m.address in addresses]
    if not out:
        return machines
    kept = tuple(m for m in machines if not (m.name in evicted or m.address in addresses))
    gone = tuple(replace(m, evicted=True, ranks=(), pids=(), starting=(), unknown=()) for m in out)
    return kept + gone


def _mark_evicted_rows(rows: tuple[MetricRow, ...], evicted: frozenset[str]) -> tuple[MetricRow, ...]:
    """The metrics view's rows of evicted machines say so and go last (their agents answer no more: not lost)."""
    if not evicted or not any(r.machine in evicted for r in rows):
        return rows
    return (tuple(r for r in rows if r.machine not in evicted)
            + tuple(replace(r, evicted=True, outliers=frozenset()) for r in rows if r.machine in evicted))


def _restarted(known: Mapping[int, int], machines: Sequence[MachineView],
               emptied: frozenset[int] = frozenset()) -> tuple[bool, bool, Mapping[int, int]]:
    """Whether the job's ranks came back as new processes, whether the poll caught two launches at once (or a
    launch not whole), and each rank's pid in the launch known now.

    Restarted: none of the ranks seen now has its pid of the launch before, and no rank of ``emptied`` (ranks
    whose machine answers and runs none of the job's ranks now) is missing from them. Ranks that ended cleanly
    after the job's last step leave some ranks behind for a moment under other pids (a process of the rank that
    outlived it, carrying its rank variables): with the other machines empty that is the job ending, not a
    launch, and it was told as "the job restarted on standby-0, standby-1" after the job had finished. A real
    launch is told once its ranks are back on those machines too (the next polls).
    A poll in the middle of a restart can catch both launches (a standby's new
    ranks beside a survivor's old ones): no restart yet, and the new pids are
    not taken in, so the poll that sees every rank new tells the restart. (Taken
    in, the next poll found those ranks unchanged: the restart went unseen in
    the view that happened to poll then, which logged "progress resumed" where
    its pair logged the restart.) A rank's pid is remembered across polls where
    it is not seen (agents restarting with the job, a job between its stop and
    its start).
    """
    seen = {r: pid for m in machines if m.reachable for r, pid in zip(m.ranks, m.pids, strict=False)}
    if not seen:
        return False, False, known
    both = seen.keys() & known.keys()
    changed = [r for r in both if known[r] != seen[r]]
    if both and len(changed) == len(both):
        if emptied - seen.keys():  # not a whole launch (yet): the launch before stays the one to compare with
            return False, True, {**seen, **known}
        return True, False, {**known, **seen}
    if changed:  # two launches at once: the launch before stays the one to compare with
        return False, True, {**seen, **known}
    return False, False, {**known, **seen}


def apply_evicted(state: AppState, machines: Iterable[str], now_wall: float, addresses: Iterable[str] = ()) -> AppState:
    """An eviction of ``machines`` succeeded (an agent's audit log), or the hostfile marks ``addresses`` evicted."""
    new = frozenset(machines) - state.evicted
    new_addresses = frozenset(addresses) - state.evicted_addresses
    if not new and not new_addresses:
        return state
    evicted = state.evicted | new
    evicted_addresses = state.evicted_addresses | new_addresses
    names = sorted((new | {m.name for m in state.machines if m.address in new_addresses}) - state.evicted)
    events = [Event(now_wall, "evicted", f"evicted {' '.join(names)}: out of the job, its ranks restart elsewhere")] \
        if names else []
    s = replace(state, evicted=evicted, evicted_addresses=evicted_addresses,
                machines=_mark_evicted(state.machines, evicted, evicted_addresses),
                events=merged(state.events, events), awaiting_restart=state.awaiting_restart or bool(new))
    # A note on an evicted machine's audit stream (its agent stopped as the eviction ran) is no longer news.
    return replace(s, actions=replace(s.actions, log=drop_notes(s.actions.log, _evicted_addresses(s))))


def capture_text(captured: int, view: StackView, running: bool = False) -> str:
    """The capture's event: how many ranks' stacks came back and how many of them the analysis could compare.

    "captured 4 ranks' stacks, 1 groups" stood beside "no verdict: all 1 ranks show the same stacks": three of the
    four had no readable stack (a process exiting, a rank starting), which the verdict counts and the event did not.
    ``running``: the job was making steps, so how many groups its ranks fell in is timing, and two views capturing
    a moment apart would log different counts of one moment: no count of groups then.
    """
    read = sum(len(g.ranks) for g in view.groups)
    groups = f"{len(view.groups)} group{'' if len(view.groups) == 1 else 's'}"
    head = f"captured {captured} ranks' stacks" + (" of a job making steps" if running else "")
    if read >= captured:
        return head if running else f"{head}, {groups}"
    why = "; ".join(f"{compact_ranks(ranks, 4)}: {reason}" for ranks, reason in view.unreadable[:2])
    return (f"{head}, {read} readable{'' if running else f' in {groups}'}; {captured - read} could not be read"
            + (f" ({why})" if why else ""))


def apply_capture(state: AppState, d: PollDigest, view: StackView, now_wall: float) -> AppState:
    """A capture carries stacks: fold its counters in, then its analysis, and log verdict changes.

    The verdict is marked with what the job was doing at the capture, so it
    can be told stale later (``verdict_stale``). Ranks caught before their
    first step (importing, at rendezvous) are noted: their stacks are not a
    steady state to compare, unless they have been starting for longer than
    ``hang_after_s`` (then never reaching a step is the problem).
    """
    s = apply_snapshot(state, d, now_wall)
    hang_after_s = s.hang_after_s
    # Whether the capture caught the job making steps: the analysis' judgement where the snapshot carries the agents'
    # progress marks, else the polls' progress counts while the job reads healthy.
    running = view.timing_not_fault if view.progress is not None else \
        health(s).kind in ("healthy", "slow") and making_steps(s)
    events = [Event(now_wall, "capture", capture_text(len(d.snapshot.all_stacks()), view, running))]
    if not any(g.ranks for g in view.groups) and (state.awaiting_restart or s.restarting):
        # Between the old processes and the new there is nobody to read (no rank listed, or each listed one's
        # process ended during the capture): "captured 4 ranks' stacks, 0 readable" and "no verdict: no rank's
        # stacks could be read" are no news of the incident, and rows its pair did not log.
        events = []
    elif running:
        events.append(Event(now_wall, "verdict", running_capture_text(view), names_nobody=True))
    elif state.stacks is None or state.stacks.verdict.summary != view.verdict.summary:
        nobody = view.verdict.status in (VerdictStatus.NO_VERDICT, VerdictStatus.TIMING)
        events.append(Event(now_wall, "verdict", view.verdict.summary, names_nobody=nobody))
    # Quiet ranks (no step yet in their process) caught importing are starting however long their imports take
    # on a loaded host: a capture of them named a rank "computing" in <module> (pstats.py) and aimed `e` at it.
    importing = {r for r, st in d.snapshot.all_stacks().items() if importing_stack(st)}
    starting = tuple(sorted(r for m in d.machines if m.reachable and m.start_age_s is not None
                            and m.name not in s.evicted and m.address not in s.evicted_addresses
                            for r in (*m.starting, *m.unknown)
                            # A rank with no counters and an ordinary stack is not known to be starting, however
                            # young: were it, a job without counters that hangs early could never be acted on.
                            if (r in m.starting and m.start_age_s < hang_after_s) or r in importing))
    clock = s.clock
    mark = VerdictMark(d.wall, s.restarts, clock.progress_mark if clock is not None else None, d.progress,
                       clock is not None, starting, running, state.awaiting_restart)
    s = replace(s, stacks=view, capture_wall=d.wall, verdict=mark, events=merged(s.events, events))
    # A text filter matches frames: against the new capture's groups it selects other ranks.
    return apply_filter(s, s.filter.text) if s.filter.active else s


def apply_poll(state: AppState, d: PollDigest, now_wall: float) -> AppState:
    """The app's handling of one poll (``SnapshotReceived``): its readings folded in; when they show the job
    restarted, the automatic capture waits for the new processes' first step (the stacks on screen are of
    processes that are gone, and ranks importing or at rendezvous are no steady state to compare); and whether the
    job's ranks have shown counters is kept. ``schedule.started_capture_due`` then says whether that capture goes now."""
    restarts = state.restarts
    s = apply_snapshot(state, d, now_wall)
    if s.restarts != restarts:
        s = apply_await_start(s)
    return apply_counters_seen(s, d)


def apply_series(state: AppState, readings: Iterable[tuple[PollDigest, StackView | None, float]]) -> AppState:
    """Readings the app loads at once (a recorded series, or a live view's first), in order: (digest, the capture's
    analysis or None for a poll, now). A capture is folded with its analysis, a poll as its readings."""
    for d, view, now_wall in readings:
        state = apply_snapshot(state, d, now_wall) if view is None else apply_capture(state, d, view, now_wall)
    return state


def apply_capture_analyzed(state: AppState, d: PollDigest, view: StackView, now_wall: float) -> AppState:
    """The app's handling of an analyzed capture (``CaptureAnalyzed``): the capture has ended, and its readings and
    analysis are folded in."""
    return apply_capture(apply_capture_ended(state), d, view, now_wall)


def apply_failure(state: AppState, what: str, message: str, now_wall: float) -> AppState:
    return replace(state, events=merged(state.events, [Event(now_wall, what, message)]))


def apply_info(state: AppState, message: str, now_wall: float) -> AppState:
    return apply_failure(state, "info", message, now_wall)


def apply_source_label(state: AppState, label: str) -> AppState:
    """What the source reaches, as the header names it ("4 agents", "bundle x.json")."""
    return replace(state, source_label=label)


def apply_filter(state: AppState, text: str) -> AppState:
    """The person typed a filter (`/`); the empty text clears it."""
    return replace(state, filter=compile_filter(text, state.machines, state.stacks))


# --------------------------------------------------------------------------
# what the services post: fail-slow views, audit records, action progress
# --------------------------------------------------------------------------


def apply_failslow(state: AppState, view: FailSlowView) -> AppState:
    """The fail-slow detectors produced a newer view (they compute off the UI thread and post it); a confident
    verdict naming other machines than the last one is logged (the slowdown found, or cleared)."""
    named = slow_machines(view)
    if named == slow_machines(state.failslow):
        return replace(state, failslow=view)
    v = view.verdict
    if named and v is not None:
        text = f"slow: {' '.join(named)} — {v.verdict.summary}"
    else:
        text = "the fail-slow detectors name no machine now"
    return replace(state, failslow=view, events=merged(state.events, [Event(state.now_wall, "verdict", text,
                                                                            slow=named)]))


def slow_machines(view: FailSlowView | None) -> tuple[str, ...]:
    """The machines a confident fail-slow verdict names (empty: none)."""
    v = view.verdict if view is not None else None
    return v.machines if v is not None and v.confident else ()


def apply_audit(state: AppState, address: str, record: AuditRecord) -> AppState:
    """An agent's audit record: a line of the Actions view and an event; a succeeded eviction marks its machines.

    A record seen before (a resumed stream replays from the start) changes nothing.
    """
    log = log_record(state.actions.log, address, record)
    if log is state.actions.log:
        return state
    s = replace(state, actions=replace(state.actions, log=log))
    if record.result != "progress":  # each step of a running action is the Actions view's; Events keep the story
        s = apply_failure(s, "action", audit_line_text(record), record.when)
    if record.kind == ActionKind.EVICT and record.result == ActionState.SUCCEEDED.value:
        s = apply_evicted(s, record.machines, record.when)
    elif record.kind in (ActionKind.HOT_UPDATE, ActionKind.ROLLBACK) and RESTART_REQUESTED in record.message and \
            record.result == ActionState.SUCCEEDED.value:
        # The launcher restarts the job in place on the new code: its agents going away meanwhile is "restarting".
        s = replace(s, awaiting_restart=True)
    return s


def apply_audit_note(state: AppState, address: str, text: str) -> AppState:
    """Why an agent's audit stream is missing (shown under the Actions summary; ``text`` empty: its stream is open
    again). Not for an evicted machine's agent: its stream is no longer followed, and its agent stopping with it
    is no problem to show."""
    if not text:
        return replace(state, actions=replace(state.actions, log=drop_notes(state.actions.log, frozenset({address}))))
    if address in _evicted_addresses(state):
        return state
    if state.awaiting_restart:
        text = f"audit of {machine_name(state, address)}: restarting with the job — reconnecting"
    return replace(state, actions=replace(state.actions, log=log_note(state.actions.log, address, text)))


def machine_name(state: AppState, address: str) -> str:
    """The machine an agent address speaks for (the address itself when no poll named it): toasts name machines."""
    return next((m.name for m in state.machines if m.address == address), address)


def _evicted_addresses(state: AppState) -> frozenset[str]:
    """The agents out of the job: marked evicted by address (hostfile), or speaking for an evicted machine."""
    return state.evicted_addresses | {m.address for m in state.machines if m.name in state.evicted}


def apply_actions(state: AppState, actions: ActionsState) -> AppState:
    """The actions part replaced (``rankscope.tui.state_actions``: a confirm begun or answered, a run ended)."""
    return replace(state, actions=actions)


# --------------------------------------------------------------------------
# capture scheduling: when the app captures by itself
# --------------------------------------------------------------------------


def apply_capture_begun(state: AppState) -> AppState:
    return replace(state, capturing=True)


def apply_capture_ended(state: AppState) -> AppState:
    """A capture was analyzed or failed: another may start."""
    return replace(state, capturing=False)


def apply_await_start(state: AppState) -> AppState:
    """The job restarted (or was starting when attached): the automatic capture waits for its first step --
    ranks importing or at rendezvous are no steady state to compare, and no hang capture fires meanwhile."""
    return replace(state, capture_after_start=True)


def apply_counters_seen(state: AppState, d: PollDigest) -> AppState:
    """A poll: once the job's ranks have shown counters, a rank with none yet is still starting."""
    counts = state.job_counts or d.steps is not None or bool(d.comms)
    return state if counts == state.job_counts else replace(state, job_counts=counts)


def apply_started_captured(state: AppState) -> AppState:
    return replace(state, capture_after_start=False)


def apply_hang_captured(state: AppState) -> AppState:
    """The current stop is being captured: no second capture for it."""
    return replace(state, hang_captured_for=state.last_progress_wall)


def apply_refresh_captured(state: AppState, missing: frozenset[int]) -> AppState:
    """A capture is taken for running ranks the one on screen misses (counted per set: ``schedule.REFRESH_TRIES``)."""
    tries = state.refresh_tries + 1 if missing == state.refreshed_for else 1
    return replace(state, refreshed_for=missing, refresh_tries=tries)
