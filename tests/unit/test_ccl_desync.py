"""Desync told by the counters (rankscope.analyzers.ccl_desync) and how the verdict carries it.

Hand-built snapshots with real contract types: stacks in the shapes the drill
and the stack tests use, counters as the CCL plugin writes them. Ranks a step
ahead that block in their pipeline send look, from the stacks alone, like a
pipeline wait; the counters show that they never launched the collective the
others wait in while those others never posted the recv they wait on.
"""

from __future__ import annotations

import pytest
from ccl_fixtures import BARRIER, DP8, L8, TP8, Counters, drill_desync, pipeline, steady, with_counters
from hypothesis import given, settings
from hypothesis import strategies as st
from rankscope.analyzers.analysis import analyze_snapshot, analyze_stacks
from rankscope.analyzers.ccl import analyze_counters, counter_findings
from rankscope.analyzers.ccl_desync import OpTable, _graph, counter_waits, crossed_waits, live_counters, op_table
from rankscope.analyzers.findings import NOT_A_RANK, SuspectKind
from rankscope.contract.snapshot import Communicator, Layout, OpCounters, RankCounters
from rankscope.drill.scoring import score_verdict
from stack_fixtures import COMPUTE, OPTIMIZER, RECV, rank_stacks, snapshot


@pytest.mark.parametrize("ahead", [(2, 3), (6, 7)])
def test_counters_tell_a_desync_the_stacks_read_as_a_pipeline_wait(ahead: tuple[int, int]) -> None:
    stacks, c = drill_desync(ahead)
    snap = snapshot(stacks, 8, 2, L8)
    # the stacks alone: a pipeline wait (a group to evict), not a desync
    blind = analyze_stacks(snap, L8).verdict
    assert blind.top is not None and blind.top.kind is not SuspectKind.DESYNC and blind.findings == ()

    v = analyze_snapshot(with_counters(snap, c.files()), L8)
    others = tuple(r for r in range(8) if r not in ahead)
    assert [(s.kind, s.ranks) for s in v.suspects] == [(SuspectKind.DESYNC, ahead)]  # one suspect, not a pair each
    top = v.suspects[0]
    assert top.victims == others and set(top.sources) == {"stacks", "ccl"}
    assert any("never launched" in e or "never did (CL 0 < 1)" in e for e in top.evidence)
    assert any("never posted the matching" in e for e in top.evidence)
    (finding,) = v.findings
    assert finding.kind == "desync" and finding.ranks == ahead and "will not cure" in finding.advice
    assert finding.communicator == "comm 0 (default_pg)"
    truth = {"fault": "desync", "suspect_kind": "desync", "rank": ahead[0], "machine": f"node{ahead[0] // 2}",
             "suspect_ranks": list(ahead), "suspect_machines": [f"node{ahead[0] // 2}"]}
    assert score_verdict(v, truth)["correct"]

    # the counters alone (a flight recorder's dumps read the same way): one desync, not "computation side"
    ccl = analyze_counters(with_counters(snap, c.files()))
    assert [(s.kind, s.ranks) for s in ccl.suspects] == [(SuspectKind.DESYNC, ahead)]
    assert ccl.suspects[0].victims == others
    assert [(f.kind, f.ranks) for f in ccl.findings] == [("desync", ahead)]


def test_the_chain_names_the_desync_with_its_victims_and_both_call_sites() -> None:
    stacks, c = drill_desync((2, 3))
    a = analyze_stacks(with_counters(snapshot(stacks, 8, 2, L8), c.files()), L8)
    assert a.chain is not None and a.chain.roots == ()
    (d,) = a.chain.desyncs
    assert d.ranks == (2, 3) and d.victims == (0, 1, 4, 5, 6, 7) and d.group_kind == "world"
    assert [(site.split(" <- ")[0], ranks) for site, ranks in d.sites] == [
        ("barrier", (0, 1, 4, 5, 6, 7)), ("isend", (2, 3))]
    assert a.chain.unexplained == ()


def test_a_lag_the_counters_show_but_nobody_waits_in_is_not_a_desync() -> None:
    # the barrier finished for the others (WC = WR): nobody waits, the counters only show a skew
    stacks, c = drill_desync((2, 3), world_barrier=False)
    v = analyze_snapshot(with_counters(snapshot(stacks, 8, 2, L8), c.files()), L8)
    assert all(s.kind is not SuspectKind.DESYNC for s in v.suspects) and v.findings == ()


L16 = Layout(tp=2, pp=2, dp=4, ranks_per_machine=2)


def test_a_whole_dp_group_in_recv_with_agreeing_counters_is_not_a_desync() -> None:
    # test_suspects' whole-DP-group shape: one DP group waits in recv, the rest in the optimizer's all-reduce on
    # their own (complete) DP groups. The counters agree everywhere: no lag, so no desync; the layout decides.
    dp_group = (1, 3, 5, 7)
    stacks = {r: rank_stacks(r, RECV if r in dp_group else OPTIMIZER) for r in range(16)}
    c = Counters(16)
    for i, g in enumerate([(t + 8 * p, t + 8 * p + 2, t + 8 * p + 4, t + 8 * p + 6) for p in (0, 1) for t in (0, 1)]):
        cid = c.comm(f"dp{i}", "DATA_PARALLEL_GROUP", g)
        for r in g:
            c.op(r, cid, "all_reduce", 7, 6 if r not in dp_group else 7)
    for i in range(8):
        cid = c.comm(f"pp{i}", "PIPELINE_MODEL_PARALLEL_GROUP", (i, i + 8))
        c.op(i, cid, "recv", 12 if i in dp_group else 11, 11, [i + 8] if i in dp_group else [])
        c.op(i + 8, cid, "send", 11)
    v = analyze_snapshot(with_counters(snapshot(stacks, 16, 2, L16), c.files()), L16)
    assert all(s.kind is not SuspectKind.DESYNC for s in v.suspects)
    # (each other DP group's members all launched all-reduce 7 and none finished it: by the counters, a symmetric
    # stall of that group, which rankscope.analyzers.not_a_rank reports; never a desync)
    assert {f.kind for f in v.findings} <= {NOT_A_RANK}
    assert crossed_waits(c.files()) == ()
    stack_top = analyze_stacks(snapshot(stacks, 16, 2, L16)).verdict.top
    assert stack_top is not None and stack_top.kind is SuspectKind.DP and stack_top.ranks == dp_group


def test_a_laggard_waiting_on_a_rank_stuck_in_its_own_work_is_not_a_desync() -> None:
    # hang-p2p's shape: rank 3 stops before its send; rank 7 waits in recv from it, so rank 7 never launched the
    # DP all-reduce rank 5 waits in. Rank 7 is blocked, but its wait ends at rank 3, which waits for nobody.
    stacks = {r: rank_stacks(r, OPTIMIZER) for r in range(8)}
    stacks[3] = rank_stacks(3, COMPUTE)
    stacks[7] = rank_stacks(7, RECV)
    c = Counters(8)
    steady(c, TP8, "TENSOR_MODEL_PARALLEL_GROUP", "tp", 80)
    for i, g in enumerate(DP8):
        cid = c.comm(f"dp{i}", "DATA_PARALLEL_GROUP", g)
        for r in g:
            c.op(r, cid, "all_reduce", 5 if r in (3, 7) else 6, 5)
    pipeline(c, recvs={7: 3})
    files = c.files()
    assert crossed_waits(files) == ()
    v = analyze_snapshot(with_counters(snapshot(stacks, 8, 2, L8), files), L8)
    assert v.findings == () and all(s.kind is not SuspectKind.DESYNC for s in v.suspects)
    assert v.top is not None and 3 in v.top.ranks


def test_a_collective_stuck_on_the_wire_is_not_a_desync() -> None:
    # TP pair (2,3) both launched their all-reduce and it never completed (a link fault): their DP peers wait in
    # the DP all-reduce the pair never launched. The pair waits on nobody who is behind: communication side.
    c = Counters(8)
    for i, g in enumerate(TP8):
        cid = c.comm(f"tp{i}", "TENSOR_MODEL_PARALLEL_GROUP", g)
        for r in g:
            c.op(r, cid, "all_reduce", 81 if g == (2, 3) else 80, 80)
    for i, g in enumerate(DP8):
        cid = c.comm(f"dp{i}", "DATA_PARALLEL_GROUP", g)
        for r in g:
            c.op(r, cid, "all_reduce", 5 if r in (2, 3) else 6, 5)
    assert crossed_waits(c.files()) == ()


def test_one_rank_at_an_extra_collective_is_one_desync_told_once() -> None:
    # rank 0 launched one more all-reduce than the others, who wait in the barrier it never launched: two lags
    # (one per op), each side waiting for the other; the smaller side is named once.
    c = Counters(8)
    world = c.comm("0", "default_pg", range(8))
    for r in range(8):
        c.op(r, world, "all_reduce", 6 if r == 0 else 5, 5)
        if r:
            c.op(r, world, "barrier", 1, 0)
    (cw,) = crossed_waits(c.files())
    assert cw.ranks == (0,) and cw.victims == tuple(range(1, 8)) and not cw.tie
    stacks = {r: rank_stacks(r, OPTIMIZER if r == 0 else BARRIER) for r in range(8)}
    v = analyze_snapshot(with_counters(snapshot(stacks, 8, 2, L8), c.files()), L8)
    assert [(s.kind, s.ranks) for s in v.suspects] == [(SuspectKind.DESYNC, (0,))]
    assert [(f.kind, f.ranks) for f in v.findings] == [("desync", (0,))]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 24), data=st.data())
def test_ranks_blocked_in_sends_to_ranks_waiting_for_them_are_the_desync(n: int, data: st.DataObject) -> None:
    # one communicator; the ranks "ahead" never launched the barrier the others wait in and each blocks in a send
    # to one of them: the smaller side is named (the ranks ahead on a tie), the other side is its victims
    ahead = data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n - 1), label="ahead")
    behind = sorted(set(range(n)) - ahead)
    c = Counters(n)
    world = c.comm("0", "world", range(n))
    p2p = c.comm("1", "p2p", range(n))
    for r in range(n):
        if r in ahead:
            peer = data.draw(st.sampled_from(behind), label=f"peer of {r}")
            c.op(r, p2p, "send", 4, 3, [peer])
        else:
            c.op(r, world, "barrier", 1, 0)
    (cw,) = crossed_waits(c.files())
    named = ahead if len(ahead) <= len(behind) else set(behind)
    assert set(cw.ranks) == named and set(cw.victims) == set(range(n)) - named
    assert cw.tie == (len(ahead) == len(behind))
    # one rank ahead whose send completed waits for nobody: stuck in its own work, no desync
    lone = min(ahead)
    c.ops[lone] = [OpCounters(p2p, "send", 4, 4, 4)]
    assert crossed_waits(c.files()) == ()


_op = st.builds(OpCounters, comm_id=st.sampled_from(["0", "1", "2"]),
                op=st.sampled_from(["all_reduce", "barrier", "send", "recv", "broadcast"]),
                cl=st.integers(0, 5), wr=st.integers(0, 5), wc=st.integers(0, 5),
                open_peers=st.lists(st.integers(-2, 9), max_size=3).map(tuple))
_comm = st.builds(Communicator, comm_id=st.sampled_from(["0", "1", "2"]), backend=st.just("nccl"),
                  description=st.text(max_size=5), ranks=st.lists(st.integers(-1, 9), max_size=8).map(tuple))


@settings(max_examples=150, deadline=None)
@given(files=st.dictionaries(st.integers(0, 7), st.tuples(st.lists(_comm, max_size=3), st.lists(_op, max_size=6)),
                             max_size=8))
def test_any_counters_give_disjoint_sides_and_never_raise(files: dict[int, tuple[list[Communicator],
                                                                                list[OpCounters]]]) -> None:
    # counter files come from outside (the plugin, a flight recorder): odd values must not break the rule
    counters = {r: RankCounters(rank=r, pid=None, world_size=8, job_id=None, heartbeat_wall=None,
                                communicators=tuple(cs), ops=tuple(ops)) for r, (cs, ops) in files.items()}
    for cw in crossed_waits(counters):
        assert cw.ranks and not set(cw.ranks) & set(cw.victims)
        assert set(cw.ranks) | set(cw.victims) <= set(counters)
    analyze_counters(with_counters(snapshot({}, 8, 8), counters))  # the CCL detector around it takes them too


@settings(max_examples=100, deadline=None)
@given(files=st.dictionaries(st.integers(0, 7), st.tuples(st.lists(_comm, max_size=3), st.lists(_op, max_size=6)),
                             max_size=8),
       extra=st.dictionaries(st.integers(0, 7), st.dictionaries(st.integers(0, 7), st.just("stack wait"), max_size=2),
                             max_size=4))
def test_one_wait_graph_shared_by_the_chain_and_the_cl_rule_answers_as_fresh_ones_do(
        files: dict[int, tuple[list[Communicator], list[OpCounters]]], extra: dict[int, dict[int, str]]) -> None:
    # analyze_job builds the counters' graph once; the chain adds the stacks' waits to a copy, never to the shared one
    counters = {r: RankCounters(rank=r, pid=None, world_size=8, job_id=None, heartbeat_wall=None,
                                communicators=tuple(cs), ops=tuple(ops)) for r, (cs, ops) in files.items()}
    shared = counter_waits(counters)
    assert crossed_waits(counters, extra, shared) == crossed_waits(counters, extra)
    assert crossed_waits(counters, waits=shared) == crossed_waits(counters)


@settings(max_examples=150, deadline=None)
@given(files=st.dictionaries(st.integers(0, 7), st.tuples(st.lists(_comm, max_size=3), st.lists(_op, max_size=6)),
                             max_size=8))
def test_reading_only_ops_with_a_request_open_finds_what_reading_every_op_finds(
        files: dict[int, tuple[list[Communicator], list[OpCounters]]]) -> None:
    # both rules skip (communicator, op) pairs where no rank has WC < WR: the same waits, lags and suspects as
    # when every pair is read, and the pairs kept are exactly those with a request open
    counters = {r: RankCounters(rank=r, pid=None, world_size=8, job_id=None, heartbeat_wall=None,
                                communicators=tuple(cs), ops=tuple(ops)) for r, (cs, ops) in files.items()}
    live = live_counters(counters)
    table = op_table(live)
    assert table.open_ops == {(o.comm_id, o.op) for rc in live.values() for o in rc.ops if o.wc < o.wr}
    every = OpTable(table.comms, table.ops, frozenset((c, op) for c, by_op in table.ops.items() for op in by_op))
    (g, lags), (g_all, lags_all) = _graph(live, table), _graph(live, every)
    assert (g.out, g.why, lags) == (g_all.out, g_all.why, lags_all)
    assert counter_findings(live, {}, (), table) == counter_findings(live, {}, (), every)


def test_a_launch_skew_with_nothing_open_is_no_suspect() -> None:
    # rank 1 launched one all-reduce fewer, but nobody waits in it (all requests done): a poll between steps
    c = Counters(4)
    world = c.comm("0", "world", range(4))
    for r in range(4):
        c.op(r, world, "all_reduce", 4 if r == 1 else 5)
    assert op_table(c.files()).open_ops == frozenset()
    assert counter_findings(c.files()) == ()
    c.op(0, c.comm("1", "dp", (0, 1)), "all_reduce", 3, 2)  # one open request: its pair, and only it, is read
    assert op_table(c.files()).open_ops == {("1", "all_reduce")}


def test_the_stacks_send_waits_added_for_the_chain_do_not_reach_the_counters_verdict() -> None:
    # rank 0 waits in a barrier nobody else launched; ranks 1-7 are idle by the counters. A stack-side wait of
    # rank 1 on rank 0 makes rank 0's lag a crossed wait for the chain only.
    c = Counters(8)
    world = c.comm("0", "world", range(8))
    c.op(0, world, "barrier", 1, 0)
    for r in range(1, 8):
        c.op(r, world, "barrier", 0, 0)
    shared = counter_waits(c.files())
    assert crossed_waits(c.files(), waits=shared) == ()
    assert crossed_waits(c.files(), {r: {0: "stack wait"} for r in range(1, 8)}, shared) != ()
    assert crossed_waits(c.files(), waits=shared) == ()


def _pair_job(peer_recvs: int) -> dict[int, RankCounters]:
    """Rank 0 waits in its 4th all_reduce; rank 1 (CL 3) holds step 0's exchange with rank 0 open, on a pair group.

    Rank 0 posted ``peer_recvs`` recvs from rank 1 (and completed them all); rank 1 issued 3 sends to rank 0.
    """
    world = Communicator("0", "gloo", "default_pg", (0, 1))
    pp = Communicator("1", "gloo", "PIPELINE_MODEL_PARALLEL_GROUP", (0, 1))
    r0 = RankCounters(0, 100, 2, "j", 1.0, (world, pp), (
        OpCounters("0", "all_reduce", 4, 4, 3),
        OpCounters("1", "send", 3, 3, 3), OpCounters("1", "recv", peer_recvs, peer_recvs, peer_recvs)))
    r1 = RankCounters(1, 101, 2, "j", 1.0, (world, pp), (
        OpCounters("0", "all_reduce", 3, 3, 3),
        OpCounters("1", "send", 3, 3, 2, open_peers=(0,)), OpCounters("1", "recv", 3, 3, 2, open_peers=(0,))))
    return {0: r0, 1: r1}


def test_an_exchange_its_peer_completed_is_no_wait_on_a_pair_group() -> None:
    # rank 1 stuck in its own work with the GIL held: its last exchange's requests are done (rank 0 received
    # them) but not yet settled by the shim's background poll; that is no wait, so no desync
    done = _pair_job(peer_recvs=3)
    assert crossed_waits(done) == ()
    g, _ = _graph(live_counters(done), op_table(live_counters(done)))
    assert 1 not in g.out
    # the same rank 1 when rank 0 never posted its third recv: rank 1 really waits on rank 0 -> a desync
    skipped = _pair_job(peer_recvs=2)
    (c,) = crossed_waits(skipped)
    assert c.lagging == (1,) and c.waiting == (0,)
    assert any("never posted the matching recv" in line for line in c.evidence)
