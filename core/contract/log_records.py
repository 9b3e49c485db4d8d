"""What the incident-log readers produce: one record per fact a log line states, with where it came from.

The readers (``formats.incident_logs``, ``formats.nccl_ras``,
``formats.nccl_inspector``) write these; ``analyzers.log_evidence`` judges
them. Both sides import them from here, below the judges. Stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class WatchdogRecord:
    """One ProcessGroupNCCL line about a rank's collective progress.

    ``rank`` is the global rank when the line or its file says it (``[rankN]:``
    prefix, ``rank<N>`` file name, or the default group's rank), else None;
    ``pg`` names the process group as the line does (``PG 0 (default_pg)``).
    ``seq``: the work the watchdog flagged (``SeqNum=``, ``at work:``);
    ``enqueued``/``completed``: the PG status the line gives.
    """

    where: str  # file:line
    kind: str  # timeout | status | dump-signal | blocking-wait | stuck-watchdog
    rank: int | None
    rank_how: str
    pg: str
    pg_rank: int | None = None
    seq: int | None = None
    op: str | None = None
    enqueued: int | None = None
    completed: int | None = None
    timeout_ms: int | None = None
    signalled_by: int | None = None  # "a collective timeout from rank X"
    group_size: int | None = None  # told by the work's sizes (an all-gather's NumelOut / NumelIn)


@dataclass(frozen=True, slots=True)
class RasRank:
    """A rank or process as NCCL RAS names it: communicator rank, GPU, process, node (any may be unknown)."""

    comm_rank: int | None = None
    gpu: str | None = None
    pid: int | None = None
    host: str | None = None
    status: str | None = None

    def who(self) -> str:
        """The rank and GPU RAS names, without the machine: ``communicator rank 7 (GPU 3, pid 4242)``."""
        head = f"communicator rank {self.comm_rank}" if self.comm_rank is not None else (
            f"process {self.pid}" if self.pid is not None else "a process")
        parts = [f"GPU {self.gpu}"] if self.gpu is not None else []
        if self.pid is not None and self.comm_rank is not None:
            parts.append(f"pid {self.pid}")
        return head + (f" ({', '.join(parts)})" if parts else "")

    def label(self) -> str:
        parts = [f"communicator rank {self.comm_rank}" if self.comm_rank is not None else "a process"]
        if self.pid is not None:
            parts.append(f"pid {self.pid}")
        if self.host:
            parts.append(f"on {self.host}")
        if self.gpu is not None:
            parts.append(f"GPU {self.gpu}")
        return " ".join(parts)


@dataclass(frozen=True, slots=True)
class RasCount:
    """``N ranks have launched up to operation V`` (value None: not launched any), with the ranks RAS listed."""

    op: str
    value: int | None
    count: int
    listed: tuple[RasRank, ...] = ()


@dataclass(frozen=True, slots=True)
class RasComm:
    """One communicator block (``#G-C (hash) ERRORS``) or one JSON communicator."""

    label: str
    where: str
    errors: tuple[str, ...] = ()
    size: int | None = None
    counts: tuple[RasCount, ...] = ()
    missing: tuple[RasRank, ...] = ()
    missing_count: int = 0
    statuses: tuple[RasRank, ...] = ()  # ranks RAS lists with a different status (e.g. ABORTED)


@dataclass(frozen=True, slots=True)
class RasRow:
    """One row of the communicators table: group, communicators in it, ranks per communicator, status, errors."""

    group: int
    comms: int
    ranks_per_comm: int
    status: str
    errors: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RasReport:
    where: str
    processes: int | None = None  # job processes in total
    rows: tuple[RasRow, ...] = ()
    comms: tuple[RasComm, ...] = ()
    missing_processes: tuple[RasRank, ...] = ()
    missing_process_count: int = 0
    dead_processes: tuple[RasRank, ...] = ()
    dead_process_count: int = 0
    complete: bool = True  # False: the report was cut off


@dataclass(frozen=True, slots=True)
class FrCollective:
    """One record of fr_trace's text report."""

    where: str
    seq: int | None
    pg: str | None = None
    op: str | None = None
    missing_ranks: tuple[int, ...] = ()
    expected_ranks: tuple[int, ...] = ()
    culprit: int | None = None
    error_type: str | None = None
    expected_state: str | None = None
    found_state: str | None = None
    error: str = ""


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """What one rank runs, as a DETAIL mismatch error prints it."""

    rank: int
    seq: int | None
    op: str | None
    shape: str | None = None
    dtype: str | None = None


@dataclass(frozen=True, slots=True)
class MismatchReport:
    """``Detected mismatch between collectives on ranks``: two (or, in the old form, one) fingerprints."""

    where: str
    sides: tuple[Fingerprint, ...]
    aspects: str = ""
    reported_by: int | None = None


@dataclass(frozen=True, slots=True)
class InspectorRank:
    """One rank's NCCL Inspector records on one communicator: how far it got and how long its calls took."""

    comm: str
    rank: int
    n_ranks: int | None
    host: str | None
    pid: int | None
    last_sn: int
    calls: int
    last_op: str
    durations: tuple[tuple[int, float], ...] = ()  # (coll_sn, microseconds), the latest few hundred


@dataclass(frozen=True, slots=True)
class LogEvidence:
    """Everything the readers found in an incident's logs, and what they could not read."""

    watchdog: tuple[WatchdogRecord, ...] = ()
    ras: tuple[RasReport, ...] = ()
    fr: tuple[FrCollective, ...] = ()
    mismatches: tuple[MismatchReport, ...] = ()
    inspector: tuple[InspectorRank, ...] = ()
    notes: tuple[str, ...] = field(default=())

    def empty(self) -> bool:
        return not (self.watchdog or self.ras or self.fr or self.mismatches or self.inspector)


__all__ = ["Fingerprint", "FrCollective", "InspectorRank", "LogEvidence", "MismatchReport", "RasComm", "RasCount",
           "RasRank", "RasReport", "RasRow", "WatchdogRecord"]
