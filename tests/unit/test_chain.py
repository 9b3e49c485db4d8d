"""The chain of waits (rankscope.analyzers.chain) and the verdict built on it.

Three public incidents are read from the files as published (../shared/external,
layouts from each SOURCE.md), and generated layouts check that the rules are
general: one rank that waits for nobody while the rest wait for it (directly or
through others) is the root, the rest are its victims, never suspects of their own.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rankscope.analyzers.analysis import analyze_snapshot, analyze_stacks
from rankscope.analyzers.chain import BACKWARD_SITE, RankState
from rankscope.analyzers.findings import SuspectKind
from rankscope.analyzers.topology import Topology
from rankscope.cli.main import main
from rankscope.contract.snapshot import (
    CaptureError,
    CaptureErrorKind,
    Layout,
    ProcessRole,
    ProcessStack,
    RankStacks,
)
from rankscope.formats.pyspy_dir import load_pyspy_dir
from repo_paths import external
from stack_fixtures import OPTIMIZER, SEND, TRAIN, rank_stacks, snapshot

EXTERNAL = external()
needs_external = pytest.mark.skipif(EXTERNAL is None, reason="public incident dumps (../shared/external) not here")

BLOOM = "bloom176b-eval-hang-2022-04-30"
BLOOM_LAYOUT = Layout(tp=4, pp=2, dp=2, order="tp-dp-pp", ranks_per_machine=8)  # SOURCE.md: Megatron order, 8/node
M4 = "m4-64gpu-rank0-unresponsive-2023-03-04"
M4_LAYOUT = Layout(dp=64, ranks_per_machine=8)
BIOM3 = "biom3-aurora-ddp-extra-batch-2026-04"
BIOM3_LAYOUT = Layout(dp=12, ranks_per_machine=12)


def _case(name: str, layout: Layout):  # type: ignore[no-untyped-def]
    assert EXTERNAL is not None
    snap = load_pyspy_dir(EXTERNAL / name, layout)
    return analyze_stacks(snap, layout)


# --------------------------------------------------------------------------
# public incidents, from the files as they are
# --------------------------------------------------------------------------


@needs_external
def test_bloom_root_is_the_rank_waiting_for_data_and_everyone_else_is_its_victim() -> None:
    # Rank 4 waits in its DataLoader; its TP peers 5-7 wait in a broadcast from it, the other DP replica's stage
    # and the next stage wait downstream. Three stack groups of 4 tie for largest: the chain decides.
    a = _case(BLOOM, BLOOM_LAYOUT)
    v = a.verdict
    assert a.chain is not None
    assert [r.rank for r in a.chain.roots] == [4]
    assert a.chain.views[4].state is RankState.LOADING
    assert a.chain.roots[0].victims == tuple(r for r in range(16) if r != 4)
    top = v.top
    assert top is not None and top.kind is SuspectKind.RANK and top.ranks == (4,)
    assert top.machines == ("machine-0",) and top.state == "loading data"
    assert top.victims == tuple(r for r in range(16) if r != 4)
    assert v.summary == "rank 4 on machine-0 (loading data; 15 ranks wait on it)"
    assert "separate" not in v.summary
    # the second machine only waits: it is evidence, never a suspect of its own
    assert all(4 in s.ranks for s in v.suspects), [(s.kind, s.ranks) for s in v.suspects]
    assert not any(set(s.ranks) <= set(range(8, 16)) for s in v.suspects)
    assert any("tie for largest" in n and "chain of waits decides" in n for n in v.notes)
    assert v.findings == ()
    # The one verdict every view draws (analyze_job): rank 4's TP and DP groups, which hold only it and its
    # victims, are its evidence, not suspects 2 and 3.
    from rankscope.analyzers.analysis import analyze_job

    assert EXTERNAL is not None
    job = analyze_job(load_pyspy_dir(EXTERNAL / BLOOM, BLOOM_LAYOUT), BLOOM_LAYOUT)
    assert [s.ranks for s in job.verdict.suspects] == [(4,)]
    assert job.verdict.summary == v.summary


@needs_external
def test_m4_unreadable_rank_others_wait_on_is_the_prime_suspect_with_pyspy_error() -> None:
    a = _case(M4, M4_LAYOUT)
    v = a.verdict
    top = v.top
    assert top is not None and top.kind is SuspectKind.RANK and top.ranks == (0,)
    assert top.machines == ("machine-0",)
    assert top.victims == tuple(range(1, 64))
    assert top.state == "unreadable: permission"
    text = "\n".join(top.evidence)
    assert "Failed to suspend process" in text and "EPERM" in text  # py-spy's own words
    assert "barrier <- wait_for_everyone (other.py:81)" in text
    assert v.summary == "rank 0 on machine-0 (unreadable: permission; 63 ranks wait on it)"
    assert len(v.suspects) == 1
    assert v.missing_ranks == (0,)


@needs_external
def test_biom3_extra_batch_is_one_desync_not_three_compute_faults() -> None:
    # Ranks 0, 7, 8 took one more batch: their MainThread sits in backward, where DDP's gradient all-reduce runs
    # from C++ hooks; the other 9 wait in Lightning's epoch-end all_reduce. Which side is "the root" is a
    # judgement: the 3 are named because they are the ranks whose program went elsewhere (the minority of the
    # group, at the call site the majority is not at); what must hold is one desync naming them, with advice.
    a = _case(BIOM3, BIOM3_LAYOUT)
    v = a.verdict
    assert len(v.suspects) == 1
    top = v.suspects[0]
    assert top.kind is SuspectKind.DESYNC and top.ranks == (0, 7, 8)
    assert top.victims == (1, 2, 3, 4, 5, 6, 9, 10, 11)
    assert any("evicting machines will not cure it" in e for e in top.evidence)
    assert v.summary == "desync: ranks 0,7-8 are in a different collective from the other 9 ranks of the job"
    (finding,) = v.findings
    assert finding.kind == "desync" and finding.ranks == (0, 7, 8) and finding.communicator == "the whole job"
    assert "program mismatch" in finding.advice
    assert any("all_reduce <- _sync_ddp (distributed.py:231)" in e for e in finding.evidence)
    assert any(BACKWARD_SITE in e for e in finding.evidence)


@needs_external
def test_cli_json_has_findings_and_per_rank_evidence(capsys: pytest.CaptureFixture[str]) -> None:
    assert EXTERNAL is not None
    assert main(["analyze", "--dumps", str(EXTERNAL / M4), "--dp", "64", "--ranks-per-machine", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["findings"] == []
    assert data["suspects"][0]["ranks"] == [0] and data["suspects"][0]["victims"] == list(range(1, 64))
    assert data["chain"]["roots"][0]["rank"] == 0 and data["chain"]["roots"][0]["state"] == "unreadable"
    evidence = {e["rank"]: e for e in data["rank_evidence"]}
    assert sorted(evidence) == list(range(64))
    assert evidence[0]["complete"] is False and evidence[0]["state"] == "unreadable"
    assert "EPERM" in evidence[0]["failed"][0]
    assert evidence[5]["state"] == "collective" and evidence[5]["read"] and evidence[5]["failed"] == []
    assert evidence[5]["truncated"]  # the source kept only the top 3 frames

    assert main(["analyze", "--dumps", str(EXTERNAL / BIOM3), "--dp", "12", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (finding,) = data["findings"]
    assert finding["kind"] == "desync" and finding["ranks"] == [0, 7, 8] and finding["communicator"]
    assert data["suspects"][0]["kind"] == "desync"

    assert main(["analyze", "--dumps", str(EXTERNAL / BIOM3), "--dp", "12"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("verdict: desync: ranks 0,7-8")
    assert "findings:\n  [desync] ranks 0,7-8 on the whole job" in text
    assert "advice: evicting machines will not cure it: a desync is usually a program mismatch" in text


# --------------------------------------------------------------------------
# rules on generated layouts
# --------------------------------------------------------------------------

ORDERS = ("tp-dp-pp", "tp-pp-dp", "dp-tp-pp", "pp-tp-dp")
FAULTS = ("compute", "dataloader", "unreadable", "stopped")
TP_SITE = [*TRAIN, "forward_backward schedules.py", "forward model.py", "tp_all_reduce layers.py",
           "all_reduce distributed_c10d.py"]
RECV_FWD = [*TRAIN, "forward_backward schedules.py", "recv_forward p2p.py", "irecv distributed_c10d.py"]
STUCK = {
    "compute": [*TRAIN, "forward_backward schedules.py", "forward model.py", "matmul_slow model.py"],
    "dataloader": [*TRAIN, "forward_backward schedules.py", "__next__ dataloader.py", "_next_data dataloader.py",
                   "get queue.py", "wait threading.py"],
}


def _faulty(rank: int, fault: str) -> RankStacks:
    if fault in STUCK:
        return rank_stacks(rank, STUCK[fault])
    state, kind = ("D", CaptureErrorKind.PERMISSION) if fault == "unreadable" else ("T", CaptureErrorKind.TIMEOUT)
    error = CaptureError(kind, "Error: Failed to suspend process", process_state=state, wchan="nv_wait")
    return RankStacks(rank=rank, main=ProcessStack(pid=1000 + rank, role=ProcessRole.MAIN, threads=None, error=error))


def _waiting_job(tp: int, pp: int, dp: int, order: str, f: int, fault: str) -> tuple[dict[int, RankStacks], Layout]:
    """Rank ``f`` waits for nobody; its TP peers wait in a TP all-reduce on it, the later stages of its data-parallel
    replica wait in recv for activations, every other rank waits in the optimizer's all-reduce."""
    layout = Layout(tp=tp, pp=pp, dp=dp, order=order, ranks_per_machine=tp)
    topo = Topology(layout=layout, world_size=tp * pp * dp)
    fc = topo.coords(f)
    stacks: dict[int, RankStacks] = {}
    for r in range(tp * pp * dp):
        c = topo.coords(r)
        if r == f:
            stacks[r] = _faulty(r, fault)
        elif c["dp"] == fc["dp"] and c["pp"] == fc["pp"]:
            stacks[r] = rank_stacks(r, TP_SITE)
        elif c["dp"] == fc["dp"] and c["pp"] > fc["pp"]:
            stacks[r] = rank_stacks(r, RECV_FWD)
        else:
            stacks[r] = rank_stacks(r, OPTIMIZER)
    return stacks, layout


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tp=st.sampled_from([1, 2, 4]), pp=st.sampled_from([1, 2, 3]), dp=st.sampled_from([1, 2, 3]),
       order=st.sampled_from(ORDERS), fault=st.sampled_from(FAULTS), data=st.data())
def test_the_rank_everyone_waits_on_is_the_root_and_the_rest_are_victims(
        tp: int, pp: int, dp: int, order: str, fault: str, data: st.DataObject) -> None:
    world = tp * pp * dp
    if world < 2:
        return
    f = data.draw(st.integers(0, world - 1), label="faulty rank")
    stacks, layout = _waiting_job(tp, pp, dp, order, f, fault)
    a = analyze_stacks(snapshot(stacks, world, tp, layout), layout)
    assert a.chain is not None
    assert [r.rank for r in a.chain.roots] == [f]
    assert a.chain.roots[0].victims == tuple(r for r in range(world) if r != f)
    assert a.chain.desyncs == () and a.chain.unexplained == ()
    v = a.verdict
    top = v.top
    assert top is not None and f in top.ranks
    assert set(top.victims) == set(range(world)) - {f}  # its group's members that wait on it too
    assert top.roots == (f,)
    # one chain, one suspect: nothing that only waits is named, and the headline names no second suspect
    assert all(f in s.ranks for s in v.suspects), [(s.kind, s.ranks) for s in v.suspects]
    assert "separate suspects" not in v.summary
    expected = {"compute": "computing", "dataloader": "loading data", "unreadable": "unreadable",
                "stopped": "stopped"}[fault]
    assert top.state.startswith(expected)
    if fault in ("unreadable", "stopped"):
        assert top.kind is SuspectKind.RANK and top.ranks == (f,)
        assert any("nv_wait" in e and "Failed to suspend process" in e for e in top.evidence)
    # the merged verdict (the drill's scorer reads it) keeps the victims
    merged = analyze_snapshot(snapshot(stacks, world, tp, layout), layout)
    assert merged.top is not None and merged.top.victims == top.victims


BACKWARD = [*TRAIN, "backward _tensor.py", "backward __init__.py", "_engine_run_backward graph.py"]


def _sync_at(line: int) -> list[str]:
    return [*TRAIN, f"_sync_ddp distributed.py:{line}", "all_reduce distributed_c10d.py"]


def _stacks_with_lines(rank: int, spec: list[str]) -> RankStacks:
    """Like rank_stacks, with ``file.py:LINE`` read as a line number."""
    rs = rank_stacks(rank, [s.split(":")[0] for s in spec])
    lines = [int(s.split(":")[1]) if ":" in s else None for s in spec]
    main = rs.main.threads[0]  # type: ignore[index]
    frames = tuple(f if ln is None else type(f)(name=f.name, filename=f.filename, line=ln)
                   for f, ln in zip(main.frames, reversed(lines), strict=True))
    from dataclasses import replace
    return replace(rs, main=replace(rs.main, threads=(replace(main, frames=frames),)))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(3, 24), data=st.data(), odd_in_backward=st.booleans())
def test_ranks_in_another_collective_of_their_group_are_one_desync(
        n: int, data: st.DataObject, odd_in_backward: bool) -> None:
    odd = data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=(n - 1) // 2), label="odd ranks")
    # The odd ranks either sit in backward (DDP's hidden gradient all-reduce) or call the same all_reduce from
    # another line of the same function: the signature drops lines, the call site keeps them.
    stacks = {r: _stacks_with_lines(r, (BACKWARD if odd_in_backward else _sync_at(240)) if r in odd
                                    else _sync_at(231)) for r in range(n)}
    layout = Layout(dp=n, ranks_per_machine=n)
    v = analyze_stacks(snapshot(stacks, n, n, layout), layout).verdict
    assert len(v.suspects) == 1, [(s.kind, s.ranks) for s in v.suspects]
    top = v.suspects[0]
    assert top.kind is SuspectKind.DESYNC and top.ranks == tuple(sorted(odd))
    assert set(top.victims) == set(range(n)) - odd
    (finding,) = v.findings
    assert finding.kind == "desync" and finding.ranks == tuple(sorted(odd)) and "will not cure" in finding.advice
    assert any("distributed.py:231" in e for e in finding.evidence)


def test_a_tie_between_two_call_sites_is_said_and_the_rule_is_stated() -> None:
    # 4 ranks at each of two call sites: no majority; the rule names the side not in backward as the majority
    # and says that either side may be the one that strayed.
    stacks = {r: _stacks_with_lines(r, BACKWARD if r % 2 else _sync_at(231)) for r in range(8)}
    layout = Layout(dp=8, ranks_per_machine=8)
    v = analyze_stacks(snapshot(stacks, 8, 8, layout), layout).verdict
    top = v.top
    assert top is not None and top.kind is SuspectKind.DESYNC and top.ranks == (1, 3, 5, 7)
    assert any("tie at 4 ranks" in e and "either side may be the one that strayed" in e for e in top.evidence)


def test_a_file_missing_from_a_dump_folder_is_not_a_root() -> None:
    # no stacks at all for rank 3 (nobody tried to read it): unknown, not absence-as-evidence
    stacks = {r: rank_stacks(r, OPTIMIZER) for r in range(8)}
    del stacks[3]
    layout = Layout(dp=8, ranks_per_machine=2)
    a = analyze_stacks(snapshot(stacks, 8, 2, layout), layout)
    assert a.chain is not None and a.chain.roots == ()
    assert a.chain.views[3].state is RankState.UNKNOWN
    assert a.verdict.suspects == ()


def test_waiters_in_a_cycle_with_no_root_leave_the_layout_score_to_decide() -> None:
    # every rank waits (Fig. 7's shape): no root, no desync; the existing layout scoring speaks
    stacks = {r: rank_stacks(r, OPTIMIZER) for r in range(16)}
    stacks[13] = rank_stacks(13, RECV_FWD)
    layout = Layout(tp=2, pp=2, dp=4, ranks_per_machine=2)
    a = analyze_stacks(snapshot(stacks, 16, 2, layout), layout)
    assert a.chain is not None and a.chain.roots == () and a.chain.desyncs == ()
    assert 13 in a.chain.unexplained
    top = a.verdict.top
    assert top is not None and 13 in top.ranks and top.victims == ()


# --------------------------------------------------------------------------
# what the TUI's verdict panel shows
# --------------------------------------------------------------------------


def _panel(stacks: dict[int, RankStacks], world: int, rpm: int, layout: Layout) -> str:
    from rankscope.tui.analysis import build_stack_view, verdict_text
    from rankscope.tui.filter import Filter
    from rankscope.tui.widgets.verdict import verdict_text_rich

    view = build_stack_view(snapshot(stacks, world, rpm, layout), layout)
    return verdict_text_rich(view, Filter("", frozenset()), max_suspects=3).plain + "\n---\n" + verdict_text(view)


def test_panel_shows_the_unreadable_root_its_state_and_its_victims() -> None:
    stacks, layout = _waiting_job(2, 2, 2, "tp-dp-pp", 3, "unreadable")
    text = _panel(stacks, 8, 2, layout)
    assert text.startswith("verdict: rank 3 on node1 (unreadable: permission, process state D in nv_wait; "
                           "7 ranks wait on it)")
    assert "▸ RANK  machines node1  ranks 3  [unreadable: permission, process state D in nv_wait]" in text
    assert "root: " in text and "7 ranks wait on it (victims, not suspects): 0-2,4-7" in text
    assert "no stack: ranks 3 — unreadable: permission, process state D in nv_wait" in text
    assert "victims (wait on it, not suspects): ranks 0-2,4-7" in text  # y copies them too


def test_a_failing_analysis_still_shows_the_stacks_grouped_by_path(monkeypatch: pytest.MonkeyPatch) -> None:
    import rankscope.tui.analysis as tui_analysis

    def broken(*_args: object, **_kw: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(tui_analysis, "analyze_job", broken)
    stacks, layout = _waiting_job(2, 2, 2, "tp-dp-pp", 3, "unreadable")
    view = tui_analysis.build_stack_view(snapshot(stacks, 8, 2, layout), layout)
    assert view.notes == ("stack analyzer failed (RuntimeError: boom); groups by main-thread path",)
    assert view.verdict.summary == "no verdict (analyzer unavailable)" and not view.verdict.suspects
    assert sorted(r for g in view.groups for r in g.ranks) == [0, 1, 2, 4, 5, 6, 7]  # rank 3 has no stack
    assert view.missing_ranks == (3,) and view.tree.ranks == (0, 1, 2, 4, 5, 6, 7)


def test_panel_shows_a_desync_with_its_call_sites_and_the_advice() -> None:
    stacks = {r: _stacks_with_lines(r, BACKWARD if r in (2, 5) else _sync_at(231)) for r in range(8)}
    text = _panel(stacks, 8, 8, Layout(dp=8, ranks_per_machine=8))
    assert text.startswith("verdict: desync: ranks 2,5 are in a different collective from the other 6 ranks")
    assert "▸ DESYNC  machines node0  ranks 2,5" in text
    assert "6 rank(s) 0-1,3-4,6-7 at all_reduce <- _sync_ddp (distributed.py:231)" in text
    assert "evicting machines will not cure it: a desync is usually a program mismatch" in text
    assert "findings:\n  [desync] ranks 2,5 on the whole job" in text  # y copies it as `analyze` prints it


def test_a_rank_with_a_stuck_worker_is_a_root_of_its_own_beside_a_computing_one() -> None:
    from stack_fixtures import COMPUTE, WORKER_IDLE, WORKER_STUCK

    # rank 6's main thread waits with everyone, but its DataLoader worker is stuck in its own work; rank 2
    # computes. Two roots, two suspects: the worker's rank is not swallowed as a victim of rank 2.
    stacks = {r: rank_stacks(r, OPTIMIZER, workers=[WORKER_IDLE]) for r in range(16)}
    stacks[6] = rank_stacks(6, OPTIMIZER, workers=[WORKER_STUCK])
    stacks[2] = rank_stacks(2, COMPUTE, workers=[WORKER_IDLE])
    layout = Layout(tp=2, pp=2, dp=4, ranks_per_machine=2)
    a = analyze_stacks(snapshot(stacks, 16, 2, layout), layout)
    assert a.chain is not None and sorted(r.rank for r in a.chain.roots) == [2, 6]
    assert a.chain.views[6].state is RankState.LOADING and "read_shard" in a.chain.views[6].frame
    assert {s.ranks for s in a.verdict.suspects[:2]} == {(2,), (6,)}
    assert a.verdict.summary.startswith("2 separate suspects")


def test_a_side_process_makes_its_rank_loading_or_computing_by_its_typed_role() -> None:
    from rankscope.analyzers.origins import origins_of
    from rankscope.analyzers.stacks import group_stacks
    from stack_fixtures import WORKER_IDLE, process

    # Rank 6's checkpoint writer is stuck in its own work: computing, not loading. Rank 9's DataLoader worker
    # waits in its main thread while a thread of it reads a shard: loading, from the worker's role, whatever
    # the lane's label says. The rest wait with everyone.
    writer = ["writer_loop ckpt.py", "torch_save serialization.py", "write shard_io.py"]
    reader = ["_bootstrap threading.py", "prefetch prefetch.py", "read_shard dataset.py"]
    stacks = {r: rank_stacks(r, OPTIMIZER, workers=[WORKER_IDLE]) for r in range(16)}
    stacks[6] = RankStacks(rank=6, main=stacks[6].main,
                           subprocesses=(process(60_001, writer, ProcessRole.CHECKPOINT),))
    stacks[9] = RankStacks(rank=9, main=stacks[9].main,
                           subprocesses=(process(90_001, WORKER_IDLE, ProcessRole.DATALOADER, threads=[reader]),))
    layout = Layout(tp=2, pp=2, dp=4, ranks_per_machine=2)
    lanes = {o.ranks: o.lane for o in origins_of(group_stacks(stacks))}
    assert (lanes[(6,)].role, lanes[(6,)].side_thread) == (ProcessRole.CHECKPOINT, False)
    assert (lanes[(9,)].role, lanes[(9,)].side_thread) == (ProcessRole.DATALOADER, True)
    a = analyze_stacks(snapshot(stacks, 16, 2, layout), layout)
    assert a.chain is not None and sorted(r.rank for r in a.chain.roots) == [6, 9]
    assert a.chain.views[6].state is RankState.COMPUTING
    assert a.chain.views[6].frame == "[checkpoint] write (shard_io.py)"
    assert a.chain.views[9].state is RankState.LOADING
    assert a.chain.views[9].frame == "[dataloader/thread] read_shard (dataset.py)"


BARRIER_AFTER_LOOP = [*TRAIN[:2], "barrier distributed_c10d.py"]


def test_a_lone_rank_in_send_beside_a_barrier_is_not_a_desync() -> None:
    # One rank (its TP peer at the barrier) cannot be a group that ran ahead together: the layout decides.
    layout = Layout(tp=2, pp=2, dp=2, ranks_per_machine=2)
    stacks = {r: rank_stacks(r, SEND if r == 2 else BARRIER_AFTER_LOOP) for r in range(8)}
    a = analyze_stacks(snapshot(stacks, 8, 2, layout), layout)
    assert a.chain is not None and a.chain.desyncs == ()
