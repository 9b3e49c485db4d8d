"""Rank discovery against real process trees: a torch-free tree shaped like
torchrun's (cheap) and two real torchrun jobs on gloo (marked drill).

Nothing tells discovery the PIDs; the tests compare what it found with the
PIDs each rank wrote into its ready file.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from jobs.launch import Tree, process_tree_cmd, start, stop, torchrun_cmd, wait_ready
from rankscope.contract.snapshot import ProcessRole, RankInfo
from rankscope.probes.discovery import discover, discover_ranks, role_of
from rankscope.probes.pyspy import capture_stacks


def _pids(ranks: tuple[RankInfo, ...]) -> dict[int, int]:
    return {r.rank: r.pid for r in ranks}


def _expected(tree: Tree) -> dict[int, int]:
    return {r: int(info["pid"]) for r, info in tree.ready.items()}


@pytest.fixture(scope="module")
def two_trees(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Tree, Tree]]:
    """Two torch-free launchers (run ids fakeA and fakeB) with two ranks each."""
    base = tmp_path_factory.mktemp("trees")
    a_dir, b_dir = base / "a", base / "b"
    # B's launcher is started from a shell that already exported RANK=0 (as SLURM scripts do):
    # it must not be taken for a rank, and its own rank 0 must still be found.
    leaked = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "16"}
    procs = [start(process_tree_cmd(a_dir, 2, "fakeA"), a_dir),
             start(process_tree_cmd(b_dir, 2, "fakeB"), b_dir, env=leaked)]
    try:
        yield wait_ready(procs[0], a_dir, 2, 60), wait_ready(procs[1], b_dir, 2, 60)
    finally:
        for proc, d in zip(procs, (a_dir, b_dir), strict=True):
            stop(proc, d)


# --------------------------------------------------------------------------
# torch-free process trees
# --------------------------------------------------------------------------


def test_finds_a_launchers_ranks_and_labels_their_children(two_trees: tuple[Tree, Tree]) -> None:
    a, _ = two_trees
    ranks = discover_ranks(launcher_pid=a.launcher_pid)
    assert _pids(ranks) == _expected(a)
    for r in ranks:
        ready = a.ready[r.rank]
        assert (r.local_rank, r.world_size, r.group_rank, r.local_world_size) == (r.rank, 2, 0, 2)
        assert r.run_id == "fakeA"
        assert r.launcher_pid == a.launcher_pid
        assert (r.master_addr, r.master_port) == ("127.0.0.1", 29999)
        assert r.process is not None and r.process.pid == r.pid and r.process.role is ProcessRole.MAIN
        assert r.process.rss_bytes is not None and r.process.rss_bytes > 0
        # The forked writer inherits RANK but is the rank's child, not a rank of its own.
        roles = {s.pid: s.role for s in r.subprocesses}
        assert roles == {ready["checkpoint"]: ProcessRole.CHECKPOINT, ready["dataloader"]: ProcessRole.DATALOADER}


def test_steps_through_a_wrapper_shell_to_the_python_rank(two_trees: tuple[Tree, Tree]) -> None:
    a, _ = two_trees
    rank1 = next(r for r in discover_ranks(launcher_pid=a.launcher_pid) if r.rank == 1)
    # process_tree.py starts rank 1 as `bash -c "python ...; exit $?"`.
    assert rank1.pid == a.ready[1]["pid"]
    assert rank1.process is not None and "python" in rank1.process.name
    parent_name = Path(f"/proc/{rank1.process.ppid}/comm").read_text().strip()
    assert parent_name == "bash"
    assert rank1.launcher_pid == a.launcher_pid  # bash's parent, not bash


def test_scoping_by_launcher_and_by_run_id(two_trees: tuple[Tree, Tree]) -> None:
    a, b = two_trees
    assert _pids(discover_ranks(launcher_pid=b.launcher_pid)) == _expected(b)
    assert _pids(discover_ranks(run_id="fakeB")) == _expected(b)
    assert _pids(discover_ranks(run_id="fakeA")) == _expected(a)
    assert discover_ranks(launcher_pid=a.launcher_pid, run_id="fakeB") == ()
    assert discover_ranks(run_id="no-such-run") == ()
    unscoped = discover_ranks()
    assert b.launcher_pid not in {r.pid for r in unscoped}
    everything = {(r.run_id, r.rank): r.pid for r in unscoped}
    for run_id, tree in (("fakeA", a), ("fakeB", b)):
        for rank, pid in _expected(tree).items():
            assert everything[(run_id, rank)] == pid


def test_unprivileged_discovery_skips_unreadable_processes_with_a_reason(two_trees: tuple[Tree, Tree]) -> None:
    """As `nobody`, root's ranks cannot be read: they are listed as skipped, nothing raises."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv is needed to drop privileges")
    a, _ = two_trees
    code = (
        "import json; from rankscope.probes.discovery import discover\n"
        f"r = discover(launcher_pid={a.launcher_pid})\n"
        "print(json.dumps({'ranks': len(r.ranks), 'skipped': {s.pid: s.reason for s in r.skipped}}))\n"
    )
    out = subprocess.run(
        [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", code],
        capture_output=True, text=True, timeout=60, check=True, cwd="/",
    )
    result = json.loads(out.stdout)
    assert result["ranks"] == 0
    for info in a.ready.values():
        assert "permission denied" in result["skipped"][str(info["pid"])]


def test_role_rules() -> None:
    assert role_of("python", ("python", "x.py"), {"RANKSCOPE_ROLE": "checkpoint"}) is ProcessRole.CHECKPOINT
    assert role_of("pt_data_worker", ("python", "train.py"), {}) is ProcessRole.DATALOADER
    assert role_of("python", ("python", "-m", "my.ckpt_uploader"), {}) is ProcessRole.CHECKPOINT
    assert role_of("python", ("python", "-m", "torch._inductor.compile_worker"), {}) is ProcessRole.COMPILE
    assert role_of("python", ("python", "train.py"), {}) is ProcessRole.OTHER
    # An unknown declared role falls back to the heuristics.
    assert role_of("pt_data_worker", (), {"RANKSCOPE_ROLE": "bogus"}) is ProcessRole.DATALOADER


def test_no_ranks_is_an_empty_answer_not_an_error() -> None:
    result = discover(launcher_pid=1 << 30)
    assert result.ranks == ()


# --------------------------------------------------------------------------
# Real torchrun jobs (gloo on CPU), apart from the drill's code
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def torchrun_jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Tree, Tree]]:
    """Two concurrent `python -m torch.distributed.run` launchers (jobA, jobB), two ranks each."""
    base = tmp_path_factory.mktemp("torchrun")
    a_dir, b_dir = base / "a", base / "b"
    procs = [start(torchrun_cmd(a_dir, "jobA"), a_dir), start(torchrun_cmd(b_dir, "jobB"), b_dir)]
    try:
        yield wait_ready(procs[0], a_dir, 2, 180), wait_ready(procs[1], b_dir, 2, 180)
    finally:
        for proc, d in zip(procs, (a_dir, b_dir), strict=True):
            stop(proc, d)


@pytest.mark.drill
def test_torchrun_ranks_and_children_found_without_pids(torchrun_jobs: tuple[Tree, Tree]) -> None:
    a, _ = torchrun_jobs
    ranks = discover_ranks(launcher_pid=a.launcher_pid)
    assert _pids(ranks) == _expected(a)
    for r in ranks:
        ready = a.ready[r.rank]
        assert (r.world_size, r.local_rank, r.group_rank, r.run_id) == (2, r.rank, 0, "jobA")
        assert r.launcher_pid == a.launcher_pid  # torchrun's elastic agent
        roles = {s.pid: s.role for s in r.subprocesses}
        for worker in ready["dataloader"]:
            assert roles[worker] is ProcessRole.DATALOADER  # torch names its workers pt_data_worker
        assert roles[ready["checkpoint"]] is ProcessRole.CHECKPOINT  # RANKSCOPE_ROLE in its environment
        assert not set(roles) & {x.pid for x in ranks}


@pytest.mark.drill
def test_torchrun_scoping_keeps_one_job(torchrun_jobs: tuple[Tree, Tree]) -> None:
    a, b = torchrun_jobs
    assert _pids(discover_ranks(launcher_pid=b.launcher_pid)) == _expected(b)
    assert _pids(discover_ranks(run_id="jobA")) == _expected(a)
    assert _pids(discover_ranks(run_id="jobB")) == _expected(b)
    assert len([r for r in discover_ranks() if r.run_id in {"jobA", "jobB"}]) == 4


@pytest.mark.drill
async def test_torchrun_stacks_show_where_each_process_waits(torchrun_jobs: tuple[Tree, Tree]) -> None:
    a, _ = torchrun_jobs
    ranks = discover_ranks(launcher_pid=a.launcher_pid)
    stacks = await capture_stacks(ranks, timeout_s=20)
    assert [s.rank for s in stacks] == [0, 1]
    for s in stacks:
        assert s.main.error is None and s.main.threads is not None
        main_thread = next(t for t in s.main.threads if t.thread_name == "MainThread")
        names = [f.name for f in main_thread.frames]
        assert names[:2] == ["park_until_released", "main"]  # innermost first
        by_role = {p.role: p for p in s.subprocesses}
        ckpt = by_role[ProcessRole.CHECKPOINT]
        assert ckpt.error is None and ckpt.threads is not None
        assert "write_checkpoint_shard" in [f.name for t in ckpt.threads for f in t.frames]
        loader = by_role[ProcessRole.DATALOADER]
        assert loader.error is None and loader.threads is not None
        assert "_worker_loop" in [f.name for t in loader.threads for f in t.frames]
