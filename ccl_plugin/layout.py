"""The one binary layout of a rank's CCL counter file (Aegis Phase-2 CL/WR/WC).

Every writer (the Python hooks in ``torch_hooks``, the NCCL profiler plugin in
``nccl/profiler.c``) and the reader (``rankscope.probes.ccl_counters``) take
their offsets from here; ``nccl/rankscope_layout.h`` is generated from this
module by ``c_header()`` and a test checks the shipped copy matches.

File = header | communicator table | op-slot table | member pool, all little
endian, every 8-byte field 8-aligned so a C struct has the same offsets.

Header (``HEADER_SIZE`` bytes): identity (magic, version, pid, rank, world
size, job id) plus the mutable fields a reader wants together (heartbeat,
steps, used counts), guarded by the header ``seq``.

Communicator entry: written once when a process group is first seen (id,
backend, description such as ``PIPELINE_MODEL_PARALLEL_GROUP``, member global
ranks as a slice of the member pool, and since version 2 the communicator's
size and this rank's place in it as NCCL's init reported them: NCCL tells a
plugin its commHash, nranks and rank, never the members' global ranks, so
files that report one commHash are joined into one communicator by readers).

Op slot: one per (communicator, operation): CL, WR, WC, sequence numbers,
bytes, TD, the ring of the last ``RING_LEN`` throughputs (N), and the peers of
open point-to-point requests.

Seqlock protocol (one writer, many readers, no torn values):
  writer: seq += 1 (odd), store the fields, seq += 1 (even);
  reader: s1 = seq; if odd retry; copy the bytes; s2 = seq; accept if s1 == s2.
The seq is always stored on its own (Python's struct.pack_into zeroes its
target before filling it, so a seq packed with the fields would pass for an
even 0 mid-update). The writer publishes a new communicator or slot by filling
it first and only then raising ``n_comms`` / ``n_ops`` in the header. A reader needs no lock and
never blocks the writer, so a process hung with its GIL held is still read.

A file left by a dead process is recognised by its pid (and the pid's start
time, against pid reuse) or, when the pid is not visible, by an old heartbeat.
"""

from __future__ import annotations

import struct

MAGIC = b"RSCCLCTR"
VERSION = 2
# Versions this reader still understands: 1 lacked the communicator's NCCL size and rank (its description
# was 8 bytes longer); everything else is the same.
READABLE_VERSIONS = (1, 2)
FILE_SUFFIX = ".ccl"
DEFAULT_DIR = "/dev/shm/rankscope"

# Environment shared by `rankscope run`, the .pth hook and the NCCL plugin.
ENV_ENABLE = "RANKSCOPE_CCL"  # "1" turns the in-process hooks on
ENV_DIR = "RANKSCOPE_CCL_DIR"  # where counter files go (default DEFAULT_DIR)
ENV_JOB_ID = "RANKSCOPE_JOB_ID"  # job id written into the header and the file name

JOB_ID_LEN = 64
COMM_ID_LEN = 64
BACKEND_LEN = 16
DESC_LEN = 88
DESC_LEN_V1 = 96
OP_NAME_LEN = 32
RING_LEN = 5  # Aegis §5.2: throughput of the last L=5 work requests
MAX_OPEN_PEERS = 8
MAX_COMMS = 128
MAX_OPS = 512
MEMBER_POOL = 65536  # int32 global ranks shared by all communicator entries

WRITER_PYTHON = 1
WRITER_NCCL = 2
FLAG_CLEAN_EXIT = 1

# ---- header ----------------------------------------------------------------
# (name, struct code, C type); order is the file order.
HEADER_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("magic", "8s", "char magic[8]"),
    ("version", "I", "uint32_t version"),
    ("header_size", "I", "uint32_t header_size"),
    ("file_size", "Q", "uint64_t file_size"),
    ("seq", "Q", "uint64_t seq"),
    ("pid", "q", "int64_t pid"),
    ("pid_start_ticks", "Q", "uint64_t pid_start_ticks"),
    ("rank", "i", "int32_t rank"),
    ("world_size", "i", "int32_t world_size"),
    ("writer_kind", "I", "uint32_t writer_kind"),
    ("flags", "I", "uint32_t flags"),
    ("created_wall", "d", "double created_wall"),
    ("heartbeat_wall", "d", "double heartbeat_wall"),
    ("steps", "Q", "uint64_t steps"),
    ("last_step_duration", "d", "double last_step_duration"),
    ("last_step_wall", "d", "double last_step_wall"),
    ("n_comms", "I", "uint32_t n_comms"),
    ("n_ops", "I", "uint32_t n_ops"),
    ("max_comms", "I", "uint32_t max_comms"),
    ("max_ops", "I", "uint32_t max_ops"),
    ("member_pool_size", "I", "uint32_t member_pool_size"),
    ("members_used", "I", "uint32_t members_used"),
    ("comm_table_offset", "Q", "uint64_t comm_table_offset"),
    ("op_table_offset", "Q", "uint64_t op_table_offset"),
    ("member_pool_offset", "Q", "uint64_t member_pool_offset"),
    ("job_id", f"{JOB_ID_LEN}s", f"char job_id[{JOB_ID_LEN}]"),
    ("reserved", "40s", "char reserved[40]"),
)
HEADER = struct.Struct("<" + "".join(f for _, f, _ in HEADER_FIELDS))
HEADER_SIZE = HEADER.size  # 256

# The header's mutable part, rewritten under the header seqlock in one store.
HEADER_MUTABLE_OFFSET = 72  # heartbeat_wall
HEADER_MUTABLE = struct.Struct("<dQddIIIIII")  # heartbeat .. members_used
HEADER_SEQ_OFFSET = 24
HEADER_FLAGS_OFFSET = 60
SEQ = struct.Struct("<Q")
U32 = struct.Struct("<I")

# ---- communicator entry -------------------------------------------------
COMM_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("seq", "Q", "uint64_t seq"),
    ("member_offset", "I", "uint32_t member_offset"),
    ("n_members", "I", "uint32_t n_members"),
    ("comm_id", f"{COMM_ID_LEN}s", f"char comm_id[{COMM_ID_LEN}]"),
    ("backend", f"{BACKEND_LEN}s", f"char backend[{BACKEND_LEN}]"),
    ("description", f"{DESC_LEN}s", f"char description[{DESC_LEN}]"),
    ("comm_nranks", "i", "int32_t comm_nranks"),  # 0: unknown
    ("comm_rank", "i", "int32_t comm_rank"),  # -1: unknown
)
COMM = struct.Struct("<" + "".join(f for _, f, _ in COMM_FIELDS))
COMM_SIZE = COMM.size  # 192
# Version 1's entry: the same size, no comm_nranks / comm_rank, a longer description.
COMM_V1 = struct.Struct(f"<QII{COMM_ID_LEN}s{BACKEND_LEN}s{DESC_LEN_V1}s")
assert COMM_V1.size == COMM_SIZE

# ---- op slot -----------------------------------------------------------
OP_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("seq", "Q", "uint64_t seq"),
    ("comm_index", "I", "uint32_t comm_index"),
    ("reserved0", "I", "uint32_t reserved0"),
    ("op", f"{OP_NAME_LEN}s", f"char op[{OP_NAME_LEN}]"),
    ("cl", "Q", "uint64_t cl"),
    ("wr", "Q", "uint64_t wr"),
    ("wc", "Q", "uint64_t wc"),
    ("last_launched_seq", "Q", "uint64_t last_launched_seq"),
    ("last_completed_seq", "Q", "uint64_t last_completed_seq"),
    ("bytes_total", "Q", "uint64_t bytes_total"),
    ("last_duration", "d", "double last_duration"),
    ("last_launch_wall", "d", "double last_launch_wall"),
    ("last_complete_wall", "d", "double last_complete_wall"),
    ("ring", f"{RING_LEN}d", f"double ring[{RING_LEN}]"),
    ("ring_next", "I", "uint32_t ring_next"),
    ("ring_count", "I", "uint32_t ring_count"),
    ("n_open_peers", "I", "uint32_t n_open_peers"),
    ("reserved1", "I", "uint32_t reserved1"),
    ("open_peers", f"{MAX_OPEN_PEERS}i", f"int32_t open_peers[{MAX_OPEN_PEERS}]"),
)
OP = struct.Struct("<" + "".join(f for _, f, _ in OP_FIELDS))
OP_SIZE = OP.size  # 208
OP_STATIC = struct.Struct(f"<II{OP_NAME_LEN}s")  # comm_index, reserved0, op at offset 8
OP_DYNAMIC_OFFSET = 48  # cl .. open_peers, stored in one pack under the slot seqlock
OP_DYNAMIC = struct.Struct(f"<QQQQQQddd{RING_LEN}dIIII{MAX_OPEN_PEERS}i")

MEMBER = struct.Struct("<i")

COMM_TABLE_OFFSET = HEADER_SIZE
OP_TABLE_OFFSET = COMM_TABLE_OFFSET + MAX_COMMS * COMM_SIZE
MEMBER_POOL_OFFSET = OP_TABLE_OFFSET + MAX_OPS * OP_SIZE
FILE_SIZE = MEMBER_POOL_OFFSET + MEMBER_POOL * MEMBER.size


def _offsets(fields: tuple[tuple[str, str, str], ...]) -> dict[str, int]:
    out: dict[str, int] = {}
    pos = 0
    for name, fmt, _ in fields:
        out[name] = pos
        pos += struct.calcsize("<" + fmt)
    return out


HEADER_OFFSETS = _offsets(HEADER_FIELDS)
COMM_OFFSETS = _offsets(COMM_FIELDS)
OP_OFFSETS = _offsets(OP_FIELDS)

assert HEADER_OFFSETS["heartbeat_wall"] == HEADER_MUTABLE_OFFSET
assert HEADER_OFFSETS["seq"] == HEADER_SEQ_OFFSET and HEADER_OFFSETS["flags"] == HEADER_FLAGS_OFFSET
assert HEADER_MUTABLE_OFFSET + HEADER_MUTABLE.size == HEADER_OFFSETS["comm_table_offset"]
assert OP_OFFSETS["cl"] == OP_DYNAMIC_OFFSET and OP_DYNAMIC_OFFSET + OP_DYNAMIC.size == OP_SIZE
assert all(v % 8 == 0 for v in (HEADER_SIZE, COMM_SIZE, OP_SIZE))


def comm_offset(index: int) -> int:
    return COMM_TABLE_OFFSET + index * COMM_SIZE


def op_offset(index: int) -> int:
    return OP_TABLE_OFFSET + index * OP_SIZE


def member_offset(index: int) -> int:
    return MEMBER_POOL_OFFSET + index * MEMBER.size


def file_name(job_id: str, rank: int) -> str:
    """``<job_id>.rank<R>.ccl``: one file per rank, the job id keeps jobs apart."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in job_id) or "job"
    return f"{safe}.rank{rank}{FILE_SUFFIX}"


def encode(text: str, size: int) -> bytes:
    """NUL-padded UTF-8, cut to fit (always leaves one NUL for C readers)."""
    raw = text.encode("utf-8", "replace")[: size - 1]
    return raw + b"\0" * (size - len(raw))


def decode(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


# ---- the C header --------------------------------------------------------


def _c_struct(name: str, fields: tuple[tuple[str, str, str], ...], size: int) -> str:
    lines = [f"typedef struct {name} {{"]
    lines += [f"  {ctype};" for _, _, ctype in fields]
    lines.append(f"}} {name};")
    lines.append(f'_Static_assert(sizeof({name}) == {size}, "{name} size differs from layout.py");')
    return "\n".join(lines)


def c_header() -> str:
    """The C declaration of this layout (ccl_plugin/nccl/rankscope_layout.h)."""
    consts = {
        "RS_MAGIC": f'"{MAGIC.decode()}"',
        "RS_VERSION": str(VERSION),
        "RS_JOB_ID_LEN": str(JOB_ID_LEN),
        "RS_COMM_ID_LEN": str(COMM_ID_LEN),
        "RS_BACKEND_LEN": str(BACKEND_LEN),
        "RS_DESC_LEN": str(DESC_LEN),
        "RS_OP_NAME_LEN": str(OP_NAME_LEN),
        "RS_RING_LEN": str(RING_LEN),
        "RS_MAX_OPEN_PEERS": str(MAX_OPEN_PEERS),
        "RS_MAX_COMMS": str(MAX_COMMS),
        "RS_MAX_OPS": str(MAX_OPS),
        "RS_MEMBER_POOL": str(MEMBER_POOL),
        "RS_WRITER_PYTHON": str(WRITER_PYTHON),
        "RS_WRITER_NCCL": str(WRITER_NCCL),
        "RS_FLAG_CLEAN_EXIT": str(FLAG_CLEAN_EXIT),
        "RS_HEADER_SIZE": str(HEADER_SIZE),
        "RS_COMM_SIZE": str(COMM_SIZE),
        "RS_OP_SIZE": str(OP_SIZE),
        "RS_COMM_TABLE_OFFSET": str(COMM_TABLE_OFFSET),
        "RS_OP_TABLE_OFFSET": str(OP_TABLE_OFFSET),
        "RS_MEMBER_POOL_OFFSET": str(MEMBER_POOL_OFFSET),
        "RS_FILE_SIZE": str(FILE_SIZE),
    }
    parts = [
        "/* Generated from rankscope/ccl_plugin/layout.py by c_header(); do not edit.",
        " * tests/integration/test_ccl_layout.py checks this file matches the Python layout.",
        " * Seqlock: writer makes seq odd, stores fields, makes seq even; readers retry",
        " * while seq is odd or changed across their copy. */",
        "#ifndef RANKSCOPE_LAYOUT_H",
        "#define RANKSCOPE_LAYOUT_H",
        "#include <stdint.h>",
        "",
        *[f"#define {k} {v}" for k, v in consts.items()],
        f'#define RS_ENV_ENABLE "{ENV_ENABLE}"',
        f'#define RS_ENV_DIR "{ENV_DIR}"',
        f'#define RS_ENV_JOB_ID "{ENV_JOB_ID}"',
        f'#define RS_DEFAULT_DIR "{DEFAULT_DIR}"',
        "",
        _c_struct("rs_header", HEADER_FIELDS, HEADER_SIZE),
        "",
        _c_struct("rs_comm", COMM_FIELDS, COMM_SIZE),
        "",
        _c_struct("rs_op", OP_FIELDS, OP_SIZE),
        "",
        "#endif",
        "",
    ]
    return "\n".join(parts)
