"""Ranks waiting in asynchronous (NCCL) collectives: the host syncs on its GPU, the counters show the call open.

The shape is the one measured on a GPU (design §8, ../shared/gpu/nccl_two_ranks.py): two ranks, each step an
all_reduce, a broadcast, a send/recv and ``.item()``; rank 1 stops in its own Python before step 40's
collectives. Rank 0 launched all three (CL 41) and waits at ``.item()``: its Python stack is ``<module>`` at that
line (natively ``cudaStreamSynchronize`` <- ``_local_scalar_dense_cuda`` <- ``item``); rank 1's counters stop at 40.
On gloo the same job gives "rank 1 (computing; 1 rank waits on it)": on NCCL it must too (Aegis' scenario 1).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from ccl_fixtures import with_counters
from hypothesis import given, settings
from hypothesis import strategies as st
from rankscope.analyzers.analysis import analyze_job
from rankscope.analyzers.ccl import analyze_counters
from rankscope.analyzers.ccl_desync import counter_waits
from rankscope.analyzers.chain import RankState
from rankscope.analyzers.findings import SuspectKind
from rankscope.analyzers.stage_rank_states import counted_waits, host_wait_frame, rank_views
from rankscope.contract.snapshot import (
    Communicator,
    Frame,
    JobSnapshot,
    OpCounters,
    ProcessRole,
    ProcessStack,
    RankCounters,
    RankStacks,
    ThreadStack,
)
from stack_fixtures import snapshot

SCRIPT = "/job/nccl_two_ranks.py"
ITEM_LINE = 97  # float(x[0].item())
PG = Communicator("0", "nccl", "default_pg", (0, 1))


def _py(name: str, line: int) -> Frame:
    return Frame(name, SCRIPT, line)


def _native(name: str, lib: str) -> Frame:
    return Frame(name, lib, None, module=lib, native=True)


ITEM_NATIVE = (  # innermost first, as py-spy --native reports it
    _native("ioctl", "libc.so.6"),
    _native("cuStreamSynchronize", "libcuda.so.1"),
    _native("cudaStreamSynchronize", "libcudart.so.13"),
    _native("at::native::_local_scalar_dense_cuda(at::Tensor const&)", "libtorch_cuda.so"),
    _native("at::_ops::_local_scalar_dense::call(at::Tensor const&)", "libtorch_cpu.so"),
    _native("THPVariable_item", "libtorch_python.so"),
    _native("_PyEval_EvalFrameDefault", "libpython3.12.so"),
)


def _rank(rank: int, frames: tuple[Frame, ...]) -> RankStacks:
    thread = ThreadStack(thread_id=rank * 10, frames=frames, thread_name="MainThread", os_thread_id=1000 + rank)
    return RankStacks(rank, ProcessStack(1000 + rank, ProcessRole.MAIN, (thread,)))


def _stacks(native: bool) -> dict[int, RankStacks]:
    at_item = (*(ITEM_NATIVE if native else ()), _py("<module>", ITEM_LINE))
    stuck = (_py("stuck_in_compute", 80), _py("<module>", 93))
    return {0: _rank(0, at_item), 1: _rank(1, stuck)}


def _op(op: str, cl: int, wr: int | None = None, wc: int | None = None, peers: tuple[int, ...] = (),
        comm: str = "0") -> OpCounters:
    return OpCounters(comm, op, cl, cl if wr is None else wr, cl if wc is None else wc, open_peers=peers)


def _file(rank: int, ops: tuple[OpCounters, ...], comms: tuple[Communicator, ...] = (PG,)) -> RankCounters:
    return RankCounters(rank=rank, pid=1000 + rank, world_size=2, job_id="j", heartbeat_wall=1.0,
                        communicators=comms, ops=ops, steps=0)


def shim_counters() -> dict[int, RankCounters]:
    """The shim's counters with completion counted on the device: rank 0's step-40 calls are open."""
    return {0: _file(0, (_op("all_reduce", 41, wc=40), _op("broadcast", 41, wc=40), _op("send", 41, wc=40, peers=(1,)))),
            1: _file(1, (_op("all_reduce", 40), _op("broadcast", 40), _op("recv", 40)))}


def plugin_counters() -> dict[int, RankCounters]:
    """The NCCL profiler plugin's counters as measured: work requests per proxy step, eight of rank 0's open.

    Its communicator record knows NCCL's commHash, size and the rank's place, not the global ranks.
    """
    def comm(rank: int) -> Communicator:
        return Communicator("9f3c2a61d0b4e775", "nccl", "", (), comm_nranks=2, comm_rank=rank)

    return {0: _file(0, (_op("AllReduce", 41, 652, 644, comm="9f3c2a61d0b4e775"),), (comm(0),)),
            1: _file(1, (_op("AllReduce", 40, 640, 640, comm="9f3c2a61d0b4e775"),), (comm(1),))}


def _job(native: bool, counters: dict[int, RankCounters]) -> JobSnapshot:
    return with_counters(snapshot(_stacks(native), world=2, rpm=2), counters)


def test_the_host_wait_is_found_under_item_natively_and_in_torch_cuda_synchronize() -> None:
    assert host_wait_frame(ITEM_NATIVE) == "cuStreamSynchronize (libcuda.so.1)"
    sync = (Frame("synchronize", "/site/torch/cuda/__init__.py", 1040), _py("<module>", 5))
    assert host_wait_frame(sync) == "synchronize (__init__.py)"
    future = (Frame("wait", "/site/torch/futures/__init__.py", 70), _py("<module>", 5))
    assert host_wait_frame(future) == "wait (__init__.py)"
    # a function of the job's own called synchronize, and plain Python work, are not host waits
    assert host_wait_frame((_py("synchronize", 3), _py("<module>", 5))) == ""
    assert host_wait_frame((_py("stuck_in_compute", 80), _py("<module>", 93))) == ""


@pytest.mark.parametrize("native", [False, True], ids=["python-frames", "native-frames"])
@pytest.mark.parametrize("counters", [shim_counters, plugin_counters], ids=["shim", "nccl-plugin"])
def test_the_rank_waiting_at_item_is_a_victim_of_the_rank_stuck_in_its_own_code(native: bool, counters) -> None:  # type: ignore[no-untyped-def]
    a = analyze_job(_job(native, counters()))
    v = a.verdict
    assert v.summary.startswith("rank 1 on node0 (computing; 1 rank waits on it)"), v.summary
    top = v.top
    assert top is not None and top.kind is SuspectKind.RANK and top.ranks == (1,)
    assert top.victims == (0,) and top.roots == (1,)
    assert a.stacks.chain is not None
    assert a.stacks.chain.views[0].state is RankState.COLLECTIVE
    assert a.stacks.chain.views[1].state is RankState.COMPUTING


def test_a_rank_syncing_after_an_isend_its_peer_never_matched_waits_on_that_peer() -> None:
    """Pipeline on NCCL: rank 0's isend to rank 1 is queued and open, rank 1 (in its own code) never posted the recv."""
    files = {0: _file(0, (_op("send", 41, wc=40, peers=(1,)),)), 1: _file(1, (_op("recv", 40),))}
    a = analyze_job(_job(True, files))
    assert a.stacks.chain is not None
    view = a.stacks.chain.views[0]
    assert view.state is RankState.P2P and view.peers == (1,) and "send to rank(s) 1" in view.counted
    top = a.verdict.top
    assert top is not None and top.ranks == (1,) and top.roots == (1,) and top.victims == (0,), a.verdict.summary


def test_the_cl_rule_fires_on_asynchronous_counters() -> None:
    """WC lags WR while the device runs: rank 0's open request in launch 41 waits on rank 1, whose CL is 40."""
    for counters in (shim_counters(), plugin_counters()):
        v = analyze_counters(_job(False, counters))
        top = v.top
        assert top is not None and top.ranks == (1,) and top.roots == (1,), v.summary
        assert "CL 40 < 41" in top.evidence[0]


def test_a_native_stack_busy_in_its_own_code_stays_computing_whatever_is_open() -> None:
    """With --native frames and no synchronisation among them the host is working, not waiting on its GPU."""
    busy = (_native("gemm_kernel_launch", "libcublas.so"), _py("stuck_in_compute", 80), _py("<module>", 93))
    views = rank_views({0: _rank(0, busy), 1: _stacks(False)[1]}, 2, {})
    assert views[0].native and not views[0].host_wait
    assert counted_waits(views, counter_waits(shim_counters()))[0].state is RankState.COMPUTING
    # the same Python frames without native ones cannot tell: the counters' wait decides
    python_only = rank_views({0: _rank(0, busy[1:]), 1: _stacks(False)[1]}, 2, {})
    assert counted_waits(python_only, counter_waits(shim_counters()))[0].state is RankState.COLLECTIVE


def test_without_counters_a_host_wait_alone_is_no_collective() -> None:
    """Only the counters say the GPU waits in a collective; a host syncing on its GPU may wait on a long kernel."""
    views = rank_views(_stacks(True), 2, {})
    assert views[0].state is RankState.COMPUTING and views[0].host_wait.startswith("cuStreamSynchronize")
    # all calls finished: nothing open, nobody waits
    done = {r: replace(rc, ops=tuple(replace(o, wc=o.wr) for o in rc.ops)) for r, rc in shim_counters().items()}
    assert counted_waits(views, counter_waits(done))[0].state is RankState.COMPUTING


# --------------------------------------------------------------------------
# NCCL's communicator identity: records of one commHash are one communicator
# --------------------------------------------------------------------------


def _nccl(rank: int, place: int, size: int = 4, cid: str = "c0ffee") -> Communicator:
    return Communicator(cid, "nccl", "", (), comm_nranks=size, comm_rank=place)


def test_records_of_one_commhash_are_one_communicator_tied_to_the_torch_group_with_its_members() -> None:
    from rankscope.analyzers.topology import communicator_joins, distinct_communicators

    tp = Communicator("3", "nccl", "TENSOR_MODEL_PARALLEL_GROUP", (4, 5, 6, 7))
    files = {r: RankCounters(rank=r, pid=r, world_size=8, job_id="j", heartbeat_wall=1.0,
                             communicators=(tp, _nccl(r, r - 4))) for r in (4, 5, 6, 7)}
    comm = distinct_communicators(files)["c0ffee"]
    assert comm.ranks == (4, 5, 6, 7) and comm.description == "TENSOR_MODEL_PARALLEL_GROUP" and comm.comm_nranks == 4
    (j,) = communicator_joins(files)
    assert j.torch_group == "3" and j.missing_ranks == () and j.missing_places == ()
    # rank 6's file is missing: the torch group, whose members sit at NCCL's places, names it
    del files[6]
    (j,) = communicator_joins(files)
    assert j.reporters == (4, 5, 7) and j.missing_places == (2,) and j.missing_ranks == (6,)
    assert distinct_communicators(files)["c0ffee"].ranks == (4, 5, 6, 7)
    # no torch group recorded (the plugin alone): the reporters are the members, the missing place is named
    alone = {r: replace(rc, communicators=(_nccl(r, r - 4),)) for r, rc in files.items()}
    (j,) = communicator_joins(alone)
    assert j.members == (4, 5, 7) and j.missing_places == (2,) and j.missing_ranks == () and j.torch_group == ""
    v = analyze_counters(with_counters(snapshot({}, world=8, rpm=2), alone))
    assert any("NCCL rank(s) 2" in n and "3 report it (4-5,7)" in n for n in v.notes), v.notes


_RECORDS = st.builds(Communicator, st.sampled_from(["aa", "bb", "0"]), st.sampled_from(["nccl", "gloo"]),
                     st.sampled_from(["", "default_pg", "TENSOR_MODEL_PARALLEL_GROUP"]),
                     st.sampled_from([(), (0, 1), (0, 1, 2, 3), (3, 2), (5,)]), st.integers(-2, 9),
                     st.integers(-3, 9))
_OPS = st.builds(OpCounters, st.sampled_from(["aa", "bb", "0"]), st.sampled_from(["all_reduce", "send", "recv"]),
                 st.integers(0, 5), st.integers(0, 5), st.integers(0, 5),
                 open_peers=st.lists(st.integers(-1, 5), max_size=2).map(tuple))


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.integers(0, 5), st.tuples(st.lists(_RECORDS, max_size=3), st.lists(_OPS, max_size=3)),
                       max_size=5))
def test_any_counter_records_join_and_judge_without_raising(files: dict[int, tuple[list[Communicator], list[OpCounters]]]
                                                            ) -> None:
    """Counter files are outside input: sizes smaller than the reporters, places out of range or repeated, ids
    shared by records that disagree. The join names what it can and the analysis never raises."""
    from rankscope.analyzers.topology import communicator_joins, distinct_communicators

    counters = {r: RankCounters(rank=r, pid=r, world_size=6, job_id="j", heartbeat_wall=1.0,
                                communicators=tuple(comms), ops=tuple(ops)) for r, (comms, ops) in files.items()}
    joined = distinct_communicators(counters)
    for j in communicator_joins(counters):
        assert set(j.reporters) <= set(j.members)
        assert all(0 <= p < j.nranks for p in j.missing_places)
        assert joined[j.comm_id].ranks == j.members
    snap = with_counters(snapshot({}, world=6, rpm=2), counters)
    analyze_counters(snap)
    analyze_job(snap)
