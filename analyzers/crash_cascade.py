"""Where a crash began: the errors every rank's and machine's logs hold when a job dies, told apart from their echoes.

When one GPU, NIC or process fails, every rank of the job soon logs an error:
its peers' connections break (NCCL's ``NET/IB : Got completion ... with
error``, ``Connection reset by peer``), their process groups raise
``DistBackendError``, watchdogs time out and abort their processes
(SIGABRT), and torchelastic names the first process it saw exit, often one
of these victims. Most errors are consequences. Following Aegis' runtime
diagnosis (§4.1, Algorithm 1: critical errors first, then distributed
errors clustered by the peer they name), the origin is

1. the first critical hardware error by time (an Xid of a failed GPU, a GPU
   fallen off the bus, an uncorrectable ECC or PCIe error, a NIC link down):
   its machine, and its GPU where the line says;
2. else the host the others' connection errors point to (named by more
   reporting hosts than any other, by at least two, or the only one named);
3. else the earliest error that is not a victim's (a watchdog timeout, an
   abort) by time;

with every other error folded under it as a consequence. Connection errors
from several hosts naming several peers, none more than the others, with no
hardware or program error anywhere, are "not a rank": the network or its
configuration (Aegis' distributed problem, for ConfigCheck/NetDiag).

The reader (``formats.crash_logs``) turns lines into ``CrashEvent``
(``contract.crash_records``); the rules here judge them. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from rankscope.analyzers.findings import (
    NOT_A_RANK,
    NOT_A_RANK_PREFIX,
    Finding,
    Suspect,
    SuspectKind,
    Verdict,
    VerdictStatus,
)
from rankscope.contract.crash_records import CrashEvent, CrashEvidence, CrashKind
from rankscope.contract.ranks import compact_ranks

SOURCE = "crash logs"
CRASH_ORIGIN = "crash-origin"
SCORE_HARDWARE = 1.2
SCORE_PEER = 1.05
SCORE_EARLIEST = 0.8
_MAX_FOLDED = 12  # consequence lines shown under the origin (the rest are counted)

_VICTIMS = (CrashKind.TIMEOUT, CrashKind.ABORT, CrashKind.EXIT)


def _who(e: CrashEvent) -> str:
    parts = []
    if e.rank is not None:
        parts.append(f"rank {e.rank}")
    if e.gpu is not None:
        parts.append(f"GPU {e.gpu}")
    head = " ".join(parts)
    if e.host:
        head = f"{head} on {e.host}" if head else e.host
    return head or "an unnamed process"


def _when(e: CrashEvent, t0: float | None) -> str:
    if e.time is None or t0 is None:
        return ""
    return f" at +{e.time - t0:.1f}s" if e.time > t0 else " first"


def _order(e: CrashEvent) -> tuple[int, float]:
    return (0, e.time) if e.time is not None else (1, 0.0)


def analyze_crash(evidence: CrashEvidence) -> Verdict | None:
    """The crash's origin with its consequences folded under it, "not a rank", or None when the logs hold no error
    of a crash (only watchdog timeouts: a hang, which ``analyzers.log_evidence`` judges)."""
    events = list(evidence.events)
    if all(e.kind in (CrashKind.TIMEOUT, CrashKind.ABORT) or (e.kind is CrashKind.DIST and not e.peer)
           for e in events):
        return None  # victims' errors only: a hang's echoes, which analyzers.log_evidence judges
    times = [e.time for e in events if e.time is not None]
    t0 = min(times) if times else None
    notes = list(evidence.notes)
    claim = next((e for e in events if e.root_claim), None)

    origin, rule = _origin(events)
    spread = _spread(events) if origin is None else None
    if origin is None and spread is None:
        origin, rule = _first_broken(events)
    if origin is None:
        if spread is not None:
            finding = Finding(NOT_A_RANK, (), NOT_A_RANK_PREFIX + spread, (spread, *_folded(events, None, t0)),
                              None, NET_ADVICE)
            if claim is not None:
                notes.append(_claim_note(claim, None))
            return Verdict((), finding.summary, notes=tuple(notes), findings=(finding,),
                           status=VerdictStatus.NOT_A_RANK)
        notes.append("the crash logs hold errors but none that names where it began")
        return Verdict((), "no verdict: the crash logs name no origin", notes=tuple(notes),
                       status=VerdictStatus.NO_VERDICT)

    on_host = sorted({e.rank for e in events if e.host == origin.host and e.rank is not None}) \
        if origin.rank is None and origin.host else []
    who = _who(origin) + (f" ({_ranks_word(on_host)} there)" if on_host else "")
    head = f"crash began at {who}: {origin.text}"
    lines = [f"{head} ({origin.where}{_when(origin, t0)}); rule: {rule}"]
    if claim is not None and not _same_process(claim, origin):
        notes.append(_claim_note(claim, origin))
        lines.append(_claim_note(claim, origin))
    lines.extend(_folded(events, origin, t0))
    victims = sorted({e.rank for e in events if e.rank is not None and e.rank != origin.rank
                      and not (origin.rank is None and e.host == origin.host)})
    machines = (origin.host,) if origin.host else ()
    kind = SuspectKind.RANK if origin.rank is not None and origin.kind is not CrashKind.HARDWARE else \
        SuspectKind.MACHINE
    ranks = (origin.rank,) if kind is SuspectKind.RANK and origin.rank is not None else ()
    score = {CrashKind.HARDWARE: SCORE_HARDWARE}.get(origin.kind, SCORE_PEER if "point" in rule else SCORE_EARLIEST)
    suspect = Suspect(kind, ranks, machines, score, tuple(lines), (SOURCE,), victims=tuple(victims),
                      state=f"crash origin: {origin.kind}", roots=ranks, title=head)
    finding = Finding(CRASH_ORIGIN, ranks or tuple(on_host), head, tuple(lines), None, ORIGIN_ADVICE.get(origin.kind, PROCESS_ADVICE))
    return Verdict((suspect,), head, notes=tuple(notes), findings=(finding,))


def _origin(events: Sequence[CrashEvent]) -> tuple[CrashEvent | None, str]:
    hardware = sorted((e for e in events if e.kind is CrashKind.HARDWARE), key=_order)
    if hardware:
        return hardware[0], "the first critical hardware error by time"
    pointed = _pointed(events)
    if pointed is not None:
        host, reporters = pointed
        own = sorted((e for e in events if e.host == host and e.kind not in _VICTIMS), key=_order)
        named_by = next(e for e in events if e.peer == host)
        first = own[0] if own else CrashEvent(named_by.where, CrashKind.NETWORK, "its peers' connections to it broke",
                                              host=host)
        return first, (f"the host the others' connection errors point to (named by {len(reporters)} host(s): "
                       f"{', '.join(sorted(reporters)[:6])})")
    return _earliest(events, (CrashKind.GPU, CrashKind.PROGRAM))


def _earliest(events: Sequence[CrashEvent], kinds: Sequence[CrashKind]) -> tuple[CrashEvent | None, str]:
    """The earliest error of ``kinds`` by time; without times, the one process that has any."""
    own = sorted((e for e in events if e.kind in kinds), key=_order)
    if own and own[0].time is not None:
        return own[0], f"the earliest error that is not a victim's ({', '.join(kinds)})"
    if own and len({(e.host, e.rank) for e in own}) == 1:
        return own[0], "the only process with an error of its own (the lines give no times)"
    return None, ""


def _first_broken(events: Sequence[CrashEvent]) -> tuple[CrashEvent | None, str]:
    """The earliest connection or collective error of a named process, when it came before every victim's error
    (one after a timeout is that timeout's echo)."""
    timed = [e for e in events if e.time is not None]
    broken = sorted((e for e in timed if e.kind in (CrashKind.NETWORK, CrashKind.DIST) and (e.host or e.rank
                                                                                             is not None)),
                    key=_order)
    victims = [e.time for e in timed if e.kind in _VICTIMS and e.time is not None]
    if broken and (not victims or (broken[0].time is not None and broken[0].time < min(victims))):
        return broken[0], "the earliest error by time (no hardware error, no host its peers point to)"
    return None, ""


def _pointed(events: Sequence[CrashEvent]) -> tuple[str, set[str]] | None:
    """The peer the connection errors of other hosts name most (by reporting host), when it stands out."""
    by_peer: dict[str, set[str]] = {}
    for e in events:
        if e.kind in (CrashKind.NETWORK, CrashKind.DIST) and e.peer and e.peer != e.host:
            by_peer.setdefault(e.peer, set()).add(e.host or e.where.split(":", 1)[0])
    if not by_peer:
        return None
    ranked = sorted(by_peer.items(), key=lambda kv: -len(kv[1]))
    peer, reporters = ranked[0]
    runner_up = len(ranked[1][1]) if len(ranked) > 1 else 0
    if len(ranked) == 1 or (len(reporters) >= 2 and len(reporters) > runner_up):
        return peer, reporters
    return None


def _spread(events: Sequence[CrashEvent]) -> str | None:
    """Connection errors from several hosts naming several peers, none standing out: the network, not a host."""
    net = [e for e in events if e.kind is CrashKind.NETWORK]
    reporters = {e.host for e in net if e.host}
    peers = {e.peer for e in net if e.peer}
    if len(reporters) < 2 or len(peers) < 2:
        return None
    return (f"connection errors on {len(reporters)} hosts name {len(peers)} different peers, none more than the "
            "others, and no host logged a hardware or program error of its own: the network between them (a "
            "switch, a link) or its configuration, not one machine")


def _folded(events: Sequence[CrashEvent], origin: CrashEvent | None, t0: float | None) -> list[str]:
    """Every other error, one line per (kind, host), as a consequence of the origin."""
    groups: dict[tuple[CrashKind, str], list[CrashEvent]] = {}
    for e in sorted(events, key=_order):
        if e is origin:
            continue
        groups.setdefault((e.kind, e.host or "?"), []).append(e)
    word = "consequence" if origin is not None else "seen"
    lines = []
    for (kind, host), es in list(groups.items())[:_MAX_FOLDED]:
        ranks = sorted({e.rank for e in es if e.rank is not None})
        who = f"{host}" + (f" {_ranks_word(ranks)}" if ranks else "")
        more = f" (+{len(es) - 1} more)" if len(es) > 1 else ""
        lines.append(f"  {word}: {kind} on {who}: {es[0].text} ({es[0].where}{_when(es[0], t0)}){more}")
    if len(groups) > _MAX_FOLDED:
        rest = sum(len(v) for v in list(groups.values())[_MAX_FOLDED:])
        lines.append(f"  and {rest} more error(s) on {len(groups) - _MAX_FOLDED} more (kind, host) pairs")
    kinds = Counter(e.kind for e in events if e is not origin)
    if kinds:
        lines.append("  folded: " + ", ".join(f"{n} {k}" for k, n in kinds.most_common()))
    return lines


def _ranks_word(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + compact_ranks(list(ranks))


def with_crash(logs: Verdict | None, crash: Verdict | None) -> Verdict | None:
    """The logs' verdict with the crash's: a crash origin (or its "not a rank") leads, the rest follows it; a crash
    verdict without an origin adds its notes."""
    if crash is None or logs is None:
        return logs if crash is None else crash
    if not crash.suspects and not crash.findings:
        return Verdict(logs.suspects, logs.summary, logs.missing_ranks, (*logs.notes, *crash.notes), logs.findings,
                       logs.named, logs.status)
    return Verdict((*crash.suspects, *logs.suspects), crash.summary, logs.missing_ranks,
                   (*logs.notes, *crash.notes, *((f"the logs' own verdict: {logs.summary}",) if logs.summary else ())),
                   (*crash.findings, *logs.findings), status=crash.status)


def _same_process(a: CrashEvent, b: CrashEvent) -> bool:
    return a.host == b.host and a.rank is not None and a.rank == b.rank


def _claim_note(claim: CrashEvent, origin: CrashEvent | None) -> str:
    victim = claim.exitcode in (-6, 134) or "SIGABRT" in claim.text
    what = (f"torchelastic's 'Root Cause (first observed failure)' is {_who(claim)} ({claim.text}, {claim.where})"
            + (": a victim (the NCCL watchdog aborts a process whose collective failed or timed out)" if victim
               else ": the first exit torchelastic observed, not necessarily where the crash began"))
    return what + (f"; the cascade began at {_who(origin)}" if origin is not None else "")


PROCESS_ADVICE = ("the origin's own log (its first error and the traceback above it) tells a program fault from a "
                  "GPU one; restart without that machine if its kernel log shows Xid or ECC errors")
NET_ADVICE = ("check the fabric between the hosts: the switch ports and links of the hosts named (ibstat, "
              "`ibdiagnet`, the switch's log), NCCL_IB_*/NCCL_SOCKET_IFNAME settings, and MTU or firewall changes; "
              "evicting one machine is a guess")
ORIGIN_ADVICE = {
    CrashKind.HARDWARE: "evict that machine (or drain the GPU) and restart from the last checkpoint: a critical "
                        "hardware error takes its process down and the others' connections with it",
    CrashKind.NETWORK: "check that host's NIC and its link (ibstat, the kernel log for link down, the switch port) "
                       "and its processes' own logs; evict it if the NIC or its GPU shows errors",
    CrashKind.GPU: "read that GPU's kernel log (Xid) and the process's CUDA error: a program's illegal access "
                   "recurs on any machine, a GPU fault stays with the machine",
}


__all__ = ["CRASH_ORIGIN", "CrashEvent", "CrashEvidence", "CrashKind", "analyze_crash", "with_crash"]
