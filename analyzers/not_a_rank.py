"""The verdict "not a rank": every member of a communicator waits in the same call, so no rank is to blame.

A hang whose waiters lead back to a rank (one stuck in its own work, one
that never launched or posted what the others wait for) has a culprit. When
instead every member of a communicator sits in the same collective at the
same call site, and at the same launch where counters (or flight records,
or logs read as counters) say so, each has done its part: the call itself
does not complete. That points at what carries it, the communication layer
(NCCL and its transport), the network between the machines, or a GPU or its
driver on one of them, and picking one of the members by a tie-break would
send an engineer to evict a healthy machine.

Told apart from a culprit elsewhere: a symmetric stall is reported only when
no detector pins a rank (``Suspect.roots``) and no desync is found; NCCL runs
a rank's collectives in order on its stream, so one stuck communicator can
hold the later calls of another on the same GPUs.

Pure: stdlib and the snapshot contract; no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from rankscope.analyzers.ccl_desync import CounterWaits, OpTable, comm_label, waiting_together
from rankscope.analyzers.chain import BACKWARD_SITE, Chain, RankState, RankView
from rankscope.analyzers.findings import (
    NOT_A_RANK,
    NOT_A_RANK_ADVICE,
    NOT_A_RANK_PREFIX,
    Finding,
    Verdict,
    VerdictStatus,
)
from rankscope.contract.ranks import compact_ranks
from rankscope.contract.snapshot import JobSnapshot, RankCounters


@dataclass(frozen=True, slots=True)
class SymmetricStall:
    """Every member of ``ranks`` waits in one call: ``where`` names the communicator, ``call`` the call."""

    where: str  # "the whole job", "comm 3 (TENSOR_MODEL_PARALLEL_GROUP)"
    ranks: tuple[int, ...]
    call: str  # "all_reduce launch 41", a call site from the stacks
    evidence: tuple[str, ...]
    whole_job: bool
    reason: str = ""  # its own headline after "not a rank: ", where it says more than "the same call"

    def summary(self) -> str:
        if self.reason:
            return NOT_A_RANK_PREFIX + self.reason
        members = "all " + (f"{len(self.ranks)} ranks of the job" if self.whole_job
                            else f"{len(self.ranks)} members of {self.where}")
        return (f"{NOT_A_RANK_PREFIX}{members} (ranks {compact_ranks(self.ranks, 8)}) wait in the same call "
                f"({self.call}): "
                "a symmetric stall points at the communication layer, the network or a GPU driver, not at one rank")

    def finding(self) -> Finding:
        return Finding(kind=NOT_A_RANK, ranks=self.ranks, summary=self.summary(), evidence=self.evidence,
                       communicator=self.where, advice=NOT_A_RANK_ADVICE)


def stack_stall(chain: Chain, world: Sequence[int], waits: CounterWaits | None = None) -> SymmetricStall | None:
    """Every rank of the job in one collective at one call site, no root and no desync: a symmetric stall.

    ``world``: the job's ranks (one without a view, e.g. a file missing from a
    dump folder, could be the one the others wait on: then nothing is said).
    With counters, a lag anywhere (a member that never launched what others
    wait in) means someone is behind: not symmetric.
    """
    if chain.roots or chain.desyncs or len(world) < 2:
        return None
    if waits is not None and waits.lags:
        return None
    views = [chain.views.get(r) for r in world]
    if any(v is None or v.state is not RankState.COLLECTIVE for v in views):
        return None
    sites = {v.site for v in views if v is not None}
    if len(sites) != 1:
        return None
    site = next(iter(sites))
    counted = next((v.counted for v in views if v is not None and v.counted), "")
    lines = [f"all {len(world)} ranks at {site}"]
    if counted:
        lines.append(f"counters: {counted}")
    elif waits is None:
        lines.append("no counters: the same call site, the launch unknown (one rank could be a call behind: "
                     "the CCL counters, a flight recorder dump or the watchdog's SeqNum would tell)")
    lines.append("every rank waits (none is computing, loading, stopped or unreadable) and none is in another "
                 "call: there is no rank the others wait on")
    return SymmetricStall("the whole job", tuple(sorted(world)), site, tuple(lines), True)


# What to fetch next when every rank's stacks are the same: each tells which layer below the ranks holds the call.
SAME_STACKS_NEXT = (
    "`py-spy dump --native --pid P` on any one rank: the C++ frames under the Python one show what it waits in "
    "(a c10d Work wait, cudaStreamSynchronize, an NCCL call); a flight recorder dump (TORCH_NCCL_TRACE_BUFFER_SIZE "
    "> 0, TORCH_NCCL_DUMP_ON_TIMEOUT=1) names the collective every rank is in and its state; NCCL RAS (`ncclras`) "
    "says whether any rank launched fewer operations or does not answer; NCCL_DEBUG=INFO names transport errors "
    "and their peer; on each machine the kernel log (`dmesg | grep -i -e xid -e nvrm`) and `nvidia-smi -q` show a "
    "GPU or driver fault. With nothing named anywhere, restart the job from its last checkpoint")


def same_stacks_stall(frames: Sequence[str], ranks: Sequence[int], views: Sequence[RankView]) -> SymmetricStall | None:
    """Every rank of the job shows the same stacks inside the same wait, none is behind, none is missing: the
    finding is that the stall is below the ranks. ``frames``: the shared main-thread frames, outermost first;
    ``views``: each rank's. A wait: a collective or send/recv, backward (where DDP's gradient reduction runs), the
    host waiting on its GPU, or a DataLoader. The same stacks in the ranks' own work (a step caught mid-compute on
    every rank) are no finding: None.

    Data loading everywhere points at what every rank reads (storage, a data service); any other shared place is a
    call that does not return below Python: the communication layer, the network, a driver, or a GPU kernel that
    never finishes (DDP's gradient all-reduce runs inside backward, so its Python stack shows only backward).
    """
    if len(views) != len(ranks) or len(ranks) < 2 or not all(_waits(v) for v in views):
        return None
    states = [v.state for v in views]
    inner = frames[-1] if frames else "?"
    place = inner + (f" <- {frames[-2]}" if len(frames) > 1 else "")
    n = len(ranks)
    lines = [f"all {n} ranks show the same stacks, innermost {place}: no rank is elsewhere, so none is behind"]
    if states and all(st is RankState.LOADING for st in states):
        below = "what every rank reads (shared storage, a data service), not one rank"
        lines.append("every rank is loading data: a source they all share is slow or stuck")
    else:
        below = ("below the ranks: the communication layer, the network, a driver, or a GPU kernel that never "
                 "finishes")
        if any("backward" in f for f in frames):
            lines.append("inside backward: DDP's and FSDP's gradient collectives run there from C++, so a stuck "
                         "all-reduce shows as backward in Python")
    lines.append(f"next: {SAME_STACKS_NEXT}")
    reason = (f"all {n} ranks (ranks {compact_ranks(sorted(ranks), 8)}) show the same stacks, waiting in {place}: "
              f"when every rank waits in the same place the stall is {below}")
    return SymmetricStall("the whole job", tuple(sorted(ranks)), place, tuple(lines), True, reason)


def _waits(v: RankView) -> bool:
    return v.state in (RankState.COLLECTIVE, RankState.P2P, RankState.LOADING) or v.site == BACKWARD_SITE \
        or bool(v.host_wait)


def counter_stalls(waits: CounterWaits, world: Sequence[int] = ()) -> list[SymmetricStall]:
    """``table_stalls`` of a capture's counter waits."""
    return table_stalls(waits.table, waits.live, world)


def table_stalls(table: OpTable, live: Mapping[int, RankCounters], world: Sequence[int] = ()) -> list[SymmetricStall]:
    """Communicators whose every member launched the same collective as often and has it open (WC < WR).

    (``ccl_desync.waiting_together``: every member must have a live counter
    file, since a member without one could be the culprit.)
    """
    out: list[SymmetricStall] = []
    for t in waiting_together(table, live):
        members = t.comm.ranks
        label = comm_label(t.comm)
        counts = "; ".join(f"rank {m} WC {o.wc} < WR {o.wr}" for m, o in list(zip(members, t.rows, strict=False))[:4])
        lines = (f"{t.op} on {label}: all {len(members)} members launched it {t.cl} times and each has a request "
                 f"open ({counts}{'; ...' if len(members) > 4 else ''})",
                 "no member lags (every CL equal) and none has a send/recv its peer never posted: no rank is "
                 "behind the others")
        whole = bool(world) and set(members) >= set(world)
        out.append(SymmetricStall("the whole job" if whole else label, tuple(sorted(members)),
                                  f"{t.op} launch {t.cl} on {label}", lines, whole))
    return out


def gpu_readings(snapshot: JobSnapshot, ranks: Sequence[int]) -> tuple[str, ...]:
    """What NVML said of the GPUs of the machines holding ``ranks``: Xid errors, uncorrected ECC, remapped or
    retired memory. Any of them names a machine where the symmetric stall's cause may sit."""
    where = snapshot.rank_to_machine()  # (built once: it walks every machine's ranks)
    hosts = {where.get(r, "") for r in ranks} - {""}
    lines: list[str] = []
    for m in snapshot.machines:
        if m.machine not in hosts or m.gpus is None or not m.gpus.available:
            continue
        for g in m.gpus.gpus:
            bad = []
            if g.xid_events:
                bad.append(f"Xid {', '.join(map(str, g.xid_events))}")
            if g.ecc_uncorrected:
                bad.append(f"{g.ecc_uncorrected} uncorrected ECC error(s)")
            if g.remapped_rows or g.retired_pages:
                bad.append(f"{g.remapped_rows or 0} remapped row(s), {g.retired_pages or 0} retired page(s)")
            if bad:
                lines.append(f"NVML on {m.machine}, GPU {g.index}: {'; '.join(bad)}: look there first")
    return tuple(lines)


def waiting_on(waits: CounterWaits, groups: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """For each group of ranks, the ranks whose counter waits lead to it (a lag they wait in, a send/recv never
    posted): the victims of a stall. The wait graph is inverted once, however many groups ask."""
    back: dict[object, list[object]] = {}
    for node, targets in waits.graph.out.items():
        for t in targets:
            back.setdefault(t, []).append(node)
    out: list[tuple[int, ...]] = []
    for ranks in groups:
        seen: set[object] = set(ranks)
        todo: list[object] = list(ranks)
        while todo:
            for w in back.get(todo.pop(), ()):
                if w not in seen:
                    seen.add(w)
                    todo.append(w)
        out.append(tuple(sorted(r for r in seen if isinstance(r, int) and r not in set(ranks))))
    return out


def settle(verdict: Verdict, snapshot: JobSnapshot | None = None) -> Verdict:
    """The merged verdict with its "not a rank" findings weighed against the rest.

    A rank pinned by any detector (``Suspect.roots``) or a desync explains a
    symmetric stall downstream of it: the stall is set aside as a note. Else
    the verdict says "not a rank" with the first stall's reason, and each
    stall carries what NVML said of its machines' GPUs (``snapshot``).
    """
    stalls = [f for f in verdict.findings if f.kind == NOT_A_RANK]
    if not stalls:
        return verdict
    pinned = [s for s in verdict.suspects if s.roots]
    if pinned or any(f.kind == "desync" for f in verdict.findings):
        findings = tuple(f for f in verdict.findings if f.kind != NOT_A_RANK)
        notes = (*verdict.notes, *(f"set aside, a rank the evidence pins explains it: {f.summary}" for f in stalls))
        return replace(verdict, findings=findings, notes=notes)
    if snapshot is not None:
        told = {f: gpu_readings(snapshot, f.ranks) for f in stalls}
        if any(told.values()):
            verdict = replace(verdict, findings=tuple(
                replace(f, evidence=(*f.evidence, *told[f])) if told.get(f) else f for f in verdict.findings))
            stalls = [f for f in verdict.findings if f.kind == NOT_A_RANK]
    if verdict.status is VerdictStatus.NOT_A_RANK:
        return verdict  # its detector already said "not a rank" (its status, not its words)
    # What it said before, unless it said it has no verdict: a note.
    notes = (*verdict.notes, verdict.summary) if verdict.summary and verdict.status not in (
        VerdictStatus.NO_VERDICT, VerdictStatus.TIMING) else verdict.notes
    return replace(verdict, summary=stalls[0].summary, notes=notes, status=VerdictStatus.NOT_A_RANK, summary_root="",
                   summary_head="")


__all__ = ["SAME_STACKS_NEXT", "SymmetricStall", "counter_stalls", "gpu_readings",
           "same_stacks_stall", "settle", "stack_stall", "table_stalls", "waiting_on"]
