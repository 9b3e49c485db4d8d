"""The snapshot contract: what one capture of a job looks like.

Every layer speaks these types: probes produce them, the agent ships them
(converted to and from protobuf in one place, ``rankscope.wire.codec``),
analyzers read them, the TUI draws them and bundles store them as JSON.

Rules that keep the contract honest:
- frozen dataclasses with ``slots=True`` and tuple fields, so a snapshot can be
  shared between threads and hashed into caches without copies;
- every capture time is recorded twice, as wall clock (for people and logs)
  and monotonic (for durations that survive clock steps);
- a value that could not be read is ``None`` and the reason is recorded next
  to it (``*_error`` / ``error`` fields), so missing data is never silent.

Stack frames are kept innermost first, the order py-spy reports them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from rankscope.contract.vocabulary import on_device


class ProcessRole(StrEnum):
    """What a process of a rank does; told from its command line and threads."""

    MAIN = "main"
    DATALOADER = "dataloader"
    CHECKPOINT = "checkpoint"
    COMPILE = "compile"
    OTHER = "other"


class CaptureErrorKind(StrEnum):
    """Why a stack (or another per-process reading) is missing."""

    PERMISSION = "permission"  # ptrace not permitted
    GONE = "gone"  # the process exited before or during the capture
    TIMEOUT = "timeout"  # py-spy did not answer within its limit
    NOT_PYTHON = "not-python"  # no Python interpreter found in the process
    TOOL_MISSING = "tool-missing"  # py-spy is not installed
    FAILED = "failed"  # anything else; the message says what
    UNREACHABLE = "unreachable"  # the machine's agent could not be reached


@dataclass(frozen=True, slots=True)
class CaptureError:
    """A failure recorded in place of a value, with the fix a person can apply."""

    kind: CaptureErrorKind
    message: str
    fix: str = ""
    # The process's state when its capture failed, from /proc/<pid>/stat: a
    # one-letter state (R, S, D uninterruptible sleep, T stopped, t traced,
    # Z zombie, ...) or "gone"; None when not read (a dump saved elsewhere).
    process_state: str | None = None
    wchan: str | None = None  # the kernel function it sleeps in (/proc/<pid>/wchan), where readable


@dataclass(frozen=True, slots=True)
class Instant:
    """One moment, as wall clock (epoch seconds) and as monotonic seconds."""

    wall: float
    mono: float


# --------------------------------------------------------------------------
# Stacks
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Frame:
    """One stack frame as py-spy reports it (no addresses are kept)."""

    name: str
    filename: str
    line: int | None = None
    module: str | None = None
    native: bool = False
    is_shim: bool = False


@dataclass(frozen=True, slots=True)
class ThreadStack:
    thread_id: int
    frames: tuple[Frame, ...]
    thread_name: str | None = None
    os_thread_id: int | None = None
    active: bool = False
    owns_gil: bool = False


@dataclass(frozen=True, slots=True)
class ProcessStack:
    """The stacks of one process, or why they are missing."""

    pid: int
    role: ProcessRole
    threads: tuple[ThreadStack, ...] | None
    error: CaptureError | None = None
    name: str = ""
    capture_seconds: float | None = None
    # Why these stacks are known to be incomplete (a saved dump that ends
    # mid-way, a stack cut short by grep); None when nothing says so.
    truncated: str | None = None


def main_thread(process: ProcessStack) -> ThreadStack | None:
    """The process's main thread: the one py-spy names MainThread, else the one whose OS id is the pid, else the first.

    The one rule for "where is this process" (grouping, the TUI's paths, the
    agents' progress memory, the drill's capture summary).
    """
    threads = process.threads or ()
    for t in threads:
        if t.thread_name == "MainThread":
            return t
    for t in threads:
        if t.os_thread_id == process.pid:
            return t
    return threads[0] if threads else None


@dataclass(frozen=True, slots=True)
class RankStacks:
    """Everything captured for one rank: its main process and its children."""

    rank: int
    main: ProcessStack
    subprocesses: tuple[ProcessStack, ...] = ()


# --------------------------------------------------------------------------
# Processes and ranks
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """A process as psutil sees it; per-process readings may be missing."""

    pid: int
    ppid: int
    role: ProcessRole
    name: str
    cmdline: tuple[str, ...] = ()
    state: str | None = None
    cpu_percent: float | None = None
    rss_bytes: int | None = None
    num_threads: int | None = None


@dataclass(frozen=True, slots=True)
class RankInfo:
    """A training rank found on a machine from torchrun's environment."""

    rank: int
    local_rank: int
    world_size: int
    pid: int
    group_rank: int | None = None  # torchrun's node rank
    local_world_size: int | None = None
    run_id: str | None = None  # TORCHELASTIC_RUN_ID
    launcher_pid: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    process: ProcessInfo | None = None
    subprocesses: tuple[ProcessInfo, ...] = ()
    # How the rank number was told, for ranks read from saved dumps, so a wrong
    # guess is visible: the rule first ("file-name", "cmdline", "pid-order",
    # "file-order"), then where it came from. None for ranks found live.
    rank_source: str | None = None
    # Kept by the agent (rankscope.wire.rank_progress), so every client, attached early or late, reads the same job
    # state: when this process last made progress (a step or a collective completed; without counters, its
    # stack changed between captures), None while it has made none yet (importing, at rendezvous); and when
    # the process started (wall clock of its machine).
    last_progress_wall: float | None = None
    started_wall: float | None = None
    # The GPU this process runs on, as NVML sees it (the device holding its compute context; with several, the
    # one where it uses the most memory): index on its machine and UUID. None on CPU, without NVML, or when NVML
    # lists no context of this pid (not started yet, or another pid namespace).
    gpu: int | None = None
    gpu_uuid: str | None = None


# --------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HostMetrics:
    cpu_percent: float | None
    cpu_count: int | None
    mem_total_bytes: int | None
    mem_used_bytes: int | None
    load_1m: float | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class GpuMetrics:
    """One GPU's readings through NVML; a field NVML refused is ``None``."""

    index: int
    name: str | None = None
    uuid: str | None = None
    util_percent: float | None = None
    mem_util_percent: float | None = None
    mem_used_bytes: int | None = None
    mem_total_bytes: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    sm_clock_mhz: float | None = None
    mem_clock_mhz: float | None = None
    pcie_tx_kbps: float | None = None
    pcie_rx_kbps: float | None = None
    nvlink_tx_kbps: float | None = None
    nvlink_rx_kbps: float | None = None
    ecc_corrected: int | None = None
    ecc_uncorrected: int | None = None
    retired_pages: int | None = None
    remapped_rows: int | None = None
    xid_events: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class GpuStatus:
    """NVML's view of the machine; ``available`` is False with a reason when absent."""

    available: bool
    gpus: tuple[GpuMetrics, ...] = ()
    reason: str | None = None
    driver_version: str | None = None


# --------------------------------------------------------------------------
# CCL counters (Aegis Phase 2: CL / WR / WC per communicator and rank)
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Communicator:
    """A process group as the CCL plugin recorded it when it was created."""

    comm_id: str  # the plugin's: NCCL's commHash in hex, the same on every member; the shim's: torch's group id
    backend: str
    description: str
    ranks: tuple[int, ...]  # member global ranks, in group-rank order; () when the recorder did not know them
    comm_nranks: int = 0  # the communicator's size as NCCL reported it (0: unknown)
    comm_rank: int = -1  # this rank's place in it as NCCL reported it (-1: unknown)


@dataclass(frozen=True, slots=True)
class OpCounters:
    """Counters of one operation kind on one communicator, on one rank.

    ``cl``: collective launches; ``wr``: work requests issued; ``wc``: work
    requests completed. ``wc < wr`` means requests are still open.
    """

    comm_id: str
    op: str
    cl: int
    wr: int
    wc: int
    last_launched_seq: int = 0
    last_completed_seq: int = 0
    bytes_total: int = 0
    last_duration_s: float | None = None  # TD of the last completed call
    recent_throughput: tuple[float, ...] = ()  # N: bytes/s of the last L requests
    last_launch_wall: float | None = None
    last_complete_wall: float | None = None
    # peers with open p2p requests: global ranks; in the NCCL plugin's records (communicator ranks == ())
    # ranks in that communicator, which the analyzer maps through the members it joins by comm_rank
    open_peers: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class RankCounters:
    """One rank's counter file as read by the agent."""

    rank: int
    pid: int | None
    world_size: int | None
    job_id: str | None
    heartbeat_wall: float | None
    communicators: tuple[Communicator, ...] = ()
    ops: tuple[OpCounters, ...] = ()
    steps: int | None = None  # optimizer steps seen by the plugin, if any
    last_step_duration_s: float | None = None
    last_step_wall: float | None = None  # when the plugin saw the rank's last optimizer step end
    stale: bool = False
    stale_reason: str | None = None
    error: str | None = None  # corrupt or truncated file: what is wrong and what to do


# --------------------------------------------------------------------------
# Machines and jobs
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StackSampleWindow:
    """A few seconds of one rank's main thread sampled without pausing it, each sample classified.

    The agent samples with ``py-spy record --nonblocking`` and counts the
    samples by what the thread was doing (``contract.frames.classify``):
    waiting in a collective or a point-to-point transfer, computing, loading
    data, or anything else. ``start_wall``/``end_wall`` are the agent's clock.
    A window that could not be sampled has no counts and an ``error``.
    """

    rank: int
    pid: int
    start_wall: float
    end_wall: float
    collective: int = 0
    p2p: int = 0
    compute: int = 0
    data: int = 0
    other: int = 0
    error: CaptureError | None = None

    @property
    def samples(self) -> int:
        return self.collective + self.p2p + self.compute + self.data + self.other

    @property
    def waiting(self) -> int:
        return self.collective + self.p2p


@dataclass(frozen=True, slots=True)
class MachineSnapshot:
    """What one agent reported, or why it could not be reached."""

    machine: str  # the agent's name for its machine (hostname or drill label)
    address: str  # host:port the client used
    reachable: bool
    captured: Instant | None
    hostname: str | None = None
    ranks: tuple[RankInfo, ...] = ()
    stacks: tuple[RankStacks, ...] = ()
    host: HostMetrics | None = None
    gpus: GpuStatus | None = None
    counters: tuple[RankCounters, ...] = ()
    error: CaptureError | None = None
    samples: tuple[StackSampleWindow, ...] = ()  # sampled main-thread windows, when a client asked for sampling
    # The agent's memory of its job (rankscope.wire.rank_progress): launches of the job's ranks it has seen on this
    # machine (a new set of pids is a new one), and when it last saw any rank of the job here.
    generation: int | None = None
    ranks_seen_wall: float | None = None


DIMS: tuple[str, ...] = ("tp", "cp", "ep", "dp", "pp")
"""Every parallel dimension, in Megatron's default rank order (fastest varying first)."""

DEFAULT_ORDER = "-".join(DIMS)

DIM_WORDS: dict[str, str] = {"tp": "tensor", "pp": "pipeline", "dp": "data", "cp": "context", "ep": "expert"}
"""Each dimension's word, as a person or a communicator's description spells it."""

SIZES_FIX = "leave a dimension out (or give it 1) when the job does not use it"


def order_names(order: str) -> tuple[str, ...]:
    """The dimensions an order string names, as written (lower case; '-', '_', ',' or spaces between them)."""
    return tuple(p for p in re.split(r"[-_,\s]+", order.strip().lower()) if p)


@dataclass(frozen=True, slots=True)
class Layout:
    """Parallel sizes and rank order, as typed by the user or found in the job."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    order: str = DEFAULT_ORDER  # Megatron's default: tp varies fastest
    ranks_per_machine: int | None = None

    SIZES = ("tp", "pp", "dp", "cp", "ep")  # the parallel sizes, in the order they are shown

    def bad_sizes(self) -> dict[str, object]:
        """The sizes that are not whole numbers of at least 1 (ranks per machine too, when given): refuse them."""
        values: dict[str, object] = {d: getattr(self, d) for d in self.SIZES}
        if self.ranks_per_machine is not None:
            values["ranks_per_machine"] = self.ranks_per_machine
        return {k: v for k, v in values.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1}

    def size_problems(self, name: Callable[[str], str] = str) -> str | None:
        """The one wording of the sizes ``bad_sizes`` refuses, each called as its reader typed it (``name``: 'tp'
        -> '--tp' on the command line, '[layout] tp' in a config file); None when every size is good."""
        bad = self.bad_sizes()
        if not bad:
            return None
        return "; ".join(f"{name(k)} must be a whole number of at least 1, got {v!r}" for k, v in bad.items())

    def order_names(self) -> tuple[str, ...]:
        """The dimensions the order string names, as written (lower case; '-', '_', ',' or spaces between them)."""
        return order_names(self.order)

    def sizes_text(self, none: str = "no parallel sizes", per_machine: bool = False) -> str:
        """"TP=2 PP=4": the sizes above 1, or ``none``; with ``per_machine`` the ranks per machine after a comma
        (", 8/machine") when known. The one text of a layout: analyze, the backup plan and the TUI's header."""
        text = " ".join(f"{d.upper()}={getattr(self, d)}" for d in self.SIZES if getattr(self, d) > 1) or none
        return f"{text}, {self.ranks_per_machine}/machine" if per_machine and self.ranks_per_machine else text


@dataclass(frozen=True, slots=True)
class JobSnapshot:
    """One capture of a whole job across its machines."""

    captured: Instant
    machines: tuple[MachineSnapshot, ...]
    job_id: str | None = None
    layout: Layout | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def world_size(self) -> int | None:
        sizes = {r.world_size for m in self.machines for r in m.ranks}
        return max(sizes) if sizes else None

    def rank_to_machine(self) -> dict[int, str]:
        """Which machine's agent saw each rank."""
        return {r.rank: m.machine for m in self.machines for r in m.ranks}

    def all_stacks(self) -> dict[int, RankStacks]:
        return {s.rank: s for m in self.machines for s in m.stacks}

    def all_counters(self) -> dict[int, RankCounters]:
        return {c.rank: c for m in self.machines for c in m.counters}

    def collectives_on_device(self) -> bool:
        """Whether the job's collectives run on an accelerator: a communicator of a device backend was recorded
        (the host only enqueues them, so its stacks say little of how fast the device work goes)."""
        return any(on_device(c.backend) for m in self.machines for rc in m.counters for c in rc.communicators)

    def all_samples(self) -> tuple[StackSampleWindow, ...]:
        return tuple(w for m in self.machines for w in m.samples)
