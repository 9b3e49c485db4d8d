"""Which parallel group and machines explain the outliers (rankscope.analyzers.suspects)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rankscope.analyzers.analysis import analyze_stacks
from rankscope.analyzers.findings import NOT_A_RANK, SuspectKind
from rankscope.analyzers.stacks import SignatureOptions
from rankscope.analyzers.verdict_json import verdict_to_json
from rankscope.contract.snapshot import CaptureErrorKind, JobSnapshot, Layout, MachineSnapshot
from rankscope.formats.pyspy_dir import load_pyspy_dir
from repo_paths import FIG7
from stack_fixtures import (
    COMPUTE,
    OPTIMIZER,
    RECV,
    SEND,
    TRAIN,
    WORKER_IDLE,
    WORKER_STUCK,
    rank_stacks,
    snapshot,
    unreadable,
)

FIG7_LAYOUT = Layout(tp=2, pp=4, dp=4, order="tp-pp-dp", ranks_per_machine=2)
# TP=2, PP=2, DP=4 in Megatron's default order: rank = tp + 2*(dp + 4*pp); two ranks per machine.
L16 = Layout(tp=2, pp=2, dp=4, ranks_per_machine=2)


def test_fig7_top_suspect_is_the_pipeline_on_machines_12_to_15() -> None:
    snap = load_pyspy_dir(FIG7, FIG7_LAYOUT)
    analysis = analyze_stacks(snap, FIG7_LAYOUT)
    top = analysis.verdict.top
    assert top is not None
    assert top.kind is SuspectKind.PP
    assert top.machines == ("machine-12", "machine-13", "machine-14", "machine-15")
    assert top.ranks == tuple(range(24, 32))  # the two PP groups (tp=0, tp=1) of dp=3
    assert top.score == 1.0
    assert analysis.verdict.summary == "PP groups #6 and #7 on machine-12..15"
    # evidence names each outlier stack and where it leaves the healthy path
    text = "\n".join(top.evidence)
    for frame in ("irecv", "isend", "all_gather_into_tensor"):
        assert frame in text
    assert top.diverging_frame is not None and "forward_backward_pipelining" in top.diverging_frame
    # every other suspect scores lower
    assert all(s.score < top.score for s in analysis.verdict.suspects[1:])
    # the 24 healthy ranks are one group despite different line numbers and pin-memory thread names
    assert analysis.grouping.groups[0].ranks == tuple(range(24))
    assert [len(g.ranks) for g in analysis.grouping.groups] == [24, 4, 2, 2]


def test_single_outlier_rank_is_named_alone() -> None:
    stacks = {r: rank_stacks(r, OPTIMIZER) for r in range(16)}
    stacks[5] = rank_stacks(5, COMPUTE)
    analysis = analyze_stacks(snapshot(stacks, 16, 2, L16))
    top = analysis.verdict.top
    assert top is not None and top.kind is SuspectKind.RANK
    assert top.ranks == (5,) and top.machines == ("node2",)
    # every other rank waits on it in the all-reduce: the chain names them as its victims
    assert analysis.verdict.summary == "rank 5 on node2 (computing; 15 ranks wait on it)"
    assert top.victims == tuple(r for r in range(16) if r != 5)
    assert top.diverging_frame == "forward_backward (schedules.py)"


def test_whole_dp_group() -> None:
    dp_group = (1, 3, 5, 7)  # tp=1, pp=0, every dp
    stacks = {r: rank_stacks(r, RECV if r in dp_group else OPTIMIZER) for r in range(16)}
    analysis = analyze_stacks(snapshot(stacks, 16, 2, L16))
    top = analysis.verdict.top
    assert top is not None and top.kind is SuspectKind.DP
    assert top.ranks == dp_group
    assert top.machines == ("node0", "node1", "node2", "node3")
    assert top.group_index == 1


def test_outliers_waiting_in_one_pipeline_in_megatron_order() -> None:
    # PP groups of tp=0/1 with dp=2: ranks 4,5 (pp=0) and 12,13 (pp=1) on node2 and node6, all waiting
    stacks = {r: rank_stacks(r, OPTIMIZER) for r in range(16)}
    stacks[4] = rank_stacks(4, SEND)
    stacks[5] = rank_stacks(5, SEND)
    stacks[12] = rank_stacks(12, RECV)
    stacks[13] = rank_stacks(13, RECV)
    analysis = analyze_stacks(snapshot(stacks, 16, 2, L16))
    top = analysis.verdict.top
    assert top is not None and top.kind is SuspectKind.PP
    assert top.ranks == (4, 5, 12, 13) and top.machines == ("node2", "node6")
    assert top.score == 1.0  # explained by the layout alone: nobody is stuck outside communication


def test_computation_side_origin_is_named_before_its_pipeline() -> None:
    # rank 4 is stuck in its own compute; its TP peer, and the next stage, wait for it (Aegis: computation side)
    stacks = {r: rank_stacks(r, OPTIMIZER) for r in range(16)}
    stacks[4] = rank_stacks(4, COMPUTE)
    stacks[5] = rank_stacks(5, [*COMPUTE[:-1], "tp_all_reduce layers.py", "all_reduce distributed_c10d.py"])
    stacks[12] = rank_stacks(12, RECV)
    stacks[13] = rank_stacks(13, RECV)
    analysis = analyze_stacks(snapshot(stacks, 16, 2, L16))
    top, second = analysis.verdict.suspects[:2]
    assert top.kind is SuspectKind.RANK and top.ranks == (4,) and top.machines == ("node2",)
    assert any(e.startswith("origin: rank 4 is stuck in its own work (matmul_slow (model.py))") for e in top.evidence)
    assert second.kind is SuspectKind.PP and second.ranks == (4, 5, 12, 13)
    # the waiting ranks are explained by it
    assert analysis.verdict.summary == "rank 4 on node2 (computing; 15 ranks wait on it)"


def test_communication_side_origin_names_the_group_it_was_calling() -> None:
    # rank 5 stalls on its way into a TP all-reduce; its TP peer 4 waits in it; the next stage waits in recv
    into_tp = [*COMPUTE[:-1], "tp_all_reduce layers.py"]
    stacks = {r: rank_stacks(r, OPTIMIZER) for r in range(16)}
    stacks[5] = rank_stacks(5, [*into_tp, "stall_here faults.py"])
    stacks[4] = rank_stacks(4, [*into_tp, "all_reduce distributed_c10d.py"])
    stacks[12] = rank_stacks(12, RECV)
    stacks[13] = rank_stacks(13, RECV)
    top = analyze_stacks(snapshot(stacks, 16, 2, L16)).verdict.top
    assert top is not None and top.kind is SuspectKind.TP and top.ranks == (4, 5) and top.machines == ("node2",)
    # the same stall on the way into a send names the pipeline instead
    into_send = [*TRAIN, "forward_backward schedules.py", "send_forward p2p.py"]
    stacks[5] = rank_stacks(5, [*into_send, "stall_here faults.py"])
    stacks[4] = rank_stacks(4, SEND)
    top = analyze_stacks(snapshot(stacks, 16, 2, L16)).verdict.top
    assert top is not None and top.kind is SuspectKind.PP and 5 in top.ranks and "node2" in top.machines


def test_anomaly_only_in_a_subprocess() -> None:
    stacks = {r: rank_stacks(r, OPTIMIZER, workers=[WORKER_IDLE, WORKER_IDLE]) for r in range(8)}
    stacks[6] = rank_stacks(6, OPTIMIZER, workers=[WORKER_IDLE, WORKER_STUCK])
    snap = snapshot(stacks, 8, 2, Layout(tp=2, pp=2, dp=2, ranks_per_machine=2))
    analysis = analyze_stacks(snap)
    top = analysis.verdict.top
    assert top is not None and top.kind is SuspectKind.RANK and top.ranks == (6,)
    assert top.machines == ("node3",)
    assert top.diverging_frame is not None and top.diverging_frame.startswith("[dataloader]")
    assert "read_shard" in analysis.grouping.groups[1].summary
    # main processes alone are identical, every rank in the same all-reduce: no rank is picked, the symmetric
    # stall is said (rankscope.analyzers.not_a_rank), and that no counters told the launch
    blind = analyze_stacks(snap, options=SignatureOptions(include_subprocesses=False))
    assert blind.verdict.suspects == ()
    assert blind.verdict.summary.startswith("not a rank: all 8 ranks of the job"), blind.verdict.summary
    (stall,) = blind.verdict.findings
    assert any("no counters" in e for e in stall.evidence)


def test_several_independent_outlier_groups() -> None:
    stacks = {r: rank_stacks(r, OPTIMIZER) for r in range(16)}
    stacks[2] = rank_stacks(2, COMPUTE)
    stacks[13] = rank_stacks(13, RECV)
    analysis = analyze_stacks(snapshot(stacks, 16, 2, L16))
    tops = analysis.verdict.suspects[:2]
    assert {(s.kind, s.ranks) for s in tops} == {(SuspectKind.RANK, (2,)), (SuspectKind.RANK, (13,))}
    # rank 13 waits in recv on rank 5, which waits in the all-reduce on rank 13: a cycle that leads to no root,
    # so rank 2's chain does not explain it
    assert analysis.verdict.summary.startswith(
        "2 separate suspects: rank 2 on node1 (computing; 9 ranks wait on it); rank 13 on node6")


def test_independent_ranks_with_the_same_stack_are_still_told_apart() -> None:
    stacks = {r: rank_stacks(r, OPTIMIZER) for r in range(16)}
    stacks[2] = rank_stacks(2, COMPUTE)
    stacks[13] = rank_stacks(13, COMPUTE)
    analysis = analyze_stacks(snapshot(stacks, 16, 2, L16))
    assert {s.ranks for s in analysis.verdict.suspects[:2]} == {(2,), (13,)}
    assert "2 separate suspects" in analysis.verdict.summary


def test_all_ranks_identical_in_their_own_work_gives_no_verdict_and_says_so() -> None:
    stacks = {r: rank_stacks(r, COMPUTE) for r in range(16)}
    analysis = analyze_stacks(snapshot(stacks, 16, 2, L16))
    assert analysis.verdict.suspects == () and analysis.verdict.findings == ()
    assert analysis.verdict.top is None
    assert analysis.verdict.summary == "no verdict: all 16 ranks show the same stacks"
    assert analysis.grouping.outliers == ()


def test_all_ranks_in_one_collective_is_not_a_rank() -> None:
    """Every rank waits in the same all-reduce at the same line: no rank is picked, the stall is said (issue 29)."""
    stacks = {r: rank_stacks(r, OPTIMIZER) for r in range(16)}
    analysis = analyze_stacks(snapshot(stacks, 16, 2, L16))
    v = analysis.verdict
    assert v.suspects == () and v.top is None
    assert v.summary.startswith("not a rank: all 16 ranks of the job (ranks 0-15) wait in the same call "
                                "(all_reduce <- step (optimizer.py))"), v.summary
    (stall,) = v.findings
    assert stall.kind == NOT_A_RANK and stall.ranks == tuple(range(16))
    assert "RAS" in stall.advice and "NCCL_DEBUG=INFO" in stall.advice and "Xid" in stall.advice
    # one rank missing from the capture could be the one the others wait on: nothing is said about the call
    del stacks[9]
    assert not analyze_stacks(snapshot(stacks, 16, 2, L16)).verdict.summary.startswith("not a rank")


def test_missing_ranks_are_reported_with_reasons() -> None:
    stacks = {r: rank_stacks(r, OPTIMIZER) for r in range(16)}
    stacks[4] = unreadable(4, CaptureErrorKind.TIMEOUT)
    stacks[9] = rank_stacks(9, COMPUTE)
    snap = snapshot(stacks, 16, 2, L16, absent=(3,))
    analysis = analyze_stacks(snap)
    v = analysis.verdict
    assert v.missing_ranks == (3, 4)
    assert v.top is not None and v.top.ranks == (9,)
    assert any("2 rank(s) could not be seen: 3-4" in n and "timeout" in n and "no stacks" in n for n in v.notes)


def test_unreachable_machine_is_named_as_the_reason() -> None:
    stacks = {r: rank_stacks(r, OPTIMIZER) for r in range(8)}
    stacks[0] = rank_stacks(0, COMPUTE)
    snap = snapshot(stacks, 8, 2, Layout(tp=2, pp=2, dp=2, ranks_per_machine=2))
    dead = MachineSnapshot(machine="node3", address="127.0.0.1:7003", reachable=False, captured=None,
                           ranks=snap.machines[3].ranks)
    snap = JobSnapshot(captured=snap.captured, machines=(*snap.machines[:3], dead), layout=snap.layout)
    v = analyze_stacks(snap).verdict
    assert v.missing_ranks == (6, 7)
    assert any("machine node3 unreachable" in n for n in v.notes)


def test_no_layout_still_names_ranks_and_machines() -> None:
    stacks = {r: rank_stacks(r, OPTIMIZER) for r in range(8)}
    stacks[3] = rank_stacks(3, COMPUTE)
    analysis = analyze_stacks(snapshot(stacks, 8, 2))
    top = analysis.verdict.top
    assert top is not None and top.ranks == (3,) and top.machines == ("node1",)
    assert any("no parallel sizes known" in n for n in analysis.verdict.notes)


def test_json_shape() -> None:
    snap = load_pyspy_dir(FIG7, FIG7_LAYOUT)
    out = verdict_to_json(analyze_stacks(snap, FIG7_LAYOUT))
    json.dumps(out)  # plain JSON values only
    assert out["dominant"] == [0] and out["outliers"] == [1, 2, 3]
    groups = out["groups"]
    assert isinstance(groups, list) and groups[1]["ranks"] == [24, 25, 26, 27]
    suspects = out["suspects"]
    assert isinstance(suspects, list)
    first = suspects[0]
    assert set(first) >= {"kind", "ranks", "machines", "score", "evidence"}
    assert first["kind"] == "pp" and first["machines"] == ["machine-12", "machine-13", "machine-14", "machine-15"]


def test_merge_agreement_outranks_one_sure_detector() -> None:
    from rankscope.analyzers.findings import Suspect, Verdict
    from rankscope.analyzers.verdict import merge_verdicts

    pp = Suspect(SuspectKind.PP, (1, 5), ("m0", "m2"), 2.0, ("PP group 1",), ("stacks",), group_index=1)
    lone = Suspect(SuspectKind.RANK, (3,), ("m1",), 1.9, ("rank 3",), ("stacks",))
    stacks = Verdict((pp, lone), "PP group 1", missing_ranks=(7,), notes=("n1",))
    ccl = Verdict((Suspect(SuspectKind.RANK, (5,), ("m2",), 1.0, ("rank 5 lags",), ("ccl",)),),
                  "rank 5", missing_ranks=(6,))
    merged = merge_verdicts(stacks, ccl)
    first, second = merged.suspects
    # the PP group and CCL's rank 5 agree (equal scores: the larger group first, over-eviction), and rank 5
    # lies inside the group, so it is the group's evidence, not a second suspect; rank 3 has one detector only
    assert first.ranks == (1, 5)
    assert first.score == pytest.approx(2.0) and set(first.sources) == {"stacks", "ccl"}
    assert any(e.startswith("agreement: ccl") for e in first.evidence)
    assert "within it: rank 5 named by ccl" in first.evidence and "  rank 5 lags" in first.evidence
    assert second.ranks == (3,) and second.score == pytest.approx(0.95)
    assert merged.missing_ranks == (6, 7) and merged.notes == ("n1",)
    assert merged.summary == "PP group #1 (ranks 1,5) on m0, m2 (stacks + ccl)"
    assert merge_verdicts(stacks) is stacks
    assert merge_verdicts().suspects == ()


def test_merge_folds_the_same_suspect_from_two_detectors() -> None:
    from rankscope.analyzers.findings import Suspect, Verdict
    from rankscope.analyzers.verdict import merge_verdicts

    a = Verdict((Suspect(SuspectKind.RANK, (4,), ("m2",), 0.5, ("stuck in compute",), ("stacks",)),), "a")
    b = Verdict((Suspect(SuspectKind.RANK, (4,), ("m2",), 0.8, ("CL lags",), ("ccl",)),
                 Suspect(SuspectKind.RANK, (0,), ("m0",), 0.4, ("open request",), ("ccl",))), "b")
    merged = merge_verdicts(a, b)
    assert [s.ranks for s in merged.suspects] == [(4,), (0,)]
    top = merged.suspects[0]
    assert top.evidence[:2] == ("stuck in compute", "CL lags") and set(top.sources) == {"stacks", "ccl"}
    assert top.score == pytest.approx(2.0)


def test_ranks_the_counters_name_inside_the_hung_pp_group_are_its_evidence_not_separate_suspects() -> None:
    # The README drill's shape, seen by hand: the stacks name PP group 1 (ranks 2,3,6,7), the counters name
    # ranks 2 and 3 each (their CL lags), and a desync the counters saw on rank 3 stays its own claim.
    from rankscope.analyzers.findings import Suspect, Verdict
    from rankscope.analyzers.verdict import merge_verdicts

    group = Suspect(SuspectKind.PP, (2, 3, 6, 7), ("m1", "m3"), 5.0, ("PP group 1 stuck",), ("stacks",),
                    group_index=1, victims=(0, 1))
    stacks = Verdict((group,), "PP group 1")
    ccl = Verdict((Suspect(SuspectKind.RANK, (2,), ("m1",), 0.9, ("CL lags on rank 2",), ("ccl",), victims=(0, 4)),
                   Suspect(SuspectKind.RANK, (3,), ("m1",), 0.8, ("CL lags on rank 3",), ("ccl",)),
                   Suspect(SuspectKind.DESYNC, (3,), ("m1",), 0.1, ("rank 3 in another collective",), ("ccl",)),
                   Suspect(SuspectKind.RANK, (5,), ("m2",), 0.2, ("rank 5 slow",), ("ccl",))), "ccl")
    merged = merge_verdicts(stacks, ccl)
    assert (str(merged.suspects[0].kind), merged.suspects[0].ranks) == ("pp", (2, 3, 6, 7))
    assert sorted((str(s.kind), s.ranks) for s in merged.suspects[1:]) == [("desync", (3,)), ("rank", (5,))]
    top = merged.suspects[0]
    assert "within it: rank 2 named by ccl" in top.evidence and "within it: rank 3 named by ccl" in top.evidence
    assert top.victims == (0, 1)  # the chain's victims, as they were
    assert set(top.sources) == {"stacks", "ccl"}


def test_ranks_the_counters_name_that_only_wait_on_the_chains_root_are_its_victims_not_suspects() -> None:
    # The 16-drill scorecard's hang-compute shape: the chain finds rank 0 stuck in its own work with ranks 1-7
    # waiting on it; the counters also name rank 4 (in a recv rank 0 never sent) and ranks 1 and 5 (late in a
    # DP all_reduce because they wait on rank 0's TP all_reduce). One chain, one suspect.
    from rankscope.analyzers.findings import Suspect, Verdict
    from rankscope.analyzers.verdict import merge_verdicts

    root = Suspect(SuspectKind.RANK, (0,), ("machine-0",), 2.0, ("rank 0 computing",), ("stacks",),
                   victims=tuple(range(1, 8)), state="computing")
    pp = Suspect(SuspectKind.PP, (0, 1, 4, 5), ("machine-0", "machine-2"), 1.6, ("PP groups 0-1",), ("stacks",),
                 victims=(2, 3, 6, 7))
    stacks = Verdict((root, pp), "rank 0")
    ccl = Verdict((Suspect(SuspectKind.RANK, (0,), ("machine-0",), 1.0, ("rank 0: CL 82 < 83",), ("ccl",)),
                   Suspect(SuspectKind.RANK, (4,), ("machine-2",), 0.95, ("rank 4: recv open",), ("ccl",)),
                   Suspect(SuspectKind.RANK, (1,), ("machine-0",), 0.9, ("rank 1: CL 5 < 6",), ("ccl",))), "ccl")
    merged = merge_verdicts(stacks, ccl)
    assert [s.ranks for s in merged.suspects] == [(0,)]
    top = merged.suspects[0]
    assert top.victims == tuple(range(1, 8)) and top.state == "computing"
    assert "also named, folded in as its victims (they wait on it): ranks 1,4-5" in top.evidence
    assert "rank 0: CL 82 < 83" in top.evidence


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["pp", "dp", "rank", "desync"]),
                          st.frozensets(st.integers(0, 7), min_size=1, max_size=4),
                          st.floats(0.01, 5.0), st.integers(0, 2),
                          st.frozensets(st.integers(0, 9), max_size=3)), min_size=1, max_size=8))
def test_no_merged_suspect_lies_inside_or_among_the_victims_of_a_higher_ranked_one_of_the_same_remedy(
        raw: list[tuple[str, frozenset[int], float, int, frozenset[int]]]) -> None:
    from rankscope.analyzers.findings import Suspect, Verdict
    from rankscope.analyzers.verdict import merge_verdicts

    per: dict[int, list[Suspect]] = {0: [], 1: [], 2: []}
    for kind, ranks, score, d, victims in raw:
        per[d].append(Suspect(SuspectKind(kind), tuple(sorted(ranks)), ("m",), score, (f"{kind} {sorted(ranks)}",),
                              (f"d{d}",), victims=tuple(sorted(victims - ranks))))
    verdicts = [Verdict(tuple(v), "x") for v in per.values() if v]
    merged = merge_verdicts(*verdicts, Verdict((), "empty")).suspects
    for i, s in enumerate(merged):
        for k in merged[:i]:
            same_remedy = (str(s.kind) == "desync") == (str(k.kind) == "desync")
            assert not (same_remedy and set(s.ranks) <= set(k.ranks) | set(k.victims)), (s, k)
    # folding drops no rank: each named rank is still a suspect's, or a victim of one
    named = {r for _, ranks, _, _, _ in raw for r in ranks}
    assert named <= {r for s in merged for r in (*s.ranks, *s.victims)}


def test_recorded_communicators_decide_the_groups() -> None:
    import dataclasses

    from rankscope.contract.snapshot import Communicator, RankCounters

    # Sizes typed as tp=2, pp=2, dp=2 would pair ranks (0,4),(1,5),...; the job really built pipelines (r, 7-r).
    pipes = [Communicator(f"pp{r}", "gloo", "PIPELINE_MODEL_PARALLEL_GROUP", (r, 7 - r)) for r in range(4)]
    stacks = {r: rank_stacks(r, OPTIMIZER) for r in range(8)}
    stacks[1] = rank_stacks(1, SEND)
    stacks[6] = rank_stacks(6, RECV)
    snap = snapshot(stacks, 8, 2, Layout(tp=2, pp=2, dp=2, ranks_per_machine=2))
    machines = tuple(
        dataclasses.replace(m, counters=tuple(RankCounters(rank=r.rank, pid=r.pid, world_size=8, job_id="j",
                                                           heartbeat_wall=1.0, communicators=tuple(pipes))
                                              for r in m.ranks))
        for m in snap.machines)
    analysis = analyze_stacks(dataclasses.replace(snap, machines=machines))
    top = analysis.verdict.top
    assert top is not None and top.kind is SuspectKind.PP and top.ranks == (1, 6)
    assert top.machines == ("node0", "node3")
    assert analysis.topology.explicit[0][0] == "pp"


def test_analyze_snapshot_merges_stacks_and_ccl_counters() -> None:
    import dataclasses

    from rankscope.analyzers.analysis import analyze_snapshot
    from rankscope.contract.snapshot import Communicator, OpCounters, RankCounters

    # Rank 5 stalls on its way into the TP all-reduce: the stacks name TP group {4,5}; the counters agree
    # (rank 5's all_reduce CL lags while rank 4 waits with an open request).
    into_tp = [*COMPUTE[:-1], "tp_all_reduce layers.py"]
    stacks = {r: rank_stacks(r, OPTIMIZER) for r in range(8)}
    stacks[5] = rank_stacks(5, [*into_tp, "stall_here faults.py"])
    stacks[4] = rank_stacks(4, [*into_tp, "all_reduce distributed_c10d.py"])
    stacks[0] = rank_stacks(0, RECV)
    stacks[1] = rank_stacks(1, RECV)
    snap = snapshot(stacks, 8, 2, Layout(tp=2, pp=2, dp=2, ranks_per_machine=2))
    tp = Communicator("tp2", "gloo", "TENSOR_MODEL_PARALLEL_GROUP", (4, 5))
    counts = {4: OpCounters("tp2", "all_reduce", cl=4, wr=4, wc=3), 5: OpCounters("tp2", "all_reduce", cl=3, wr=3, wc=3)}
    machines = tuple(
        dataclasses.replace(m, counters=tuple(
            RankCounters(rank=r.rank, pid=r.pid, world_size=8, job_id="j", heartbeat_wall=1.0,
                         communicators=(tp,), ops=(counts[r.rank],)) for r in m.ranks if r.rank in counts))
        for m in snap.machines)
    verdict = analyze_snapshot(dataclasses.replace(snap, machines=machines))
    top = verdict.top
    assert top is not None and top.kind is SuspectKind.TP and top.ranks == (4, 5) and top.machines == ("node2",)
    assert set(top.sources) == {"stacks", "ccl"}
    assert "(stacks + ccl)" in verdict.summary
    # without counters the stacks speak alone
    alone = analyze_snapshot(snap)
    assert alone.top is not None and alone.top.ranks == (4, 5) and alone.top.sources == ("stacks",)
