"""The NCCL profiler plugin, driven through its v5 and v4 entry points by a C harness (no NCCL, no GPU here)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from rankscope.ccl_plugin.build import BuildError, build_plugin, find_compiler, source_dir
from rankscope.probes.ccl_counters import list_counter_files, read_counter_file

pytestmark = pytest.mark.skipif(find_compiler() is None, reason="no C compiler")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("plugin")
    lib = build_plugin(out)
    harness = out / "harness"
    cc = find_compiler()
    assert cc is not None
    subprocess.run([cc, "-O2", "-std=c11", "-Wall", "-Werror", "-I", str(source_dir()), "-o", str(harness),
                    str(source_dir() / "harness.c"), "-ldl"], check=True)
    return lib, harness


def test_plugin_exports_only_the_profiler_tables(built: tuple[Path, Path]) -> None:
    lib, _ = built
    syms = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    exported = {line.split()[-1] for line in syms.splitlines() if line.split()[-2] in {"D", "B", "T"}}
    assert exported == {"ncclProfiler_v5", "ncclProfiler_v4"}


@pytest.mark.parametrize("abi", ["5", "4"])
def test_harness_events_become_counters_in_the_shared_file(built: tuple[Path, Path], tmp_path: Path, abi: str) -> None:
    lib, harness = built
    env = {**os.environ, "RANKSCOPE_CCL_DIR": str(tmp_path), "RANKSCOPE_JOB_ID": "nc", "RANK": "5", "WORLD_SIZE": "8",
           "RS_HARNESS_ABI": abi}
    proc = subprocess.Popen([str(harness), str(lib), "counts"], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "ready"
        (f,) = list_counter_files(tmp_path)
        c = f.counters
        assert f.path.name == "nc.rank5.nccl.ccl"
        assert (c.rank, c.world_size, c.pid, c.job_id, c.stale, c.error) == (5, 8, proc.pid, "nc", False, None)
        assert [(x.comm_id, x.backend, x.description) for x in c.communicators] == [
            ("000000000000a1a1", "nccl", "PIPELINE_MODEL_PARALLEL_GROUP"),
            ("000000000000b2b2", "nccl", "TENSOR_MODEL_PARALLEL_GROUP")]
        ops = {(o.comm_id[-4:], o.op): o for o in c.ops}
        ar = ops[("a1a1", "AllReduce")]
        # 5 complete collectives x (send + recv op) x 2 steps, plus the sixth's stuck receive
        assert (ar.cl, ar.wr, ar.wc, ar.last_launched_seq, ar.last_completed_seq) == (6, 21, 20, 6, 5)
        assert ar.bytes_total == 6 * 1024 * 4 and len(ar.recent_throughput) == 5
        assert all(t > 0 for t in ar.recent_throughput) and ar.last_duration_s is not None
        send = ops[("a1a1", "Send")]
        assert (send.cl, send.wr, send.wc, send.open_peers, send.bytes_total) == (3, 3, 3, (), 3 * 256)
        recv = ops[("a1a1", "Recv")]
        assert (recv.cl, recv.wr, recv.wc, recv.open_peers) == (1, 1, 0, (3,))
        ag = ops[("b2b2", "AllGather")]  # no network: kernel channels are the requests
        assert (ag.cl, ag.wr, ag.wc) == (2, 4, 4)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "finalized"
        assert proc.wait(timeout=30) == 0
        assert list_counter_files(tmp_path) == ()  # removed when the last communicator finalizes
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_missing_compiler_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(BuildError) as err:
        build_plugin(tmp_path / "out")
    assert "no C compiler" in err.value.message and "gcc" in err.value.fix


def test_c_writer_under_load_never_shows_a_torn_slot(built: tuple[Path, Path], tmp_path: Path) -> None:
    """The harness's bench loop rewrites one slot millions of times while we read it."""
    lib, harness = built
    env = {**os.environ, "RANKSCOPE_CCL_DIR": str(tmp_path), "RANKSCOPE_JOB_ID": "hammer", "RANK": "0"}
    proc = subprocess.Popen([str(harness), str(lib), "bench", "200000000"], env=env, stdout=subprocess.DEVNULL)
    try:
        path = tmp_path / "hammer.rank0.nccl.ccl"
        deadline = time.monotonic() + 30
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        seen = set()
        for _ in range(2000):
            c = read_counter_file(path).counters
            assert c.error is None, c.error
            ops = [o for o in c.ops if o.op == "AllReduce"]
            if not ops:
                continue
            (o,) = ops
            # per round: one launch, one request, its completion; a torn read would break these
            assert o.wr in (o.cl, o.cl - 1) and o.wc in (o.wr, o.wr - 1) and o.bytes_total == 4096 * o.cl, o
            seen.add(o.cl)
        assert len(seen) > 10
    finally:
        proc.kill()
        proc.wait(timeout=30)
