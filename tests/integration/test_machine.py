"""capture_machine over a real process tree shaped like torchrun's (torch-free, cheap)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from jobs.launch import Tree, process_tree_cmd, start, stop, wait_ready
from rankscope.contract.snapshot import CaptureErrorKind, ProcessRole, RankCounters, RankInfo
from rankscope.probes import machine as machine_module
from rankscope.probes.machine import CaptureOptions, Scope, capture_machine


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tree]:
    directory = tmp_path_factory.mktemp("machine") / "job"
    proc = start(process_tree_cmd(directory, 2, "machineRun"), directory)
    try:
        yield wait_ready(proc, directory, 2, 60)
    finally:
        stop(proc, directory)


def _frame_names(stack: object) -> list[str]:
    threads = getattr(stack, "threads", None) or ()
    return [f.name for t in threads for f in t.frames]


async def test_capture_machine_gathers_ranks_stacks_and_metrics(tree: Tree, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[tuple[int, ...], Path | None]] = []

    def record(ranks: Sequence[RankInfo], directory: Path | None = None) -> tuple[RankCounters, ...]:
        seen.append((tuple(r.rank for r in ranks), directory))
        return ()

    monkeypatch.setattr(machine_module, "read_counters", record)
    before = time.time()
    snap = await capture_machine("m0", "127.0.0.1:50051", Scope(launcher_pid=tree.launcher_pid,
                                                                 counter_dir=tree.directory),
                                 CaptureOptions(timeout_s=20, concurrency=2))
    assert (snap.machine, snap.address, snap.reachable, snap.error) == ("m0", "127.0.0.1:50051", True, None)
    assert snap.captured is not None and before <= snap.captured.wall <= time.time()
    assert snap.hostname
    assert {r.rank: r.pid for r in snap.ranks} == {r: info["pid"] for r, info in tree.ready.items()}
    assert seen == [((0, 1), tree.directory)]
    for r in snap.ranks:
        assert r.process is not None and r.process.cpu_percent is not None  # measured over the capture
        assert all(s.cpu_percent is not None for s in r.subprocesses)
    assert [s.rank for s in snap.stacks] == [0, 1]
    for s in snap.stacks:
        assert _frame_names(s.main)[:1] == ["park_fake_rank"]
        by_role = {p.role: p for p in s.subprocesses}
        assert set(by_role) == {ProcessRole.CHECKPOINT, ProcessRole.DATALOADER}
        assert _frame_names(by_role[ProcessRole.CHECKPOINT])[:1] == ["park_fake_rank"]  # the forked writer
        assert _frame_names(by_role[ProcessRole.DATALOADER])[:1] == ["load_fake_batches"]
    assert snap.host is not None and snap.host.cpu_percent is not None and snap.host.error is None
    assert snap.gpus is not None
    if not snap.gpus.available:
        assert snap.gpus.reason is not None and snap.gpus.reason.startswith("no GPU data: ")


async def test_capture_without_stacks_still_finds_ranks(tree: Tree) -> None:
    snap = await capture_machine("m0", "a", Scope(run_id="machineRun"), CaptureOptions(stacks=False))
    assert {r.rank for r in snap.ranks} == {0, 1}
    assert snap.stacks == ()


async def test_capture_of_another_scope_is_empty_not_an_error(tree: Tree) -> None:
    snap = await capture_machine("m0", "a", Scope(run_id="someone-elses-run"), CaptureOptions(timeout_s=20))
    assert (snap.ranks, snap.stacks, snap.error, snap.reachable) == ((), (), None, True)
    assert snap.host is not None


async def test_a_failing_counter_reader_does_not_lose_the_snapshot(tree: Tree, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(ranks: Sequence[RankInfo], directory: Path | None = None) -> tuple[RankCounters, ...]:
        raise OSError("counter directory vanished")

    monkeypatch.setattr(machine_module, "read_counters", broken)
    snap = await capture_machine("m0", "a", Scope(launcher_pid=tree.launcher_pid), CaptureOptions(stacks=False))
    assert {r.rank for r in snap.ranks} == {0, 1}
    assert snap.counters == ()
    assert snap.error is not None and snap.error.kind is CaptureErrorKind.FAILED
    assert "counter directory vanished" in snap.error.message and snap.error.fix
