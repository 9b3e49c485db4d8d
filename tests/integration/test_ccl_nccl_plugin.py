"""The NCCL profiler plugin, driven through its v6, v5 and v4 entry points by C drivers (no NCCL, no GPU here).

``harness.c`` runs a small scripted set of events; ``replay.c`` replays NCCL's real event order (Coll/P2p
stopped before their proxy ops, steps and kernel channels start, several proxy threads, thousands of
events, bogus and stale handles) under AddressSanitizer and valgrind, and the counters it leaves are
checked exactly here through the real reader.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rankscope.ccl_plugin.build import BuildError, build_plugin, find_compiler, source_dir
from rankscope.contract.snapshot import RankCounters
from rankscope.probes.ccl_counters import list_counter_files, read_counter_file
from repo_paths import ROOT

pytestmark = pytest.mark.skipif(find_compiler() is None, reason="no C compiler")

SANITIZE = ("-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-g")
# Small pools so a few thousand events reuse every record many times over (the code path is the same).
SMALL_POOLS = ("-DRS_TASK_POOL=512", "-DRS_CHILD_POOL=1024")
# The plugin as released before parents outlived their children (it freed a Coll at its stop).
OLD_PLUGIN_COMMIT = "cc1e80ed864e8abce86655a68a6911ddc95202e5"
SAN_ENV = {"ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1", "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}


def _compile_driver(out: Path, name: str, flags: tuple[str, ...] = ()) -> Path:
    cc = find_compiler()
    assert cc is not None
    exe = out / name.removesuffix(".c")
    subprocess.run([cc, "-O1", "-std=c11", "-Wall", "-Werror", *flags, "-I", str(source_dir()), "-o", str(exe),
                    str(source_dir() / name), "-ldl", "-lpthread"], check=True)
    return exe


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
    assert exported == {"ncclProfiler_v6", "ncclProfiler_v5", "ncclProfiler_v4"}


@pytest.mark.parametrize("abi", ["6", "5", "4"])
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
        assert [(x.comm_id, x.backend, x.description, x.ranks, x.comm_nranks, x.comm_rank)
                for x in c.communicators] == [
            ("000000000000a1a1", "nccl", "PIPELINE_MODEL_PARALLEL_GROUP", (), 4, 1),
            ("000000000000b2b2", "nccl", "TENSOR_MODEL_PARALLEL_GROUP", (), 2, 0)]
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


# ---- the replay of NCCL's real event order ---------------------------------------------------------


@dataclass(frozen=True)
class Want:
    cl: int
    wr: int
    wc: int
    last_launched_seq: int
    last_completed_seq: int
    bytes_total: int
    open_peers: tuple[int, ...] = ()


def replay_expected(rounds: int, abi: str = "5") -> dict[tuple[str, str], Want]:
    """What replay.c's events must leave (CHANNELS 2, STEPS 6 in replay.c), keyed by (comm_id, op)."""
    a, b = "0123456789abcdef", "fedcba9876543210"
    p2p = math.ceil(rounds / 4)  # one Send and one Recv every 4th round; P2p sequence numbers run per comm
    # v6 only: a copy-engine collective, complete at its own stop (it has no children)
    copy_engine = {(b, "AlltoAll"): Want(1, 0, 0, 1, 1, 128)} if abi == "6" else {}
    return copy_engine | {
        # every round: 2 channels x (send + receive op) x 6 steps; then one AllReduce whose receive hangs
        (a, "AllReduce"): Want(rounds + 1, rounds * 24 + 1, rounds * 24, rounds + 1, rounds, (rounds + 1) * 4096),
        (a, "Send"): Want(p2p, p2p, p2p, 2 * p2p - 1, 2 * p2p - 1, 256 * p2p),
        (a, "Recv"): Want(p2p + 1, p2p + 1, p2p, 2 * p2p + 1, 2 * p2p, 256 * (p2p + 1), (3,)),
        # its only proxy op came from another process (PXN) and was ignored: launched, never completed
        (a, "Broadcast"): Want(1, 0, 0, 1, 0, 8),
        # within a node: two kernel channels per AllGather are its requests
        (b, "AllGather"): Want(rounds, 2 * rounds, 2 * rounds, rounds, rounds, 128 * rounds),
    }


def _replay(lib: Path, exe: Path, tmp: Path, rounds: int, abi: str = "5", wrap: tuple[str, ...] = (),
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    run_env = {**os.environ, **(env or {}), "RANKSCOPE_CCL_DIR": str(tmp), "RANKSCOPE_JOB_ID": "replay",
               "RANK": "1", "WORLD_SIZE": "4", "RANKSCOPE_CCL_KEEP": "1", "RS_HARNESS_ABI": abi}
    return subprocess.run([*wrap, str(exe), str(lib), str(rounds)], env=run_env, capture_output=True, text=True,
                          timeout=120, check=False)


def _check_replay(proc: subprocess.CompletedProcess[str], tmp: Path, rounds: int, abi: str = "5") -> RankCounters:
    assert proc.returncode == 0 and "replayed" in proc.stdout, proc.stderr[-4000:]
    assert "runtime error" not in proc.stderr, proc.stderr[-4000:]  # UBSan reports and goes on otherwise
    (f,) = list_counter_files(tmp)
    c = f.counters
    assert c.error is None and c.stale  # finalized (kept for us to read): a clean exit
    assert [(x.comm_id, x.description, x.ranks, x.comm_nranks, x.comm_rank) for x in c.communicators] == [
        ("0123456789abcdef", "WORLD", (), 4, 1), ("fedcba9876543210", "TENSOR_MODEL_PARALLEL_GROUP", (), 2, 0)]
    got = {(o.comm_id, o.op): Want(o.cl, o.wr, o.wc, o.last_launched_seq, o.last_completed_seq, o.bytes_total,
                                   o.open_peers) for o in c.ops}
    assert got == replay_expected(rounds, abi)
    ops = {(o.comm_id, o.op): o for o in c.ops}
    ar = ops[("0123456789abcdef", "AllReduce")]
    assert len(ar.recent_throughput) == 5 and all(t > 0 for t in ar.recent_throughput)
    assert ar.last_duration_s is not None and ar.last_duration_s > 0
    # a kernel channel's throughput is its share of the bytes over its GPU time: 128 / 2 bytes in 4 us
    assert ops[("fedcba9876543210", "AllGather")].recent_throughput == pytest.approx((16e6,) * 5)
    # TD on the device: its kernel channels' GPU start to their KernelChStop (4 us), not the host's time
    assert ops[("fedcba9876543210", "AllGather")].last_duration_s == pytest.approx(4e-6)
    return c


@pytest.fixture(scope="module")
def plain_replay(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _compile_driver(tmp_path_factory.mktemp("replay"), "replay.c", ("-g",))


@pytest.fixture(scope="module")
def sanitized(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("asan")
    lib = build_plugin(out, extra_flags=(*SANITIZE, *SMALL_POOLS))
    return lib, _compile_driver(out, "replay.c", SANITIZE)


@pytest.mark.parametrize("abi", ["6", "5", "4"])
def test_replay_of_nccl_event_order_under_asan_counts_exactly(
        sanitized: tuple[Path, Path], tmp_path: Path, abi: str) -> None:
    """Parents stopped before their children start; 4 proxy threads; every record reused many times."""
    lib, exe = sanitized
    _check_replay(_replay(lib, exe, tmp_path, 3000, abi, env=SAN_ENV), tmp_path, 3000, abi)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**63 - 1))
def test_any_calls_with_any_handles_never_fault(sanitized: tuple[Path, Path], seed: int) -> None:
    """NCCL's calls are outside input: random tasks, children under live, stale, foreign or garbage parents,
    states and stops on any handle, repeated finalize and init; ASan/UBSan watch, the file stays sane."""
    lib, exe = sanitized
    with tempfile.TemporaryDirectory() as d:
        out = Path(d)
        env = {**os.environ, **SAN_ENV, "RANKSCOPE_CCL_DIR": d, "RANKSCOPE_JOB_ID": "fuzz", "RANK": "1",
               "RANKSCOPE_CCL_KEEP": "1"}
        proc = subprocess.run([str(exe), str(lib), "fuzz", str(seed), "20000"], env=env, capture_output=True,
                              text=True, timeout=120, check=False)
        assert proc.returncode == 0 and "fuzzed" in proc.stdout, proc.stderr[-4000:]
        assert "runtime error" not in proc.stderr, proc.stderr[-4000:]
        for f in list_counter_files(out):
            c = f.counters
            assert c.error is None, c.error
            assert all(x.comm_nranks in (2, 4) and x.comm_rank in (0, 1) for x in c.communicators)
            for o in c.ops:  # a completion is only ever counted for a request counted before it
                assert o.wc <= o.wr and len(o.open_peers) <= 8 and len(o.recent_throughput) <= 5, o


def test_replay_with_the_shipped_pool_sizes_counts_exactly(
        built: tuple[Path, Path], plain_replay: Path, tmp_path: Path) -> None:
    """5000 rounds start more tasks than the task pool holds, so stale handles are real ones."""
    lib, _ = built
    _check_replay(_replay(lib, plain_replay, tmp_path, 5000), tmp_path, 5000)


def test_replay_under_thread_sanitizer_has_no_data_race(tmp_path: Path) -> None:
    """The user thread and the proxy threads write the same slots and records: every access is ordered."""
    tsan = ("-fsanitize=thread", "-g", "-Wno-tsan")  # TSan cannot model the seqlock's fences; CASes order it
    lib = build_plugin(tmp_path, extra_flags=(*tsan, *SMALL_POOLS))
    exe = _compile_driver(tmp_path, "replay.c", tsan)
    out = tmp_path / "counters"
    out.mkdir()
    proc = _replay(lib, exe, out, 2000, env={"TSAN_OPTIONS": "halt_on_error=1"})
    assert "ThreadSanitizer" not in proc.stderr, proc.stderr[-4000:]
    _check_replay(proc, out, 2000)


def test_a_full_pool_drops_events_with_a_warning_in_nccls_log(sanitized: tuple[Path, Path], tmp_path: Path) -> None:
    """More events in flight than records: dropped (never a fault), and NCCL_DEBUG=WARN says so with the fix."""
    lib = build_plugin(tmp_path, extra_flags=(*SANITIZE, "-DRS_TASK_POOL=4", "-DRS_CHILD_POOL=4"))
    _, exe = sanitized
    out = tmp_path / "counters"
    out.mkdir()
    proc = _replay(lib, exe, out, 200, env=SAN_ENV)
    assert "AddressSanitizer" not in proc.stderr and "runtime error" not in proc.stderr, proc.stderr[-4000:]
    assert proc.returncode in (0, 3), proc.stderr[-4000:]  # 3: the stuck receive's records were dropped too
    assert "INFO rankscope profiler: communicator 0123456789abcdef (4 ranks, rank 1) counted into" in proc.stderr
    assert proc.stderr.count("WARN rankscope profiler: no free") == 1  # once, not per event
    assert "--no-nccl-plugin" in proc.stderr


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed (apt-get install valgrind)")
def test_replay_under_valgrind_is_clean(plain_replay: Path, tmp_path: Path) -> None:
    lib = build_plugin(tmp_path / "lib", extra_flags=("-g", *SMALL_POOLS))  # small: records reused, handles stale
    proc = _replay(lib, plain_replay, tmp_path, 400, wrap=("valgrind", "-q", "--error-exitcode=9"))
    _check_replay(proc, tmp_path, 400)


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="needs git and this repository's history (the released plugin is read from it)")
def test_replay_catches_the_released_plugin_freeing_parents_early(
        sanitized: tuple[Path, Path], tmp_path: Path) -> None:
    """The replay is the test that would have caught the SIGSEGV on real NCCL: the old plugin fails it."""
    for name in ("profiler.c", "nccl_profiler_abi.h", "rankscope_layout.h"):
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{OLD_PLUGIN_COMMIT}:ccl_plugin/nccl/{name}"],
                              capture_output=True, text=True, check=False)
        if text.returncode != 0:
            pytest.skip(f"the released plugin ({OLD_PLUGIN_COMMIT[:8]}) is not in this clone's history")
        (tmp_path / name).write_text(text.stdout)
    cc = find_compiler()
    assert cc is not None
    lib = tmp_path / "old.so"
    subprocess.run([cc, "-std=c11", "-fPIC", "-shared", "-O1", *SANITIZE, "-o", str(lib),
                    str(tmp_path / "profiler.c"), "-lpthread"], check=True)
    _, exe = sanitized
    out = tmp_path / "counters"
    out.mkdir()
    proc = _replay(lib, exe, out, 200, env=SAN_ENV)
    assert proc.returncode != 0
    assert "heap-use-after-free" in proc.stderr


def test_the_plugin_never_writes_through_a_planted_link_and_tightens_its_own_directory(
        plain_replay: Path, tmp_path: Path) -> None:
    """Another user who got into the counter directory first plants a link at the plugin's temporary name: the
    plugin removes the name and makes its own file (O_EXCL|O_NOFOLLOW), and the victim keeps its bytes."""
    lib = build_plugin(tmp_path / "lib", extra_flags=("-g", *SMALL_POOLS))
    out = tmp_path / "counters"
    out.mkdir()
    out.chmod(0o777)  # ours, but loose: tightened before use
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    env = {**os.environ, "RANKSCOPE_CCL_DIR": str(out), "RANKSCOPE_JOB_ID": "replay", "RANK": "1", "WORLD_SIZE": "4",
           "RANKSCOPE_CCL_KEEP": "1", "RS_HARNESS_ABI": "5"}
    # the shell's pid is the replay's (exec), so the link sits at exactly the name the plugin will use
    script = f'ln -s {victim} {out}/.replay.rank1.nccl.ccl.$$.tmp && exec {plain_replay} {lib} 400'
    proc = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert victim.read_text() == "precious\n"
    _check_replay(proc, out, 400)
    assert oct(out.stat().st_mode & 0o777) == oct(0o700)
    assert not any(p.is_symlink() for p in out.iterdir())


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the directory to another user")
def test_the_plugin_refuses_a_directory_of_another_user_with_the_fix_in_nccls_log(
        plain_replay: Path, tmp_path: Path) -> None:
    lib = build_plugin(tmp_path / "lib", extra_flags=("-g", *SMALL_POOLS))
    out = tmp_path / "counters"
    out.mkdir(mode=0o755)
    os.chown(out, 65534, 65534)
    proc = _replay(lib, plain_replay, out, 400)
    assert "AddressSanitizer" not in proc.stderr and "Segmentation" not in proc.stderr
    assert "counter directory" in proc.stderr and "belongs to another user" in proc.stderr
    assert "RANKSCOPE_CCL_DIR" in proc.stderr  # the fix
    assert list(out.iterdir()) == []
