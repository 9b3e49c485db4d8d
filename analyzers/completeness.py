"""What was read of every rank, what failed and why: how far a verdict can be trusted.

A verdict drawn from 63 of 64 ranks is a different claim from one drawn from
all of them, and the rank that could not be read is often the one that
matters. So every rank gets a line: its state in the chain of waits, what was
read (main stack, threads, subprocesses, CCL counters), what failed with the
capture's own reason (py-spy's error, /proc's process state and wchan), and
whether a stack is known to be cut short.

Pure: the snapshot contract and the chain's views; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from rankscope.analyzers.chain import Chain, RankState, unreadable_reason
from rankscope.contract.snapshot import JobSnapshot


@dataclass(frozen=True, slots=True)
class RankEvidence:
    rank: int
    machine: str | None
    state: str  # the chain's state: computing, loading data, collective, send/recv, stopped, unreadable, ...
    detail: str  # where it is, or why it could not be read
    read: tuple[str, ...]  # what was read
    failed: tuple[str, ...]  # what could not be read, each with why
    truncated: str | None = None  # why the stack is known to be incomplete

    @property
    def complete(self) -> bool:
        return not self.failed and self.truncated is None and self.state != RankState.UNKNOWN.value


def rank_evidence(snapshot: JobSnapshot, chain: Chain) -> tuple[RankEvidence, ...]:
    """One entry per rank of the chain (every rank of the job), lowest rank first."""
    stacks = snapshot.all_stacks()
    counters = snapshot.all_counters()
    machine_of: dict[int, str] = {}
    for m in snapshot.machines:
        for r in m.ranks:
            machine_of[r.rank] = m.machine
        for s in m.stacks:
            machine_of.setdefault(s.rank, m.machine)
    out: list[RankEvidence] = []
    for rank in sorted(chain.views):
        view = chain.views[rank]
        read: list[str] = []
        failed: list[str] = []
        truncated: str | None = None
        rs = stacks.get(rank)
        if rs is None:
            failed.append(f"stacks: {view.reason or 'not in the snapshot'}")
        elif rs.main.threads is None:
            failed.append(f"main process pid {rs.main.pid}: " + unreadable_reason(rs.main.error, "not captured")[0])
        else:
            read.append(f"main process pid {rs.main.pid}: {len(rs.main.threads)} thread(s)")
        if rs is not None:
            truncated = rs.main.truncated
            subs_ok = [s for s in rs.subprocesses if s.threads is not None]
            if subs_ok:
                read.append(f"{len(subs_ok)} subprocess(es)")
            for sub in rs.subprocesses:
                if sub.threads is None:
                    failed.append(f"{sub.role} subprocess pid {sub.pid}: "
                                  + unreadable_reason(sub.error, "not captured")[0])
        c = counters.get(rank)
        if c is not None:
            if c.error:
                failed.append(f"CCL counters: {c.error}")
            else:
                read.append("CCL counters" + (f" (stale: {c.stale_reason})" if c.stale else ""))
        out.append(RankEvidence(rank=rank, machine=machine_of.get(rank), state=view.state.value,
                                detail=view.describe(), read=tuple(read), failed=tuple(failed), truncated=truncated))
    return tuple(out)


def rank_evidence_to_json(e: RankEvidence) -> dict[str, object]:
    return {"rank": e.rank, "machine": e.machine, "state": e.state, "detail": e.detail, "complete": e.complete,
            "read": list(e.read), "failed": list(e.failed), "truncated": e.truncated}


__all__ = ["RankEvidence", "rank_evidence", "rank_evidence_to_json"]
