"""Issue 29's two verdicts and issue 26's victim counts, in the one analysis path (analysis.analyze_job).

- "not a rank": every member of a communicator waits in the same call (same launch, where counters say) and no
  rank is pinned: the verdict says so, with what tells the communication layer, the network and a driver apart,
  and picks no rank by tie-break;
- a desync of ranks in different groups (two ranks of different pipeline stages or TP groups a step ahead, the
  rest in the epoch-end barrier) is one desync suspect naming both;
- the drill's hang-p2p at rank 6 of 8 (TP=2, PP=2, DP=2): the merged verdict says 7 ranks wait on rank 6 and pins it.
"""

from __future__ import annotations

import pytest
from ccl_fixtures import BARRIER, DP8, L8, PP8, TP8, Counters, with_counters
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rankscope.analyzers.analysis import analyze_job
from rankscope.analyzers.findings import NOT_A_RANK, Finding, SuspectKind, Verdict, VerdictStatus
from rankscope.analyzers.findings import NOT_A_RANK_PREFIX as PREFIX
from rankscope.analyzers.not_a_rank import settle
from rankscope.analyzers.render import headline, headline_parts
from snapshot_fixtures import machines
from stack_fixtures import OPTIMIZER, RECV, SEND, TRAIN, rank_stacks, snapshot
from test_async_waits import ITEM_LINE, _file, _op, _py, _rank

# --------------------------------------------------------------------------
# the drill's hang-p2p at rank 6, stacks and counters as the drill's bundle holds them
# --------------------------------------------------------------------------

DP_WAIT = ["run_step worker.py", "train_step model.py", "all_reduce_gradients model.py", "all_reduce distributed_c10d.py"]
P2P_WAIT = ["run_step worker.py", "train_step model.py", "recv_backward model.py", "recv distributed_c10d.py"]
TP_WAIT = ["BackwardCFunction.apply function.py", "_CopyToTensorParallel.backward model.py", "tp_all_reduce model.py",
           "all_reduce distributed_c10d.py"]
HUNG = ["train worker.py", "run_step worker.py", "train_step model.py", "send_backward model.py",
        "Injector.before_comm worker.py", "drill_injected_hang_p2p worker.py"]


def hang_p2p_at_6(with_ccl: bool = True):  # type: ignore[no-untyped-def]
    stacks = {r: rank_stacks(r, DP_WAIT) for r in (0, 1, 4, 5)}
    stacks |= {2: rank_stacks(2, P2P_WAIT), 3: rank_stacks(3, TP_WAIT), 7: rank_stacks(7, TP_WAIT),
               6: rank_stacks(6, HUNG)}
    snap = snapshot(stacks, 8, 2, L8)
    if not with_ccl:
        return snap
    c = Counters(8)
    tp = {g: c.comm(f"tp{i}", "TENSOR_MODEL_PARALLEL_GROUP", g) for i, g in enumerate(TP8)}
    dp = {g: c.comm(f"dp{i}", "DATA_PARALLEL_GROUP", g) for i, g in enumerate(DP8)}
    pp = {g: c.comm(f"pp{i}", "PIPELINE_MODEL_PARALLEL_GROUP", g) for i, g in enumerate(PP8)}

    def of(groups: dict[tuple[int, int], str], r: int) -> str:
        return next(cid for g, cid in groups.items() if r in g)

    tp_cl = {0: (96, 96), 1: (96, 96), 4: (96, 96), 5: (96, 96), 2: (88, 88), 3: (89, 88), 6: (90, 90), 7: (91, 90)}
    for r, (cl, wc) in tp_cl.items():
        c.op(r, of(tp, r), "all_reduce", cl, wc)
    for r in range(8):
        c.op(r, of(dp, r), "all_reduce", 6 if r in (0, 1, 4, 5) else 5, 5)
        c.op(r, of(pp, r), "send", 20 if r == 6 else 21 if r == 7 else 24)
        c.op(r, of(pp, r), "recv", 21 if r in (2, 3) else 24, 20 if r == 2 else None, [6] if r == 2 else [])
    return with_counters(snap, c.files())


def test_the_stalled_stage_names_rank_6_with_every_rank_that_waits_on_it() -> None:
    v = analyze_job(hang_p2p_at_6(), L8).verdict
    top = v.top
    assert top is not None and top.kind is SuspectKind.PP and top.ranks == (2, 3, 6, 7)
    assert top.roots == (6,)
    assert top.victims == (0, 1, 2, 3, 4, 5, 7)  # its group's own waiting members too: 7, not 4
    assert "root rank 6 (computing; 7 ranks wait on it)" in v.summary, v.summary
    assert v.status is VerdictStatus.NAMED
    # The verdict panel draws the root on a line of its own from the verdict's parts, never by cutting its text.
    head, root = headline_parts(v)
    assert root.startswith("root rank 6 (computing; 7 ranks wait on it) (") and "root rank" not in head, (head, root)
    assert f"{head}, {root}" == v.summary == headline(v)
    # the stacks alone say the same
    alone = analyze_job(hang_p2p_at_6(with_ccl=False), L8).verdict
    assert alone.top is not None and alone.top.roots == (6,) and len(alone.top.victims) == 7
    assert headline_parts(alone)[1].startswith("root rank 6 (computing; 7 ranks wait on it)"), alone.summary


# --------------------------------------------------------------------------
# not a rank
# --------------------------------------------------------------------------


def test_every_rank_in_the_same_asynchronous_collective_is_not_a_rank() -> None:
    """Both ranks launched all_reduce 41 and wait at .item(): no lag, no rank to pick (before: rank 0 by tie-break)."""
    both = {r: _file(r, (_op("all_reduce", 41, wc=40), _op("broadcast", 41, wc=40))) for r in (0, 1)}
    snap = with_counters(snapshot({r: _rank(r, (_py("<module>", ITEM_LINE),)) for r in (0, 1)}, 2, 2), both)
    a = analyze_job(snap)
    v = a.verdict
    assert v.suspects == (), [(s.ranks, s.evidence[0]) for s in v.suspects]
    assert v.summary.startswith(PREFIX + "all 2 ranks of the job (ranks 0-1) wait in the same call"), v.summary
    assert v.status is VerdictStatus.NOT_A_RANK and headline(v) == v.summary
    stalls = [f for f in v.findings if f.kind == NOT_A_RANK]
    assert stalls and all(f.ranks == (0, 1) for f in stalls)
    assert any("launch 41" in e for f in stalls for e in f.evidence)
    assert "RAS" in stalls[0].advice and "Xid" in stalls[0].advice


def test_a_lag_anywhere_is_a_rank_not_a_symmetric_stall() -> None:
    """Same stacks, but the counters show rank 1 a launch behind: rank 1 is named, the stall is not said."""
    lag = {0: _file(0, (_op("all_reduce", 41, wc=40),)), 1: _file(1, (_op("all_reduce", 40),))}
    snap = with_counters(snapshot({r: _rank(r, (_py("<module>", ITEM_LINE),)) for r in (0, 1)}, 2, 2), lag)
    v = analyze_job(snap).verdict
    assert not v.summary.startswith(PREFIX) and all(f.kind != NOT_A_RANK for f in v.findings)
    assert v.status is VerdictStatus.NAMED
    assert v.top is not None and v.top.ranks == (1,) and v.top.roots == (1,)


def test_a_communicator_smaller_than_the_job_waiting_together_is_its_group_with_no_rank_pinned() -> None:
    """TP pair 6-7 both inside TP all-reduce 91, none behind; the others wait on them (in DP all-reduces 6-7 never
    launched, in recvs 6-7 never posted). The pair is the suspect group, no rank of it pinned; no lag is blamed."""
    stacks = {r: rank_stacks(r, RECV) for r in (0, 1, 2, 3)}
    stacks |= {r: rank_stacks(r, OPTIMIZER) for r in (4, 5)}
    stacks |= {r: rank_stacks(r, [*TRAIN, "forward model.py", "tp_all_reduce model.py",
                                  "all_reduce distributed_c10d.py"]) for r in (6, 7)}
    c = Counters(8)
    for i, g in enumerate(TP8):
        cid = c.comm(f"tp{i}", "TENSOR_MODEL_PARALLEL_GROUP", g)
        for r in g:
            c.op(r, cid, "all_reduce", 91 if r in (6, 7) else 90, 90)
    for i, g in enumerate(DP8):
        cid = c.comm(f"dp{i}", "DATA_PARALLEL_GROUP", g)
        for r in g:
            c.op(r, cid, "all_reduce", 6 if r in (4, 5) else 5, 5)
    for i, (a, b) in enumerate(PP8):
        cid = c.comm(f"pp{i}", "PIPELINE_MODEL_PARALLEL_GROUP", (a, b))
        c.op(a, cid, "recv", 21, 20, [b])
        c.op(b, cid, "send", 20)
    v = analyze_job(with_counters(snapshot(stacks, 8, 2, L8), c.files()), L8).verdict
    assert not any(s.roots for s in v.suspects), [(s.kind, s.ranks, s.roots) for s in v.suspects]
    (stall,) = [f for f in v.findings if f.kind == NOT_A_RANK]
    assert stall.ranks == (6, 7) and "TENSOR_MODEL_PARALLEL_GROUP" in (stall.communicator or "")
    assert v.summary.startswith(PREFIX + "all 2 members of comm tp3"), v.summary
    assert v.top is not None and {6, 7} <= set(v.top.ranks)  # (the pair, or the layout group holding it)
    counters = analyze_job(with_counters(snapshot(stacks, 8, 2, L8), c.files()), L8).counters
    assert counters is not None
    (pair,) = [s for s in counters.suspects if s.kind is SuspectKind.COMM]
    assert pair.ranks == (6, 7) and pair.roots == () and pair.victims == (0, 1, 2, 3, 4, 5)  # all wait on the pair


def test_a_symmetric_stall_another_detector_reports_is_said_in_the_one_path() -> None:
    """Logs read elsewhere (every rank's watchdog at the same SeqNum) hand a NOT_A_RANK finding as ``others``."""
    snap = snapshot({r: _rank(r, (_py("<module>", ITEM_LINE),)) for r in range(4)}, 4, 4)
    logs = Verdict((), "logs: every rank's watchdog timed out at SeqNum=1", findings=(
        Finding(NOT_A_RANK, (0, 1, 2, 3), "not a rank: all 4 ranks time out in ALLGATHER SeqNum=1 (watchdog logs)",
                advice="..."),))
    v = analyze_job(snap, others=(logs,)).verdict
    assert v.summary == "not a rank: all 4 ranks time out in ALLGATHER SeqNum=1 (watchdog logs)"
    assert v.suspects == ()


# --------------------------------------------------------------------------
# a desync of ranks in different groups is one suspect of both
# --------------------------------------------------------------------------

TP_AR = [*TRAIN, "forward_backward schedules.py", "tp_all_reduce model.py", "all_reduce distributed_c10d.py"]
DP_AR = [*TRAIN, "all_reduce_gradients model.py", "all_reduce distributed_c10d.py"]


def _two_ahead(ahead: tuple[int, int], where: str) -> tuple[dict, Counters]:  # type: ignore[type-arg]
    """Ranks ``ahead`` ran one step more: each blocks at ``where`` (tp/dp all-reduce, or send/recv by stage); the
    rest wait in the world barrier at the epoch end, which the two never launched."""
    def stack(r: int) -> list[str]:
        if r not in ahead:
            return BARRIER
        return {"tp": TP_AR, "dp": DP_AR}.get(where) or (SEND if r < 4 else RECV)

    stacks = {r: rank_stacks(r, stack(r)) for r in range(8)}
    c = Counters(8)
    world = c.comm("0", "default_pg", range(8))
    for r in range(8):
        if r not in ahead:
            c.op(r, world, "barrier", 1, 0)
    for kind, groups, base in (("tp", TP8, 80), ("dp", DP8, 5)):
        for i, g in enumerate(groups):
            cid = c.comm(f"{kind}{i}", {"tp": "TENSOR_MODEL_PARALLEL_GROUP", "dp": "DATA_PARALLEL_GROUP"}[kind], g)
            for r in g:
                c.op(r, cid, "all_reduce", base + 1 if (r in ahead and where == kind) else base, base)
    pp_of = dict(PP8) | {b: a for a, b in PP8}
    for i, (a, b) in enumerate(PP8):
        cid = c.comm(f"pp{i}", "PIPELINE_MODEL_PARALLEL_GROUP", (a, b))
        for r in (a, b):
            extra = r in ahead and where == "p2p"
            c.op(r, cid, "send", 21 if extra and r < 4 else 20, 20, [pp_of[r]] if extra and r < 4 else [])
            c.op(r, cid, "recv", 21 if extra and r >= 4 else 20, 20, [pp_of[r]] if extra and r >= 4 else [])
    return stacks, c


@pytest.mark.parametrize("ahead, where", [((1, 6), "p2p"), ((1, 5), "tp"), ((1, 6), "tp"), ((0, 5), "dp")],
                         ids=["stages-0-1-in-send-recv", "tp-groups-0-2", "tp-groups-0-3", "dp-groups-0-3"])
def test_two_ranks_of_different_groups_a_step_ahead_are_one_desync(ahead: tuple[int, int], where: str) -> None:
    stacks, c = _two_ahead(ahead, where)
    v = analyze_job(with_counters(snapshot(stacks, 8, 2, L8), c.files()), L8).verdict
    top = v.top
    assert top is not None and top.kind is SuspectKind.DESYNC and top.ranks == ahead, v.summary
    assert set(top.victims) == set(range(8)) - set(ahead)
    assert top.roots == ahead
    assert [s.ranks for s in v.suspects if s.kind is SuspectKind.DESYNC] == [ahead]
    assert [f.ranks for f in v.findings if f.kind == "desync"] == [ahead]


@pytest.mark.parametrize("ahead, where", [((1, 5), "tp"), ((1, 6), "tp"), ((0, 5), "dp")],
                         ids=["tp-groups-0-2", "tp-groups-0-3", "dp-groups-0-3"])
def test_the_stacks_alone_name_both_too(ahead: tuple[int, int], where: str) -> None:
    stacks, _ = _two_ahead(ahead, where)
    v = analyze_job(snapshot(stacks, 8, 2, L8), L8).verdict
    top = v.top
    assert top is not None and top.kind is SuspectKind.DESYNC and top.ranks == ahead, v.summary
    assert "the other 6 ranks of the job" in v.summary


def test_a_symmetric_stall_carries_what_nvml_said_of_its_machines_gpus() -> None:
    """An Xid on one machine's GPU is the reading that tells a driver fault from the network: it is in the finding."""
    from dataclasses import replace

    from rankscope.contract.snapshot import GpuMetrics, GpuStatus

    stacks = {r: rank_stacks(r, OPTIMIZER) for r in range(8)}
    snap = snapshot(stacks, 8, 2, L8)
    gpus = {"node2": GpuStatus(True, (GpuMetrics(0), GpuMetrics(1, xid_events=(79,)))),
            "node0": GpuStatus(True, (GpuMetrics(0), GpuMetrics(1)))}
    snap = replace(snap, machines=tuple(replace(m, gpus=gpus.get(m.machine)) for m in snap.machines))
    v = analyze_job(snap, L8).verdict
    (stall,) = [f for f in v.findings if f.kind == NOT_A_RANK]
    assert "NVML on node2, GPU 1: Xid 79: look there first" in stall.evidence
    assert not any("node0" in e for e in stall.evidence)
    assert v.summary.startswith(PREFIX)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(machines(), min_size=1, max_size=3))
def test_the_one_analysis_never_raises_on_any_capture(ms: list) -> None:  # type: ignore[type-arg]
    """Random stacks, counters and communicators (ranks out of range, sizes and places that disagree, native
    frames): the async waits, the communicator join and the stall rules read them without raising."""
    from rankscope.contract.snapshot import Instant, JobSnapshot

    v = analyze_job(JobSnapshot(Instant(1.0, 1.0), tuple(ms))).verdict
    assert not v.summary.startswith(PREFIX) or all(f.kind != "desync" for f in v.findings)


def test_what_a_verdict_said_before_not_a_rank_is_kept_by_its_status_not_its_words() -> None:
    """``settle`` keeps the replaced headline as a note unless the verdict said it had none: read from its status,
    so a no-verdict headline in other words ("CCL counters: ...") is not kept and a named one is."""
    stall = Finding(NOT_A_RANK, (0, 1), PREFIX + "both ranks wait in all_reduce 41")
    quiet = Verdict((), "CCL counters: every communicator's members agree", findings=(stall,),
                    status=VerdictStatus.NO_VERDICT)
    said = Verdict((), "flight recorder: sizes differ", findings=(stall,))
    for v, noted in ((quiet, False), (said, True)):
        out = settle(v)
        assert out.status is VerdictStatus.NOT_A_RANK and out.summary == stall.summary
        assert (v.summary in out.notes) is noted
