"""What the crash-log reader produces: one event per error line, with where, when, who and whom it names.

``formats.crash_logs`` writes these; ``analyzers.crash_cascade`` judges them. Both import them from here, below the
judges. Stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class CrashKind(StrEnum):
    HARDWARE = "hardware"  # critical: a GPU, NVLink, ECC, PCIe or NIC fault
    GPU = "gpu"  # a CUDA failure or a non-fatal Xid: a kernel's or a program's fault on one GPU
    PROGRAM = "program"  # a process's own error (out of memory, an exception)
    NETWORK = "network"  # a broken connection, naming its peer where the line does
    DIST = "distributed"  # DistBackendError, ncclRemoteError, NCCL error: a collective failed
    TIMEOUT = "timeout"  # a watchdog timeout: a victim
    ABORT = "abort"  # SIGABRT, a watchdog's abort, terminate: a victim
    EXIT = "exit"  # torchelastic's record of a process that exited


@dataclass(frozen=True, slots=True)
class CrashEvent:
    """One error line (or torchelastic record) and what it says: where, when, who, and whom it names."""

    where: str  # file:line
    kind: CrashKind
    text: str  # what it says, short
    host: str | None = None
    rank: int | None = None
    gpu: str | None = None  # a CUDA device index or a PCI address, as the line gives it
    time: float | None = None  # seconds (comparable across the evidence; None: the line gives no clock time)
    peer: str | None = None  # the host (or address) a connection error names
    root_claim: bool = False  # torchelastic's "Root Cause (first observed failure)"
    exitcode: int | None = None


@dataclass(frozen=True, slots=True)
class CrashEvidence:
    events: tuple[CrashEvent, ...] = ()
    notes: tuple[str, ...] = field(default=())


__all__ = ["CrashEvent", "CrashEvidence", "CrashKind"]
