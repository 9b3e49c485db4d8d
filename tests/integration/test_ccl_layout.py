"""The counter file's layout: one definition shared by writers and reader, seqlock, stale and corrupt files."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rankscope.ccl_plugin import layout as L
from rankscope.ccl_plugin.build import BuildError, find_compiler
from rankscope.ccl_plugin.writer import CounterWriter
from rankscope.contract.snapshot import RankInfo
from rankscope.probes.ccl_counters import list_counter_files, read_counter_file, read_counters
from repo_paths import ROOT
from shim_paths import PATHS, fast


def test_shipped_c_header_is_generated_from_layout() -> None:
    assert (ROOT / "ccl_plugin" / "nccl" / "rankscope_layout.h").read_text() == L.c_header()


@pytest.mark.skipif(find_compiler() is None, reason="no C compiler")
def test_c_compiler_agrees_with_python_offsets(tmp_path: Path) -> None:
    checks = "".join(
        f'  printf("{struct} {name} %zu\\n", offsetof({struct}, {name}));\n'
        for struct, fields in (("rs_header", L.HEADER_FIELDS), ("rs_comm", L.COMM_FIELDS), ("rs_op", L.OP_FIELDS))
        for name, _, _ in fields)
    src = tmp_path / "off.c"
    src.write_text(f'#include <stdio.h>\n#include <stddef.h>\n#include "rankscope_layout.h"\nint main(void) {{\n{checks}  return 0;\n}}\n')
    exe = tmp_path / "off"
    cc = find_compiler()
    assert cc is not None
    subprocess.run([cc, "-std=c11", "-I", str(ROOT / "ccl_plugin" / "nccl"), "-o", str(exe), str(src)], check=True)
    got = {tuple(line.split()[:2]): int(line.split()[2]) for line in subprocess.run(
        [str(exe)], capture_output=True, text=True, check=True).stdout.splitlines()}
    want = {**{("rs_header", k): v for k, v in L.HEADER_OFFSETS.items()},
            **{("rs_comm", k): v for k, v in L.COMM_OFFSETS.items()},
            **{("rs_op", k): v for k, v in L.OP_OFFSETS.items()}}
    assert got == want


@pytest.mark.parametrize("path", PATHS)
def test_round_trip_of_every_field(tmp_path: Path, path: str) -> None:
    w = CounterWriter(tmp_path, rank=5, world_size=8, job_id="jobA", fast=fast(path))
    c = w.comm("7", "gloo", "PIPELINE_MODEL_PARALLEL_GROUP", (1, 5, 9, 13))
    ar = w.slot(c, "all_reduce")
    for _ in range(3):
        w.complete(w.launch(ar, 1000))
    open_req = w.launch(ar, 1000)
    send = w.slot(c, "send")
    w.launch(send, 64, peer=9)
    w.step()
    w.step()
    got = read_counter_file(w.path).counters
    assert (got.rank, got.pid, got.world_size, got.job_id, got.steps) == (5, os.getpid(), 8, "jobA", 2)
    assert got.last_step_duration_s is not None and got.last_step_duration_s > 0
    assert not got.stale and got.error is None
    assert [(x.comm_id, x.backend, x.description, x.ranks) for x in got.communicators] == [
        ("7", "gloo", "PIPELINE_MODEL_PARALLEL_GROUP", (1, 5, 9, 13))]
    ops = {o.op: o for o in got.ops}
    a = ops["all_reduce"]
    assert (a.cl, a.wr, a.wc, a.bytes_total, a.last_launched_seq, a.last_completed_seq) == (4, 4, 3, 4000, 4, 3)
    assert len(a.recent_throughput) == 3 and all(t > 0 for t in a.recent_throughput)
    assert a.last_duration_s is not None and a.open_peers == ()
    s = ops["send"]
    assert (s.cl, s.wr, s.wc, s.open_peers, s.last_launched_seq) == (1, 1, 0, (9,), 5)
    w.complete(open_req)
    assert {o.op: o.wc for o in read_counter_file(w.path).counters.ops}["all_reduce"] == 4
    w.close()
    assert not w.path.exists()


@pytest.mark.parametrize("path", PATHS)
def test_ring_keeps_the_last_five_oldest_first(tmp_path: Path, path: str) -> None:
    w = CounterWriter(tmp_path, rank=0, world_size=1, job_id="ring", fast=fast(path))
    s = w.slot(w.comm("0", "gloo", "", (0,)), "all_reduce")
    stored = []
    for i in range(7):
        w.complete(w.launch(s, 100 * (i + 1)))
        ring = L.OP.unpack_from(w._mm, s.offset)[list(L.OP_OFFSETS).index("ring"):][: L.RING_LEN]
        stored.append(next(x for x in ring if x not in stored))  # the throughput this completion added
    assert all(x > 0 for x in stored)
    assert list(read_counter_file(w.path).counters.ops[0].recent_throughput) == stored[-L.RING_LEN:]
    w.close()


HAMMER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from rankscope.ccl_plugin import native
    from rankscope.ccl_plugin.writer import CounterWriter
    fast = native.load({}) if sys.argv[2] == "native" else None
    assert (fast is not None) == (sys.argv[2] == "native")
    w = CounterWriter(Path(sys.argv[1]), rank=0, world_size=2, job_id="hammer", fast=fast)
    s = w.slot(w.comm("0", "gloo", "world", (0, 1)), "all_reduce")
    print("ready", flush=True)
    i = 0
    while True:  # every store keeps the invariants wc == wr == cl and bytes == 8 * cl
        w.complete(w.launch(s, 8))
        i += 1
""")


@pytest.mark.parametrize("path", PATHS)
def test_reader_in_another_process_never_sees_a_torn_slot(tmp_path: Path, path: str) -> None:
    fast(path)  # skips the native case where nothing builds it
    proc = subprocess.Popen([sys.executable, "-c", HAMMER, str(tmp_path), path], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        path = tmp_path / L.file_name("hammer", 0)
        seen = set()
        # A bound for a wedged writer only: on a loaded 2-core host 2,000 reads and the writer's progress take long.
        deadline = time.monotonic() + 300
        reads = 0
        while (reads < 2000 or len(seen) <= 10) and time.monotonic() < deadline:
            got = read_counter_file(path).counters
            assert got.error is None, got.error
            (op,) = got.ops
            # a torn read would mix fields of two updates: launch and completion differ by at most one
            assert op.cl == op.wr and op.wc in (op.cl, op.cl - 1) and op.bytes_total == 8 * op.cl, op
            seen.add(op.cl)
            reads += 1
        assert reads >= 2000 and len(seen) > 10, (reads, len(seen))  # the writer really moved while we read
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_dead_writer_is_stale_and_pid_reuse_is_caught(tmp_path: Path) -> None:
    code = ("import sys; from pathlib import Path; from rankscope.ccl_plugin.writer import CounterWriter;"
            "CounterWriter(Path(sys.argv[1]), rank=3, world_size=4, job_id='dead')")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=60)
    (f,) = list_counter_files(tmp_path)
    assert f.counters.rank == 3 and f.counters.stale and "gone" in (f.counters.stale_reason or "")
    # the same file, pointed at a live pid with another start time: reused pid
    w = CounterWriter(tmp_path, rank=1, world_size=4, job_id="reuse")
    raw = bytearray(w.path.read_bytes())
    raw[L.HEADER_OFFSETS["pid_start_ticks"]:L.HEADER_OFFSETS["pid_start_ticks"] + 8] = (12345).to_bytes(8, "little")
    w.path.write_bytes(bytes(raw))
    got = read_counter_file(w.path).counters
    assert got.stale and "another process" in (got.stale_reason or "")


def test_corrupt_and_truncated_files_are_reported(tmp_path: Path) -> None:
    w = CounterWriter(tmp_path, rank=2, world_size=4, job_id="bad")
    w.comm("0", "gloo", "", (0, 1, 2, 3))
    full = w.path.read_bytes()
    cases = {
        "short.rank0.ccl": full[:100],
        "half.rank1.ccl": full[: len(full) // 2],
        "magic.rank2.ccl": b"XXXXXXXX" + full[8:],
        "version.rank3.ccl": full[:8] + (99).to_bytes(4, "little") + full[12:],
        "tables.rank4.ccl": full[:L.HEADER_OFFSETS["n_comms"]] + (10**6).to_bytes(4, "little")
        + full[L.HEADER_OFFSETS["n_comms"] + 4:],
    }
    w.close()
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
    got = {f.path.name: f.counters for f in list_counter_files(tmp_path)}
    assert set(got) == set(cases)
    for name, c in got.items():
        assert c.error is not None and "unreadable" in c.error, name
        assert c.rank == int(name.split(".rank")[1].split(".")[0])
    assert "truncated" in (got["short.rank0.ccl"].error or "") and "truncated" in (got["half.rank1.ccl"].error or "")
    assert "magic" in (got["magic.rank2.ccl"].error or "") and "version 99" in (got["version.rank3.ccl"].error or "")


def test_read_counters_matches_files_to_ranks_by_pid(tmp_path: Path) -> None:
    me = os.getpid()
    w = CounterWriter(tmp_path, rank=4, world_size=8, job_id="match")
    s = w.slot(w.comm("0", "gloo", "", tuple(range(8))), "barrier")
    w.complete(w.launch(s, 0))
    infos = [RankInfo(rank=4, local_rank=0, world_size=8, pid=me), RankInfo(rank=5, local_rank=1, world_size=8, pid=1)]
    (got,) = read_counters(infos, tmp_path)
    assert got.rank == 4 and got.pid == me and got.ops[0].cl == 1
    assert read_counters(infos, tmp_path / "absent") == ()
    w.close()


def test_build_error_carries_a_fix() -> None:
    err = BuildError("no C compiler found", "install gcc")
    assert err.fix == "install gcc" and "no C compiler" in err.message


def test_communicator_identity_round_trips(tmp_path: Path) -> None:
    w = CounterWriter(tmp_path, rank=5, world_size=8, job_id="ident")
    w.comm("7", "gloo", "PIPELINE_MODEL_PARALLEL_GROUP", (1, 5, 9, 13))
    w.comm("8", "gloo", "", (0, 2))  # not a member: its place is unknown
    got = read_counter_file(w.path).counters.communicators
    assert [(c.comm_nranks, c.comm_rank) for c in got] == [(4, 1), (2, -1)]
    w.close()


def _as_version_1(path: Path, description: str) -> None:
    """Rewrite a version-2 file as the previous layout wrote it (same size; longer description, no identity)."""
    raw = bytearray(path.read_bytes())
    raw[L.HEADER_OFFSETS["version"]:L.HEADER_OFFSETS["version"] + 4] = (1).to_bytes(4, "little")
    off = L.comm_offset(0)
    _, first, count, cid, backend, _, _, _ = L.COMM.unpack_from(raw, off)
    L.COMM_V1.pack_into(raw, off, 2, first, count, cid, backend, L.encode(description, L.DESC_LEN_V1))
    path.write_bytes(bytes(raw))


def test_version_1_files_are_still_read(tmp_path: Path) -> None:
    w = CounterWriter(tmp_path, rank=0, world_size=2, job_id="old")
    s = w.slot(w.comm("3", "nccl", "x", (0, 1)), "all_reduce")
    w.complete(w.launch(s, 8))
    long_desc = "D" * (L.DESC_LEN_V1 - 1)  # longer than version 2 has room for
    _as_version_1(w.path, long_desc)
    got = read_counter_file(w.path).counters
    assert got.error is None
    (c,) = got.communicators
    assert (c.comm_id, c.backend, c.description, c.ranks, c.comm_nranks, c.comm_rank) == (
        "3", "nccl", long_desc, (0, 1), 0, -1)
    assert [(o.op, o.cl, o.wc) for o in got.ops] == [("all_reduce", 1, 1)]
    w.close()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(nranks=st.integers(-(2**31), 2**31 - 1), rank=st.integers(-(2**31), 2**31 - 1),
       text=st.binary(min_size=L.COMM_ID_LEN + L.BACKEND_LEN + L.DESC_LEN,
                      max_size=L.COMM_ID_LEN + L.BACKEND_LEN + L.DESC_LEN))
def test_any_communicator_entry_reads_without_raising(tmp_path: Path, nranks: int, rank: int, text: bytes) -> None:
    """A writer's bytes are outside input: identity numbers that make no sense read as unknown."""
    w = CounterWriter(tmp_path, rank=0, world_size=1, job_id="fuzz")
    w.comm("0", "nccl", "", ())
    raw = bytearray(w.path.read_bytes())
    w.close()
    cid, backend, desc = (text[:L.COMM_ID_LEN], text[L.COMM_ID_LEN:L.COMM_ID_LEN + L.BACKEND_LEN],
                          text[L.COMM_ID_LEN + L.BACKEND_LEN:])
    L.COMM.pack_into(raw, L.comm_offset(0), 2, 0, 0, cid, backend, desc, nranks, rank)
    path = tmp_path / "fuzz.rank0.ccl"
    path.write_bytes(bytes(raw))
    got = read_counter_file(path).counters
    assert got.error is None
    (c,) = got.communicators
    sane = -1 <= rank < nranks  # a size with this rank's place in it, or with the place unknown
    assert (c.comm_nranks, c.comm_rank) == ((nranks, rank) if sane else (0, -1))
