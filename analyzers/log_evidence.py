"""Verdicts from the logs engineers paste: NCCL RAS, ProcessGroupNCCL's watchdog, fr_trace, DETAIL checks, Inspector.

The readers (``rankscope.formats.incident_logs`` and its siblings) turn each
line into one of the records of ``rankscope.contract.log_records``, with
where it came from; the rules here judge them. One rule holds for every kind of count: the ranks *behind* are
the ones to look at, never the ranks a tool happened to list (NCCL RAS lists
the minority, which may be ahead of the others; fr_trace's "culprit" is the
rank that differs from the first one it read).

- watchdog: per process group, the failing sequence number S is the work the
  timed-out ranks wait in; a rank whose last enqueued work is below S never
  issued it (behind: the suspect, the others its victims). Every rank at the
  same S with S enqueued and nothing after S-1 completed is a symmetric stall:
  "not a rank".
- RAS: per communicator and operation, the ranks at the lowest count are
  behind; ranks RAS has no data from (INCOMPLETE) or considers dead are
  suspects by host and process. Every communicator RUNNING/OK while a watchdog
  timed out: the ranks all launched the same operations, "not a rank".
- fr_trace: ranks missing from a collective are behind; a state mismatch
  blames the rank whose entry is less far along; a size/type mismatch is a
  program mismatch (eviction does not cure it).
- DETAIL fingerprint mismatch: the ranks run different collectives at one
  sequence number: a desync finding, the odd rank out when there is one.
- Inspector: a rank whose last completed collective on a communicator is
  behind its peers'; with equal counts, the rank whose collectives are
  consistently the shortest arrives last (the others wait for it).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from rankscope.analyzers.chain import DESYNC_ADVICE
from rankscope.analyzers.findings import (
    NOT_A_RANK,
    NOT_A_RANK_ADVICE,
    NOT_A_RANK_PREFIX,
    Finding,
    Suspect,
    SuspectKind,
    Verdict,
    VerdictStatus,
    suspect_order,
)
from rankscope.contract.log_records import (
    Fingerprint,
    FrCollective,
    InspectorRank,
    LogEvidence,
    MismatchReport,
    RasComm,
    RasCount,
    RasRank,
    RasReport,
    WatchdogRecord,
)
from rankscope.contract.ranks import compact_ranks
from rankscope.contract.snapshot import Communicator, OpCounters, RankCounters

SOURCE = "logs"
SCORE_BEHIND = 1.0
SCORE_MISSING = 0.9
SCORE_DESYNC = 0.95
SCORE_SLOW = 0.6

FIRST_OP_NOTE = (
    "the stalled work is the group's first collective: its ranks never finished connecting, which points at "
    "transport setup (NCCL_SOCKET_IFNAME / NCCL_IB_* settings, a firewall, a node's network interface) more "
    "than at any rank's program")


# --------------------------------------------------------------------------
# Rules
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _NoneBehind:
    """A reason no rank is behind; ``alone``: the one rank it rests on (only its watchdog lines were seen), which
    cannot tell a stall of the whole group by itself."""

    text: str
    alone: int | None = None


@dataclass(slots=True)
class _Found:
    suspects: list[Suspect] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    symmetric: list[_NoneBehind] = field(default_factory=list)  # reasons no rank is behind, one per source


def _suspect(ranks: Iterable[int], score: float, evidence: Sequence[str], *, machines: Sequence[str] = (),
             victims: Iterable[int] = (), kind: SuspectKind = SuspectKind.RANK, state: str = "",
             roots: Iterable[int] | None = None, title: str = "") -> Suspect:
    rs = tuple(sorted(set(ranks)))
    return Suspect(kind, rs, tuple(sorted(set(machines))), score, tuple(evidence), (SOURCE,),
                   victims=tuple(sorted(set(victims) - set(rs))), state=state,
                   roots=tuple(sorted(set(roots))) if roots is not None else rs,
                   title=evidence[0] if kind is SuspectKind.DESYNC and evidence else title)


@dataclass(slots=True)
class _PgRank:
    seq: int | None = None
    op: str | None = None
    enqueued: int | None = None
    completed: int | None = None
    timed_out: bool = False
    where: str = ""
    group_size: int | None = None
    pg_rank: int | None = None


def _watchdog(records: Sequence[WatchdogRecord], out: _Found, world: int | None) -> None:
    groups: dict[str, dict[int, _PgRank]] = {}
    untied: list[WatchdogRecord] = []
    for r in records:
        if r.rank is None:
            untied.append(r)
            continue
        st = groups.setdefault(r.pg, {}).setdefault(r.rank, _PgRank(where=r.where))
        if r.seq is not None and r.kind in ("timeout", "status", "blocking-wait"):
            st.seq = r.seq if st.seq is None else max(st.seq, r.seq)
            st.timed_out = True
        st.op = r.op or st.op
        st.group_size = r.group_size or st.group_size
        st.pg_rank = r.pg_rank if r.pg_rank is not None else st.pg_rank
        if r.seq is None and r.kind == "dump-signal" and r.enqueued is not None and r.completed is not None \
                and r.enqueued > r.completed:
            # A dump signal names no work, but a rank with work pending waits in the first one not completed.
            st.seq = r.completed + 1 if st.seq is None else st.seq
        if r.enqueued is not None:
            st.enqueued = r.enqueued if st.enqueued is None else max(st.enqueued, r.enqueued)
        if r.completed is not None:
            st.completed = r.completed if st.completed is None else max(st.completed, r.completed)
    if untied:
        out.notes.append(f"{len(untied)} watchdog line(s) name no global rank (no [rankN]: prefix, no rank<N> "
                         f"file name, not the default group), e.g. {untied[0].where}: not tied to a rank")
    for pg, ranks in groups.items():
        seqs = [s.seq for s in ranks.values() if s.seq is not None]
        if not seqs:
            if any(r.kind in ("timeout", "blocking-wait") for r in records if r.pg == pg):
                out.notes.append(f"the watchdog lines of {pg} name no sequence number (an old PyTorch): which "
                                 "rank is behind cannot be told from them")
            continue
        target = max(seqs)
        op = next((s.op for s in ranks.values() if s.seq == target and s.op), None)
        what = f"work {target}" + (f" ({op})" if op else "")
        behind = {r: s for r, s in ranks.items() if s.enqueued is not None and s.enqueued < target}
        waiting = [r for r, s in ranks.items() if s.seq == target]
        if behind:
            lines = [f"rank {r}: last enqueued work {s.enqueued} < {what} that {_ranks_word(waiting)} "
                     f"{'times' if len(waiting) == 1 else 'time'} out in on {pg}: it never issued it "
                     f"({s.where})" for r, s in sorted(behind.items())]
            out.suspects.append(_suspect(behind, SCORE_BEHIND, lines, victims=waiting,
                                         state="never issued the collective its group waits in"))
            continue
        early = {r: s for r, s in ranks.items() if s.seq is not None and s.seq < target}
        if early:
            lines = [f"rank {r}: timed out in work {s.seq} on {pg} while {_ranks_word(waiting)} got as far as "
                     f"{target} ({s.where})" for r, s in sorted(early.items())]
            out.suspects.append(_suspect(early, SCORE_BEHIND * 0.9, lines, victims=waiting,
                                         state="stuck in an earlier collective than its group"))
            continue
        silent = {r: s for r, s in ranks.items() if s.seq is None and s.enqueued is None}
        if silent and waiting:
            # In the logs with no work numbers: it may never have issued the work (then nothing of its own timed
            # out), or the paste left its status lines out. Said, not blamed.
            out.notes.append(f"{_ranks_word(sorted(silent))} of {pg} {'is' if len(silent) == 1 else 'are'} in the "
                             f"logs ({next(iter(silent.values())).where}) with no work numbers while "
                             f"{_ranks_word(waiting)} wait in {what}: if {'its' if len(silent) == 1 else 'their'} "
                             "full log shows no timeout and no 'last enqueued' line, it never issued the work")
            absent = _absent(pg, ranks, world)[1]
            if absent:
                out.notes.append(f"{_ranks_word(absent)}{_absent(pg, ranks, world)[2]} of {pg} "
                                 f"{'is' if len(absent) == 1 else 'are'} not in the logs")
            continue
        same = all(s.seq == target and (s.completed is None or s.completed < target) for s in ranks.values())
        if not same:
            continue
        seen = sorted(ranks)
        size, absent, numbering = _absent(pg, ranks, world)
        if absent and len(seen) > 1:
            out.notes.append(f"{_ranks_word(seen)} of {pg} all wait in {what}; {_ranks_word(absent)}{numbering} "
                             f"{'is' if len(absent) == 1 else 'are'} not in the logs: the rank behind may be among "
                             "them (their logs would tell)")
            continue
        beyond = "" if size else f"; ranks above {max(seen)}, if any, are not in the logs"
        reason = (f"every rank of {pg} in the logs ({_ranks_word(seen)}) timed out in the same {what}, "
                  f"each with it enqueued and nothing after it completed{beyond}")
        if len(seen) == 1:
            out.notes.append(f"only {_ranks_word(seen)}'s watchdog lines for {pg}: whether a rank is behind cannot be "
                             "judged from one rank; the other ranks' logs tell whether one never issued "
                             f"{what} (its last enqueued work below {target})")
            out.symmetric.append(_NoneBehind(f"rank {seen[0]}'s watchdog timed out in {what} on {pg}, which it had "
                                             f"enqueued ({ranks[seen[0]].where})", alone=seen[0]))
            continue
        out.symmetric.append(_NoneBehind(reason))
        if target <= 1:
            out.notes.append(FIRST_OP_NOTE)


def _absent(pg: str, ranks: dict[int, _PgRank], world: int | None) -> tuple[int | None, list[int], str]:
    """The group's size where known, its ranks absent from the logs, and the numbering they are in.

    Counted in the group's own numbering (a line's "[PG n Rank r]") where every line has it, else in global ranks.
    """
    size = next((s.group_size for s in ranks.values() if s.group_size), None)
    if size is None and world and ("default" in pg or pg.startswith("PG 0")):
        size = world
    places = [s.pg_rank for s in ranks.values()]
    own = sorted({p for p in places if p is not None}) if None not in places else sorted(ranks)
    default = "default" in pg or pg.startswith("PG 0")
    numbering = "" if None in places or default else " (group ranks)"
    return size, sorted(set(range(size or max(own) + 1)) - set(own)), numbering


def _ras(reports: Sequence[RasReport], out: _Found, world: int | None) -> bool:
    """The RAS rules; True when some report shows every communicator RUNNING/OK."""
    all_ok = False
    for rep in reports:
        processes = rep.processes or world
        # A process a communicator block names too is headlined by its rank and GPU there.
        in_comms = {(m.pid, m.host) for c in rep.comms for m in c.missing if m.pid is not None}
        for proc in (*rep.missing_processes, *rep.dead_processes):
            dead = proc in rep.dead_processes
            line = (f"NCCL RAS has {'declared dead' if dead else 'no communicator data from'} {proc.label()} "
                    f"({rep.where}): the process {'is unreachable' if dead else 'does not answer RAS'}; it is hung "
                    "hard (a stuck driver call, a GPU fault) or gone")
            state = "dead" if dead else "not answering RAS"
            out.suspects.append(_suspect((), SCORE_MISSING, [line], machines=[proc.host] if proc.host else (),
                                         kind=SuspectKind.MACHINE, state=state,
                                         title="" if (proc.pid, proc.host) in in_comms else _ras_title([proc], state)))
        unlisted_missing = rep.missing_process_count - len(rep.missing_processes)
        if unlisted_missing > 0:
            out.notes.append(f"NCCL RAS misses data from {rep.missing_process_count} process(es) but lists "
                             f"{len(rep.missing_processes)} ({rep.where}): run `ncclras -v` for the full list")
        for comm in rep.comms:
            job_wide = comm.size is not None and processes is not None and comm.size == processes
            _ras_comm(comm, out, job_wide, processes is not None)
        if rep.rows and all(r.status == "RUNNING" and r.errors == ("OK",) for r in rep.rows) \
                and not rep.missing_process_count and not rep.dead_process_count:
            all_ok = True
        if not rep.complete:
            out.notes.append(f"the NCCL RAS report {rep.where} is cut off: read for what it holds")
    return all_ok


def _ras_comm(comm: RasComm, out: _Found, job_wide: bool, job_size_known: bool = True) -> None:
    def rank_of(r: RasRank) -> int | None:
        return r.comm_rank if job_wide else None

    numbering = "" if job_wide else (
        " (communicator ranks, not global ranks: the communicator is not the whole job)" if job_size_known else
        " (communicator ranks: the paste does not give the job's size, so whether they are global ranks is unknown)")
    for m in comm.missing:
        line = (f"NCCL RAS has no data from {m.label()} in communicator {comm.label} ({comm.where}): not "
                "answering (hung hard) or gone")
        rank = rank_of(m)
        out.suspects.append(_suspect(() if rank is None else (rank,), SCORE_MISSING, [line],
                                     machines=[m.host] if m.host else (),
                                     kind=SuspectKind.RANK if rank is not None else SuspectKind.MACHINE,
                                     state="not answering RAS",
                                     title=_ras_title([m], "not answering RAS") if rank is None else ""))
    if comm.missing_count > len(comm.missing):
        out.notes.append(f"NCCL RAS misses data from {comm.missing_count} rank(s) of {comm.label} and names "
                         f"{len(comm.missing)} ({comm.where}): the rest cannot be tied to a rank")
    by_op: dict[str, list[RasCount]] = {}
    for c in comm.counts:
        by_op.setdefault(c.op, []).append(c)
    for op, counts in by_op.items():
        if len(counts) < 2:
            continue
        counts = sorted(counts, key=lambda c: -1 if c.value is None else c.value)
        low, top = counts[0], counts[-1]
        low_v = "no operation" if low.value is None else f"operation {low.value}"
        ahead = [c for c in counts[1:]]
        ahead_listed = [r for c in ahead for r in c.listed]
        if low.listed:
            behind = low.listed
            how = "listed by RAS"
        elif comm.size is not None and all(len(c.listed) == c.count for c in ahead):
            # RAS listed only the minority, which is ahead: the behind ones are every other member.
            named = {r.comm_rank for r in ahead_listed}
            behind = tuple(RasRank(comm_rank=i) for i in range(comm.size) if i not in named)
            how = "every member RAS did not list (it lists the minority, here the ranks ahead)"
        else:
            out.notes.append(f"NCCL RAS: {low.count} rank(s) of {comm.label} are behind at {low_v} of {op} but "
                             f"RAS does not say which ({comm.where})")
            continue
        ranks = [r.comm_rank for r in behind if r.comm_rank is not None]
        lines = [f"NCCL RAS, communicator {comm.label}: {low.count} rank(s) launched only up to {low_v} of {op} "
                 f"while {sum(c.count for c in ahead)} got to operation {top.value} ({comm.where}); behind: "
                 f"{how}{numbering}"]
        if ahead_listed:
            lines.append(f"ranks RAS lists as ahead, not to blame: "
                         f"{compact_ranks([r.comm_rank for r in ahead_listed if r.comm_rank is not None])}")
        lines.extend(f"  {r.label()}" for r in behind[:8] if r.pid is not None or r.host)
        hosts = [r.host for r in behind if r.host]
        if job_wide:
            out.suspects.append(_suspect(ranks, SCORE_BEHIND, lines, machines=hosts,
                                         victims=[r.comm_rank for r in ahead_listed if r.comm_rank is not None],
                                         state=f"behind in {op}"))
        elif hosts:
            out.suspects.append(_suspect((), SCORE_BEHIND * 0.9, lines, machines=hosts, kind=SuspectKind.MACHINE,
                                         state=f"behind in {op}",
                                         title=_ras_title(behind, f"behind in {op}: {low_v} while "
                                                                  f"{sum(c.count for c in ahead)} got to operation "
                                                                  f"{top.value}")))
        else:
            out.notes.append(lines[0] + f": communicator rank(s) {compact_ranks(ranks)}, not tied to global ranks")
    for s in comm.statuses:
        out.notes.append(f"NCCL RAS, communicator {comm.label}: {s.label()} has status {s.status} ({comm.where})")


def _ras_title(ranks: Sequence[RasRank], state: str) -> str:
    """A RAS suspect's headline: the rank and GPU (or process) RAS names, then the machine it lives on."""
    named = [r for r in ranks if r.comm_rank is not None or r.pid is not None or r.gpu is not None]
    if not named:
        return ""
    hosts = sorted({r.host for r in named if r.host})
    who = ", ".join(r.who() for r in named[:3]) + (f" and {len(named) - 3} more" if len(named) > 3 else "")
    return f"{who}{' on ' + ', '.join(hosts) if hosts else ''} ({state})"


_STATE_ORDER = {"scheduled": 0, "started": 1, "completed": 2}
_PROGRAM_ERRORS = ("SIZE", "TYPE", "DTYPE", "SYNTAX")


def _fr(records: Sequence[FrCollective], out: _Found) -> None:
    for c in records:
        what = f"collective {c.seq}" + (f" ({c.op}" + (f" on {c.pg})" if c.pg else ")") if c.op else "")
        if c.missing_ranks:
            present = [r for r in c.expected_ranks if r not in c.missing_ranks]
            out.suspects.append(_suspect(c.missing_ranks, SCORE_BEHIND, [
                f"fr_trace: {_ranks_word(list(c.missing_ranks))} never joined {what} that "
                f"{_ranks_word(present) if present else 'the others'} entered ({c.where})"],
                victims=present, state="never joined the collective"))
            continue
        if c.culprit is None or c.error_type is None:
            continue
        others = [r for r in c.expected_ranks if r != c.culprit]
        if c.error_type.endswith("STATE_MISMATCH") and c.expected_state in _STATE_ORDER \
                and c.found_state in _STATE_ORDER:
            culprit_ahead = _STATE_ORDER[c.found_state] > _STATE_ORDER[c.expected_state]
            behind = others if culprit_ahead else [c.culprit]
            if not behind:
                continue
            out.suspects.append(_suspect(behind, SCORE_BEHIND * 0.7, [
                f"fr_trace: {what}: {_ranks_word(behind)} at state '{c.expected_state if culprit_ahead else c.found_state}'"
                f" while {'culprit ' if culprit_ahead else ''}rank {c.culprit if culprit_ahead else others[0] if others else '?'}"
                f" is at '{c.found_state if culprit_ahead else c.expected_state}' ({c.where}): the rank less far "
                "along is the one to look at; fr_trace's 'culprit' is only the rank that differs from the first "
                "one it read"], victims=[c.culprit] if culprit_ahead else others, state="behind in the collective"))
            continue
        if any(k in c.error_type for k in _PROGRAM_ERRORS):
            ranks = tuple(sorted({c.culprit, *others}))
            roots = (c.culprit,) if len(others) >= 2 else ()
            line = (f"fr_trace: {what}: {c.error_type} on rank {c.culprit}"
                    + (f" against ranks {compact_ranks(others)}" if others else "") + f": {c.error} ({c.where})")
            out.findings.append(Finding("log-collective-mismatch", ranks, line, (line,), c.pg, DESYNC_ADVICE))
            out.suspects.append(_suspect(ranks, SCORE_DESYNC, [line], kind=SuspectKind.DESYNC, roots=roots,
                                         state="program mismatch"))


def _mismatches(reports: Sequence[MismatchReport], out: _Found) -> None:
    by_seq: dict[int | None, dict[int, Fingerprint]] = {}
    where: dict[int | None, list[str]] = {}
    aspects: dict[int | None, str] = {}
    for m in reports:
        seq = next((s.seq for s in m.sides if s.seq is not None), None)
        for s in m.sides:
            by_seq.setdefault(seq, {}).setdefault(s.rank, s)
        where.setdefault(seq, []).append(m.where)
        if m.aspects:
            aspects.setdefault(seq, m.aspects)
    for seq, sides in by_seq.items():
        if len(sides) < 2:
            r = next(iter(sides))
            out.notes.append(f"DETAIL check: rank {r} runs an inconsistent collective"
                             + (f" at sequence {seq}" if seq is not None else "")
                             + f" ({where[seq][0]}); the other side is not in the logs")
            continue
        kinds: dict[tuple[str | None, str | None, str | None], list[int]] = {}
        for r, fp in sides.items():
            kinds.setdefault((fp.op, fp.shape, fp.dtype), []).append(r)
        ranks = tuple(sorted(sides))
        desc = "; ".join(f"rank(s) {compact_ranks(rs)}: {k[0] or '?'}"
                         + (f" shape [{k[1]}]" if k[1] else "") + (f" {k[2]}" if k[2] else "")
                         for k, rs in kinds.items())
        groups = sorted(kinds.values(), key=len)
        roots: tuple[int, ...] = ()
        if len(groups) >= 2 and len(groups[0]) < len(groups[1]):
            roots = tuple(groups[0])
        summary = (f"ranks {compact_ranks(ranks)} run different collectives at sequence number {seq}: {desc}"
                   + (f" (differ in: {aspects[seq]})" if seq in aspects else ""))
        ev = (summary, *(f"from {w}" for w in where[seq][:3]))
        out.findings.append(Finding("log-collective-mismatch", ranks, summary, ev, None, DESYNC_ADVICE))
        out.suspects.append(_suspect(ranks, SCORE_DESYNC, ev, kind=SuspectKind.DESYNC, roots=roots,
                                     state="program mismatch"))


def _inspector(records: Sequence[InspectorRank], out: _Found) -> None:
    by_comm: dict[str, list[InspectorRank]] = {}
    for r in records:
        by_comm.setdefault(r.comm, []).append(r)
    for comm, ranks in by_comm.items():
        if len(ranks) < 2:
            continue
        top = max(r.last_sn for r in ranks)
        behind = [r for r in ranks if r.last_sn < top]
        hosts = {r.rank: r.host for r in ranks if r.host}
        if behind and len(behind) < len(ranks):
            lines = [f"NCCL Inspector, communicator {comm}: rank {r.rank} completed up to collective {r.last_sn} "
                     f"while others reached {top}" for r in sorted(behind, key=lambda r: r.rank)]
            out.suspects.append(_suspect([r.rank for r in behind], SCORE_BEHIND * 0.9, lines,
                                         machines=[h for k, h in hosts.items() if k in {r.rank for r in behind}],
                                         victims=[r.rank for r in ranks if r.last_sn == top],
                                         state="behind in its collectives"))
            continue
        late = _last_arriver(ranks)
        if late is not None:
            rank, share, ratio = late
            out.suspects.append(_suspect([rank], SCORE_SLOW, [
                f"NCCL Inspector, communicator {comm}: rank {rank}'s collectives are the shortest in "
                f"{share:.0%} of those every rank recorded, its peers' {ratio:.1f}x longer: it arrives last and "
                "the others wait for it"], machines=[hosts[rank]] if rank in hosts else (), state="arrives last"))


def _last_arriver(ranks: Sequence[InspectorRank]) -> tuple[int, float, float] | None:
    """The rank whose duration is the shortest in most shared collectives, when its peers wait clearly longer."""
    per_sn: dict[int, dict[int, float]] = {}
    for r in ranks:
        for sn, us in r.durations:
            per_sn.setdefault(sn, {})[r.rank] = us
    shared = [d for d in per_sn.values() if len(d) == len(ranks)]
    if len(shared) < 3:
        return None
    wins: dict[int, int] = {}
    ratios: dict[int, list[float]] = {}
    for d in shared:
        rank = min(d, key=lambda k: d[k])
        wins[rank] = wins.get(rank, 0) + 1
        others = sorted(v for k, v in d.items() if k != rank)
        ratios.setdefault(rank, []).append(others[len(others) // 2] / max(d[rank], 1e-9))
    rank, n = max(wins.items(), key=lambda kv: kv[1])
    share = n / len(shared)
    ratio = sorted(ratios[rank])[len(ratios[rank]) // 2]
    return (rank, share, ratio) if share >= 0.6 and ratio >= 2.0 else None


def _ranks_word(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + compact_ranks(list(ranks))


LOG_OP = "collectives"  # a process group's work of every kind: its sequence numbers count them all


def watchdog_counters(records: Sequence[WatchdogRecord]) -> tuple[RankCounters, ...]:
    """The watchdog's PG status as the CCL plugin's counters: per process group and rank, CL = WR = last enqueued
    work, WC = last completed (sequence numbers start at 1). Members are the ranks the logs show in the group.

    Only ranks tied to a global rank and with both numbers known count; the CCL rules and the stacks' chain then
    read them like a live capture's counters.
    """
    status: dict[str, dict[int, tuple[int, int]]] = {}
    for r in records:
        if r.rank is None or r.enqueued is None or r.completed is None:
            continue
        old = status.setdefault(r.pg, {}).get(r.rank)
        e, c = max(r.enqueued, 0), max(r.completed, 0)
        status[r.pg][r.rank] = (max(e, old[0]), max(c, old[1])) if old else (e, c)
    per_rank: dict[int, tuple[list[Communicator], list[OpCounters]]] = {}
    for pg, ranks in status.items():
        comm = Communicator(comm_id=f"log:{pg}", backend="nccl", description=f"{pg} (from the watchdog's lines)",
                            ranks=tuple(sorted(ranks)))
        for rank, (e, c) in ranks.items():
            comms, ops = per_rank.setdefault(rank, ([], []))
            comms.append(comm)
            ops.append(OpCounters(comm.comm_id, LOG_OP, cl=e, wr=e, wc=min(c, e), last_launched_seq=e,
                                  last_completed_seq=c))
    return tuple(RankCounters(rank, None, None, None, None, tuple(comms), tuple(ops))
                 for rank, (comms, ops) in sorted(per_rank.items()))


def _fold_same_machine(suspects: list[Suspect]) -> list[Suspect]:
    """Suspects named only by machine (RAS names processes by host) are one suspect per machine set; its headline
    names each distinct process RAS named there (the first three). Linear in the suspects and their lines."""
    out: list[Suspect | None] = []
    index: dict[tuple[str, ...], int] = {}
    parts: dict[int, tuple[list[Suspect], dict[str, None], dict[str, None]]] = {}  # suspects, evidence, titles
    for s in suspects:
        if s.ranks or s.kind is not SuspectKind.MACHINE:
            out.append(s)
            continue
        at = index.get(s.machines)
        if at is None:
            index[s.machines] = len(out)
            parts[len(out)] = ([s], dict.fromkeys(s.evidence), dict.fromkeys([s.title] if s.title else []))
            out.append(s)
            continue
        same, evidence, titles = parts[at]
        same.append(s)
        evidence.update(dict.fromkeys(s.evidence))
        if s.title:
            titles[s.title] = None
    for at, (same, evidence, titles) in parts.items():
        if len(same) == 1:
            continue
        first = same[0]
        names = list(titles)
        title = "; ".join(names[:3]) + (f"; and {len(names) - 3} more" if len(names) > 3 else "")
        out[at] = Suspect(first.kind, first.ranks, first.machines, max(s.score for s in same), tuple(evidence),
                          first.sources, state=first.state, title=title)
    return [s for s in out if s is not None]


def _headline(s: Suspect) -> str:
    where = f" on {', '.join(s.machines)}" if s.machines else ""
    state = f" ({s.state})" if s.state else ""
    if s.kind is SuspectKind.DESYNC:
        return s.title
    if s.kind is SuspectKind.MACHINE and s.title:
        return s.title  # the rank and GPU (or process) RAS names, on its machine
    if s.kind is SuspectKind.MACHINE or not s.ranks:
        return f"machine {', '.join(s.machines) or '?'}{state}"
    wait = f"; {_ranks_word(s.victims)} {'waits' if len(s.victims) == 1 else 'wait'} on it" if s.victims else ""
    return f"{_ranks_word(s.ranks)}{where}{state[:-1] + wait + ')' if state else wait}"


def analyze_logs(evidence: LogEvidence, world: int | None = None) -> Verdict:
    """The logs' verdict: suspects behind their peers, program mismatches, or "not a rank" with the reason."""
    out = _Found()
    _watchdog(evidence.watchdog, out, world)
    ras_ok = _ras(evidence.ras, out, world)
    _fr(evidence.fr, out)
    _mismatches(evidence.mismatches, out)
    _inspector(evidence.inspector, out)
    timed_out = any(r.kind in ("timeout", "status", "blocking-wait") for r in evidence.watchdog)
    notes = [*evidence.notes, *out.notes]
    suspects = sorted(out.suspects, key=suspect_order)
    findings = list(out.findings)
    reasons = [r.text for r in out.symmetric]
    if ras_ok and timed_out:
        reasons.insert(0, "NCCL RAS shows every communicator RUNNING with errors OK: every rank launched the same "
                          "operations, so none is behind, while PyTorch's watchdog timed out")
    multi_rank = [r for r in out.symmetric if r.alone is None]
    if not suspects and (multi_rank or (ras_ok and timed_out)):
        ranks = tuple(sorted({r.rank for r in evidence.watchdog if r.rank is not None}))
        summary = NOT_A_RANK_PREFIX + reasons[0]
        findings.insert(0, Finding(NOT_A_RANK, ranks, summary, tuple(reasons), None, NOT_A_RANK_ADVICE))
        return Verdict((), summary, notes=tuple(notes), findings=tuple(findings), status=VerdictStatus.NOT_A_RANK)
    status = VerdictStatus.NO_VERDICT
    if suspects:
        suspects = _fold_same_machine(suspects)
        summary, status = _headline(suspects[0]), VerdictStatus.NAMED
    elif evidence.empty():
        summary = "no verdict: the logs hold no collective progress"
    else:
        summary = "no verdict: the logs name no rank behind its peers" + (f" ({reasons[0]})" if reasons else "")
    return Verdict(tuple(suspects), summary, notes=tuple(notes), findings=tuple(findings), status=status)
