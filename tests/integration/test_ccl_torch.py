"""The Python writer on real torch: autoload by .pth, exact counts on a gloo job, hangs read live."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from agent_helpers import wait_for
from rankscope.analyzers.ccl import analyze_counters, comm_rows
from rankscope.ccl_plugin import autoload
from rankscope.contract.snapshot import Instant, JobSnapshot, MachineSnapshot, RankCounters, RankInfo
from rankscope.probes.ccl_counters import list_counter_files, read_counters
from repo_paths import JOBS, ROOT
from shim_paths import PATHS, fast

# the environment that picks each path in a job's processes
PATH_ENV = {"native": {"RANKSCOPE_CCL_NATIVE": "1"}, "python": {"RANKSCOPE_CCL_NATIVE": "0"}}

JOB = JOBS / "ccl_job.py"
RANKSCOPE = Path(sys.executable).parent / "rankscope"


class Job:
    def __init__(self, tmp: Path, env: dict[str, str]) -> None:
        self.dir = tmp
        self.counters = tmp / "counters"
        self.log = (tmp / "job.log").open("w")
        cmd = [str(RANKSCOPE), "run", "--counter-dir", str(self.counters), "--job-id", "cj", "--no-nccl-plugin", "--",
               sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(JOB)]
        self.proc = subprocess.Popen(cmd, cwd=tmp, env={**os.environ, "CCL_JOB_DIR": str(tmp), **env},
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def pid_of(self, marker: str) -> int:
        return int((self.dir / marker).read_text())

    def counters_of(self, pids: dict[int, int]) -> dict[int, RankCounters]:
        infos = [RankInfo(rank=r, local_rank=r, world_size=2, pid=p) for r, p in pids.items()]
        return {c.rank: c for c in read_counters(infos, self.counters)}

    def kill(self) -> None:
        """The whole tree: torchrun starts its workers in sessions of their own."""
        import psutil
        try:
            tree = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        for p in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        psutil.wait_procs(tree, timeout=30)
        self.log.close()

    def output(self) -> str:
        return (self.dir / "job.log").read_text()


@pytest.fixture
def start_job(tmp_path: Path) -> Iterator[Callable[[dict[str, str]], Job]]:
    jobs: list[Job] = []

    def start(env: dict[str, str]) -> Job:
        job = Job(tmp_path, env)
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        job.kill()


def _ops(c: RankCounters) -> dict[tuple[str, str], tuple[int, int, int]]:
    return {(o.comm_id, o.op): (o.cl, o.wr, o.wc) for o in c.ops}


@pytest.mark.drill
@pytest.mark.parametrize("path", PATHS)
def test_rankscope_run_counts_every_call_exactly(start_job: Callable[[dict[str, str]], Job], path: str) -> None:
    fast(path)
    steps = 3
    job = start_job({"CCL_JOB_STEPS": str(steps), **PATH_ENV[path]})
    wait_for(lambda: all((job.dir / f"ready.rank{r}").exists() for r in (0, 1)) or job.proc.poll() is not None,
             90, "both ranks to finish their steps", interval_s=0.1)
    assert job.proc.poll() is None, job.output()
    pids = {r: job.pid_of(f"ready.rank{r}") for r in (0, 1)}
    got = job.counters_of(pids)
    assert set(got) == {0, 1}
    s = steps
    for r in (0, 1):
        c = got[r]
        assert (c.pid, c.world_size, c.job_id, c.steps, c.stale, c.error) == (pids[r], 2, "cj", s, False, None)
        assert [(x.comm_id, x.description, x.ranks, x.comm_nranks, x.comm_rank) for x in c.communicators] == [
            ("0", "default_pg", (0, 1), 2, r), ("1", "PIPELINE_MODEL_PARALLEL_GROUP", (0, 1), 2, r)]
        # per step: 2 grad all_reduces + 1 async, then one of each; the isend 0->1 and a batch exchange
        sends, recvs = (2 * s, s) if r == 0 else (s, 2 * s)
        assert _ops(c) == {
            ("0", "all_reduce"): (3 * s, 3 * s, 3 * s),
            ("0", "all_gather_into_tensor"): (s, s, s),
            ("0", "reduce_scatter_tensor"): (s, s, s),
            ("0", "barrier"): (s, s, s),
            ("1", "broadcast"): (s, s, s),
            ("1", "send"): (sends, sends, sends),
            ("1", "recv"): (recvs, recvs, recvs),
        }
        ar = next(o for o in c.ops if o.op == "all_reduce")
        assert ar.bytes_total == s * (8 * 8 * 4 + 8 * 4 + 16 * 4) and len(ar.recent_throughput) == 5
        assert c.last_step_duration_s is not None and c.last_step_duration_s > 0
    assert not any(r.lags or r.open_requests for rows in comm_rows(got.values()).values() for r in rows)
    (job.dir / "release").touch()
    assert job.proc.wait(timeout=60) == 0, job.output()
    assert list_counter_files(job.counters) == ()  # removed on clean exit


def _snapshot(counters: dict[int, RankCounters], pids: dict[int, int]) -> JobSnapshot:
    m = MachineSnapshot("m0", "127.0.0.1:0", True, Instant(time.time(), time.monotonic()),
                        ranks=tuple(RankInfo(rank=r, local_rank=r, world_size=2, pid=p) for r, p in pids.items()),
                        counters=tuple(counters.values()))
    return JobSnapshot(Instant(time.time(), time.monotonic()), (m,))


def _open(c: RankCounters, op: str) -> bool:
    return any(o.op == op and o.wc < o.wr for o in c.ops)


@pytest.mark.drill
def test_hang_in_compute_with_the_gil_held_shows_as_a_cl_lag(start_job: Callable[[dict[str, str]], Job]) -> None:
    job = start_job({"CCL_JOB_HANG": "compute", "CCL_JOB_HANG_RANK": "1", "CCL_JOB_HANG_STEP": "1"})
    wait_for(lambda: (job.dir / "hung.rank1").exists() or job.proc.poll() is not None, 90, "rank 1 to hang",
             interval_s=0.1)
    assert job.proc.poll() is None, job.output()
    files = {f.counters.rank: f.counters.pid for f in list_counter_files(job.counters)}
    pids = {0: files[0] or 0, 1: job.pid_of("hung.rank1")}
    # rank 0 goes on into the step's first all_reduce and waits there for rank 1
    wait_for(lambda: _open(job.counters_of(pids)[0], "all_reduce"), 90, "rank 0 to wait in all_reduce",
             interval_s=0.1)
    got = job.counters_of(pids)  # read while rank 1 sleeps in C holding its GIL
    ar = {r: next(o for o in c.ops if o.op == "all_reduce") for r, c in got.items()}
    assert (ar[0].cl, ar[0].wc, ar[1].cl, ar[1].wc) == (4, 3, 3, 3)
    verdict = analyze_counters(_snapshot(got, pids))
    assert verdict.top is not None and verdict.top.ranks == (1,), verdict
    assert "all_reduce CL 3 < 4" in verdict.top.evidence[0]


@pytest.mark.drill
def test_hang_in_p2p_shows_the_open_request_on_the_right_pair(start_job: Callable[[dict[str, str]], Job]) -> None:
    job = start_job({"CCL_JOB_HANG": "p2p", "CCL_JOB_HANG_RANK": "0", "CCL_JOB_HANG_STEP": "1"})
    wait_for(lambda: ((job.dir / "hung.rank0").exists() and (job.dir / "waiting.rank1").exists())
             or job.proc.poll() is not None, 90, "rank 1 to wait on rank 0", interval_s=0.1)
    assert job.proc.poll() is None, job.output()
    pids = {0: job.pid_of("hung.rank0"), 1: job.pid_of("waiting.rank1")}
    got = job.counters_of(pids)
    recv = next(o for o in got[1].ops if o.op == "recv")
    # step 0: one irecv + one batch recv completed; step 1: the irecv from rank 0 is open
    assert (recv.cl, recv.wr, recv.wc, recv.open_peers) == (3, 3, 2, (0,))
    assert not any(o.wc < o.wr for o in got[0].ops)
    verdict = analyze_counters(_snapshot(got, pids))
    assert verdict.top is not None and verdict.top.ranks == (0, 1), verdict
    assert "rank 0 has no open send to rank 1" in verdict.top.evidence[0]


@pytest.mark.drill
def test_async_all_reduce_whose_peer_never_joins_stays_open(start_job: Callable[[dict[str, str]], Job]) -> None:
    """WC when the work completes, not when the call returns: the async op of step 1 stays open on rank 0."""
    job = start_job({"CCL_JOB_HANG": "async", "CCL_JOB_HANG_RANK": "1", "CCL_JOB_HANG_STEP": "1"})
    wait_for(lambda: ((job.dir / "hung.rank1").exists() and (job.dir / "waiting.rank0").exists())
             or job.proc.poll() is not None, 90, "rank 0 to issue the async all_reduce", interval_s=0.1)
    assert job.proc.poll() is None, job.output()
    pids = {0: job.pid_of("waiting.rank0"), 1: job.pid_of("hung.rank1")}
    got = job.counters_of(pids)
    ar = {r: next(o for o in c.ops if o.op == "all_reduce") for r, c in got.items()}
    # step 0: 3 all_reduces; step 1: 2 gradient all_reduces on both, then rank 0's async one
    assert (ar[0].cl, ar[0].wr, ar[0].wc) == (6, 6, 5)
    assert (ar[1].cl, ar[1].wr, ar[1].wc) == (5, 5, 5)
    verdict = analyze_counters(_snapshot(got, pids))
    assert verdict.top is not None and verdict.top.ranks == (1,), verdict


CHILD = textwrap.dedent("""
    import sys, tempfile, os
    import torch
    from torch.distributed import all_reduce, all_gather_into_tensor  # bound before any init
    import torch.distributed as dist
    print("patched", hasattr(all_gather_into_tensor, "__rankscope_original__"), flush=True)
    if not hasattr(all_reduce, "__rankscope_original__"):
        sys.exit(0)
    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    t = torch.ones(4)
    all_reduce(t)
    all_gather_into_tensor(torch.empty(4), t)
    dist.all_gather([torch.empty(4)], t)
    dist.broadcast(t, 0)
    dist.reduce(t, 0)
    dist.gather(t, [torch.empty(4)], 0)
    dist.scatter(t, [torch.ones(4)], 0)
    dist.all_to_all_single(torch.empty(4), t)
    dist.barrier()
    try:
        dist.reduce_scatter(torch.empty(4), [torch.ones(4)])  # gloo has none: raises, nothing stays open
    except Exception:
        pass
    from rankscope.ccl_plugin import group_slots, hook_state
    from rankscope.probes.ccl_counters import read_counter_file
    c = read_counter_file(hook_state.STATE.writer.path).counters
    print("ops", sorted((o.op, o.cl, o.wc) for o in c.ops), flush=True)
    print("path", type(all_reduce).__name__, flush=True)
    def boom(*a, **k):
        raise RuntimeError("injected")
    hook_state.STATE.writer.launch = boom
    group_slots.forget_groups()  # the next call is a first one: both paths reach the broken launch
    all_reduce(t); all_reduce(t)  # the user's calls still work after the hook breaks
    print("after", float(t[0]), flush=True)
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("path", PATHS)
def test_pth_line_patches_torch_before_user_imports_and_never_raises(tmp_path: Path, path: str) -> None:
    fast(path)  # skips the native case where nothing builds it
    site = tmp_path / "site"
    site.mkdir()
    (site / autoload.PTH_NAME).write_text(autoload.PTH_LINE)
    boot = f"import site; site.addsitedir({str(site)!r}); exec(open({str(tmp_path / 'child.py')!r}).read())"
    (tmp_path / "child.py").write_text(CHILD)
    env = {**os.environ, **autoload.ccl_env(tmp_path / "c", "unit"), **PATH_ENV[path]}
    on = subprocess.run([sys.executable, "-c", boot], env=env, capture_output=True, text=True, timeout=120)
    assert on.returncode == 0, on.stderr
    assert "patched True" in on.stdout
    # the collective wrapper is the C one unless the fast path is turned off, which says so once
    assert f"path {'Wrapper' if path == 'native' else 'function'}\n" in on.stdout
    assert on.stderr.count("CCL counters count in Python (RANKSCOPE_CCL_NATIVE=0)") == (path == "python")
    assert ("ops [('all_gather', 1, 1), ('all_gather_into_tensor', 1, 1), ('all_reduce', 1, 1), "
            "('all_to_all_single', 1, 1), ('barrier', 1, 1), ('broadcast', 1, 1), ('gather', 1, 1), "
            "('reduce', 1, 1), ('reduce_scatter', 1, 1), ('scatter', 1, 1)]") in on.stdout
    assert "after 1.0" in on.stdout
    assert on.stderr.count("CCL counters disabled after an internal error") == 1
    off = subprocess.run([sys.executable, "-c", boot], env={k: v for k, v in env.items() if k != "RANKSCOPE_CCL"},
                         capture_output=True, text=True, timeout=120)
    assert off.returncode == 0 and "patched False" in off.stdout, off.stderr


def test_ccl_env_names_the_directory_job_and_plugin(tmp_path: Path) -> None:
    env = autoload.ccl_env(tmp_path, "j7", tmp_path / "lib.so")
    assert env == {"RANKSCOPE_CCL": "1", "RANKSCOPE_CCL_DIR": str(tmp_path), "RANKSCOPE_JOB_ID": "j7",
                   "NCCL_PROFILER_PLUGIN": str(tmp_path / "lib.so")}
    assert (ROOT / "ccl_plugin" / autoload.PTH_NAME).read_text() == autoload.PTH_LINE


def test_process_group_hooks_count_only_calls_the_wrappers_did_not_see(tmp_path: Path) -> None:
    """The torch >= 2.14 path, driven by a group object offering the two hook registrations."""
    from types import SimpleNamespace

    from rankscope.ccl_plugin import group_hooks, hook_state
    from rankscope.ccl_plugin.writer import CounterWriter
    from rankscope.probes.ccl_counters import read_counter_file

    class Group:
        def __init__(self) -> None:
            self.pre: list[Callable[[object], None]] = []
            self.post: list[Callable[[object], None]] = []

        def register_pre_hook(self, fn: Callable[[object], None]) -> None:
            self.pre.append(fn)

        def register_post_hook(self, fn: Callable[[object], None]) -> None:
            self.post.append(fn)

    w = CounterWriter(tmp_path, rank=0, world_size=1, job_id="hooks")
    old = hook_state.STATE.writer
    hook_state.STATE.writer = w
    try:
        g = Group()
        idx = w.comm("0", "nccl", "default_pg", (0,))
        group_hooks.hook_group(g, idx)
        (pre,), (post,) = g.pre, g.post
        pre(SimpleNamespace(name="ALLREDUCE", op_id=1))  # from C++ (DDP's reducer): counted
        post(SimpleNamespace(name="ALLREDUCE", op_id=1, work=None))
        hook_state.STATE.tls.depth = True  # inside a wrapped Python call: the wrapper counts it
        pre(SimpleNamespace(name="ALLREDUCE", op_id=2))
        hook_state.STATE.tls.depth = False
        (op,) = read_counter_file(w.path).counters.ops
        assert (op.op, op.cl, op.wr, op.wc) == ("allreduce", 1, 1, 1)
    finally:
        hook_state.STATE.writer = old
        w.close()
