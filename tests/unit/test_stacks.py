"""Signatures, grouping and the prefix tree (rankscope.analyzers.stacks)."""

from __future__ import annotations

from rankscope.analyzers.stacks import (
    Lane,
    PrefixNode,
    SignatureOptions,
    diverging_frame,
    frame_text,
    group_stacks,
    tree_from_grouping,
)
from rankscope.contract.snapshot import CaptureErrorKind, Frame, ProcessRole, ProcessStack, RankStacks, ThreadStack
from stack_fixtures import (
    COMPUTE,
    OPTIMIZER,
    RECV,
    SEND,
    TRAIN,
    WORKER_IDLE,
    WORKER_STUCK,
    frames,
    process,
    rank_stacks,
    unreadable,
)


def _find(node: PrefixNode, frame: str) -> PrefixNode | None:
    if node.frame == frame:
        return node
    for child in node.children:
        got = _find(child, frame)
        if got is not None:
            return got
    return None


def test_frame_text_drops_addresses_directories_and_by_default_lines() -> None:
    f = Frame(name="ncclKernel 0x7f3a2c001234", filename="/usr/lib/libnccl.so.2+0x1f00", line=88, native=True)
    assert frame_text(f) == "ncclKernel (libnccl.so.2)"
    g = Frame(name="Stage.forward", filename="/home/alice/venv/model.py", line=42)
    assert frame_text(g) == "Stage.forward (model.py)"
    assert frame_text(g, keep_lines=True) == "Stage.forward (model.py:42)"


def test_line_numbers_split_groups_only_when_kept() -> None:
    stacks = {r: RankStacks(r, process(100 + r, OPTIMIZER, line=10 + r % 2)) for r in range(4)}
    assert len(group_stacks(stacks).groups) == 1
    kept = group_stacks(stacks, SignatureOptions(keep_lines=True))
    assert sorted(g.ranks for g in kept.groups) == [(0, 2), (1, 3)]


def test_wrapper_frames_are_folded_unless_asked() -> None:
    plain = RankStacks(0, process(100, OPTIMIZER))
    wrapped_spec = [*OPTIMIZER[:-1], "wrapper c10d_logger.py", "_call_impl module.py", OPTIMIZER[-1]]
    wrapped = RankStacks(1, process(101, wrapped_spec))
    assert len(group_stacks({0: plain, 1: wrapped}).groups) == 1
    unfolded = group_stacks({0: plain, 1: wrapped}, SignatureOptions(fold_wrappers=False))
    assert len(unfolded.groups) == 2
    custom = RankStacks(2, process(102, [*OPTIMIZER[:-1], "retry_on_fail util.py", OPTIMIZER[-1]]))
    assert len(group_stacks({0: plain, 2: custom}, SignatureOptions(extra_wrappers=("retry_on_fail",))).groups) == 1


def test_grouping_largest_first_and_outliers() -> None:
    stacks = {r: rank_stacks(r, OPTIMIZER) for r in range(10)}
    for r in (7, 8):
        stacks[r] = rank_stacks(r, RECV)
    stacks[9] = rank_stacks(9, SEND)
    g = group_stacks(stacks)
    assert [grp.ranks for grp in g.groups] == [tuple(range(7)), (7, 8), (9,)]
    assert g.dominant == (0,) and g.outliers == (1, 2)
    assert g.outlier_ranks == (7, 8, 9)
    assert g.groups[1].frames == ("<module> (train.py)", "main (train.py)", "train_loop (train.py)",
                                  "forward_backward (schedules.py)", "recv_forward (p2p.py)", "irecv (distributed_c10d.py)")
    assert g.groups[1].summary == "irecv (distributed_c10d.py) <- recv_forward"


def test_idle_threads_are_left_out_but_busy_threads_count() -> None:
    idle = ["_bootstrap threading.py", "_pin_memory_loop pin_memory.py", "get queue.py", "wait threading.py"]
    busy = ["_bootstrap threading.py", "writer_loop ckpt.py", "torch_save serialization.py"]
    stacks = {r: rank_stacks(r, OPTIMIZER, threads=[idle]) for r in range(4)}
    stacks[3] = rank_stacks(3, OPTIMIZER)  # no pin-memory thread at all: same signature
    stacks[2] = rank_stacks(2, OPTIMIZER, threads=[idle, busy])
    g = group_stacks(stacks)
    assert [grp.ranks for grp in g.groups] == [(0, 1, 3), (2,)]
    assert g.groups[1].lanes[1] == Lane(ProcessRole.MAIN, True, ("writer_loop (ckpt.py)", "torch_save (serialization.py)"))
    assert g.groups[1].lanes[1].label == "main/thread"
    every = group_stacks(stacks, SignatureOptions(include_idle_threads=True))
    assert len(every.groups) == 3


def test_subprocess_lanes_count_as_a_set() -> None:
    stacks = {r: rank_stacks(r, OPTIMIZER, workers=[WORKER_IDLE] * (1 + r % 3)) for r in range(6)}
    stacks[4] = rank_stacks(4, OPTIMIZER, workers=[WORKER_IDLE, WORKER_STUCK, WORKER_IDLE])
    g = group_stacks(stacks)
    assert [grp.ranks for grp in g.groups] == [(0, 1, 2, 3, 5), (4,)]
    assert "[dataloader] read_shard (dataset.py)" in g.groups[1].summary
    assert diverging_frame(g, g.groups[1]) == \
        "[dataloader] _worker_loop (worker.py) (a dataloader lane the healthy ranks lack)"
    assert len(group_stacks(stacks, SignatureOptions(include_subprocesses=False)).groups) == 1


def test_unreadable_ranks_and_workers_are_kept_apart() -> None:
    stacks = {r: rank_stacks(r, OPTIMIZER) for r in range(4)}
    stacks[1] = unreadable(1, CaptureErrorKind.PERMISSION)
    gone = ProcessStack(pid=5, role=ProcessRole.DATALOADER, threads=None)
    stacks[2] = RankStacks(2, stacks[2].main, (gone,))
    g = group_stacks(stacks)
    assert g.unseen == (1,)
    assert [grp.ranks for grp in g.groups] == [(0, 2, 3)]
    assert any("1 subprocess(es) could not be read" in n for n in g.notes)


def test_no_majority_means_no_outliers() -> None:
    stacks = {0: rank_stacks(0, OPTIMIZER), 1: rank_stacks(1, RECV), 2: rank_stacks(2, SEND)}
    g = group_stacks(stacks)
    assert g.dominant == () and g.outliers == ()
    assert "no two of the 3 ranks" in g.notes[0]


def test_prefix_tree_rank_sets_like_stat() -> None:
    stacks = {r: rank_stacks(r, OPTIMIZER) for r in range(6)}
    stacks[4] = rank_stacks(4, RECV)
    stacks[5] = rank_stacks(5, COMPUTE)
    tree = tree_from_grouping(group_stacks(stacks))
    assert tree.frame == "all ranks" and tree.ranks == tuple(range(6))
    main = tree.children[0]
    assert main.frame == "[main]" and main.ranks == tuple(range(6))
    loop = _find(tree, "train_loop (train.py)")
    assert loop is not None and loop.ranks == tuple(range(6))
    assert [c.frame for c in loop.children] == ["step (optimizer.py)", "forward_backward (schedules.py)"]
    fb = loop.children[1]
    assert fb.ranks == (4, 5)
    assert sorted((c.frame, c.ranks) for c in fb.children) == [("forward (model.py)", (5,)),
                                                               ("recv_forward (p2p.py)", (4,))]
    leaf = _find(tree, "matmul_slow (model.py)")
    assert leaf is not None and leaf.ranks == (5,) and leaf.children == ()


def test_diverging_frame_is_first_frame_off_the_healthy_path() -> None:
    stacks = {r: rank_stacks(r, OPTIMIZER) for r in range(5)}
    stacks[3] = rank_stacks(3, COMPUTE)
    stacks[4] = rank_stacks(4, TRAIN)  # stopped short of the healthy depth
    g = group_stacks(stacks)
    by_rank = {grp.ranks[0]: grp for grp in g.groups}
    assert diverging_frame(g, by_rank[3]) == "forward_backward (schedules.py)"
    assert diverging_frame(g, by_rank[4]) == "train_loop (train.py) (stops here; healthy ranks go deeper)"
    assert diverging_frame(g, by_rank[0]) is None


def test_main_thread_found_by_name_not_position() -> None:
    main = ThreadStack(thread_id=1, frames=frames(RECV), thread_name="MainThread", os_thread_id=9)
    other = ThreadStack(thread_id=2, frames=frames(COMPUTE), thread_name="Thread-1", os_thread_id=10)
    rs = RankStacks(0, ProcessStack(pid=9, role=ProcessRole.MAIN, threads=(other, main)))
    g = group_stacks({0: rs})
    assert g.groups[0].frames[-1] == "irecv (distributed_c10d.py)"


def test_a_rank_without_python_frames_is_unseen_not_healthy() -> None:
    stacks = {r: rank_stacks(r, []) for r in range(5)}  # processes tearing down
    stacks[0] = rank_stacks(0, OPTIMIZER)
    stacks[1] = rank_stacks(1, OPTIMIZER)
    g = group_stacks(stacks)
    assert g.unseen == (2, 3, 4)
    assert [grp.ranks for grp in g.groups] == [(0, 1)]


def test_rankscope_plugin_frames_are_invisible() -> None:
    # The CCL plugin wraps Work.wait; with or without it, a waiting rank looks the same.
    plain = RankStacks(0, process(100, OPTIMIZER))
    hooked = RankStacks(1, ProcessStack(pid=101, role=ProcessRole.MAIN, threads=(ThreadStack(
        thread_id=1, thread_name="MainThread",
        frames=(Frame("_wrap_work_methods.<locals>.wait", "/site/rankscope/ccl_plugin/torch_hooks.py", 88),
                *frames(OPTIMIZER))),)))
    g = group_stacks({0: plain, 1: hooked}, SignatureOptions(fold_wrappers=False))
    assert [grp.ranks for grp in g.groups] == [(0, 1)]
    assert g.groups[0].frames[-1] == "all_reduce (distributed_c10d.py)"


def test_stacks_sharing_one_tuple_group_as_their_copies_do() -> None:
    """A decoder hands identical stacks over as one shared tuple; the grouping must not depend on that."""
    shared_main, shared_recv = frames(OPTIMIZER), frames(RECV)

    def build(share: bool) -> dict[int, RankStacks]:
        out = {}
        for r in range(8):
            main = (shared_recv if share else frames(RECV)) if r in (5, 6) else (shared_main if share else frames(OPTIMIZER))
            # rank 3's dataloader worker shows the very tuple the main threads show: another lane all the same
            worker = ProcessStack(9000 + r, ProcessRole.DATALOADER, (ThreadStack(1, shared_main if share else frames(OPTIMIZER)),))
            subs = (worker,) if r == 3 else ()
            out[r] = RankStacks(r, ProcessStack(1000 + r, ProcessRole.MAIN, (ThreadStack(10, main, "MainThread"),)), subs)
        return out

    shared, copied = group_stacks(build(True)), group_stacks(build(False))
    assert [g.ranks for g in shared.groups] == [g.ranks for g in copied.groups] == [(0, 1, 2, 4, 7), (5, 6), (3,)]
    assert [g.signature for g in shared.groups] == [g.signature for g in copied.groups]
