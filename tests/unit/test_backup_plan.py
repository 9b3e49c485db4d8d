"""Over-eviction-aware checkpoint backup pairs (ByteRobust §6.3, Fig. 9) and `rankscope backup-plan`."""

from __future__ import annotations

import itertools
import json

import pytest
from rankscope.analyzers.backup_plan import backup_plan, parse_order
from rankscope.cli.main import main
from rankscope.contract.errors import RankscopeError
from rankscope.contract.snapshot import Layout


def _megatron_coords(rank: int, tp: int, dp: int) -> tuple[int, int, int]:
    """(tp, dp, pp) for order tp-dp-pp, written out independently of the module under test."""
    return rank % tp, (rank // tp) % dp, rank // (tp * dp)


def test_fig9_pairs_are_on_other_machines_outside_every_group_and_8_9_back_up_with_2_3() -> None:
    plan = backup_plan(Layout(tp=2, pp=4, dp=2), ranks_per_machine=2)
    assert len(plan.pairs) == 16
    for pair in plan.pairs:
        r, p = pair.rank, pair.peer
        assert r // 2 != p // 2, f"rank {r} and its peer {p} are on the same machine"
        rt, rd, rp = _megatron_coords(r, 2, 2)
        pt, pd, pp = _megatron_coords(p, 2, 2)
        assert (rd, rp) != (pd, pp), f"{r} and {p} share a TP group"
        assert (rt, rp) != (pt, pp), f"{r} and {p} share a DP group"
        assert (rt, rd) != (pt, pd), f"{r} and {p} share a PP group"
    peers = {p.rank: p.peer for p in plan.pairs}
    assert {peers[8], peers[9]} == {2, 3}
    assert {peers[2], peers[3]} == {8, 9}
    assert (peers[8], peers[9]) == (2, 3)  # same TP index: the exchanged shards have the same shape
    assert plan.safe and plan.rule == "mirror"


def _groups(tp: int, pp: int, dp: int, cp: int, ep: int, order: str) -> list[set[int]]:
    """Every parallel group, by brute force over coordinates."""
    dims = parse_order(order)
    sizes = {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "ep": ep}
    world = tp * pp * dp * cp * ep
    coords = {}
    for r in range(world):
        rest, c = r, {}
        for d in dims:
            c[d] = rest % sizes[d]
            rest //= sizes[d]
        coords[r] = c
    out: list[set[int]] = []
    for kind in dims:
        if sizes[kind] == 1:
            continue
        by_key: dict[tuple[int, ...], set[int]] = {}
        for r, c in coords.items():
            by_key.setdefault(tuple(v for d, v in c.items() if d != kind), set()).add(r)
        out.extend(by_key.values())
    return out


@pytest.mark.parametrize(("tp", "pp", "dp", "cp", "ep", "order", "rpm"), [
    (2, 4, 2, 1, 1, "tp-cp-ep-dp-pp", 2),
    (2, 4, 4, 1, 1, "tp-pp-dp", 2),       # Fig. 7's layout
    (2, 4, 4, 1, 1, "tp-cp-ep-dp-pp", 4),
    (4, 2, 4, 1, 1, "tp-cp-ep-dp-pp", 4),
    (2, 2, 2, 2, 1, "tp-cp-ep-dp-pp", 2),
    (1, 4, 6, 1, 1, "tp-cp-ep-dp-pp", 2),
    (2, 3, 3, 1, 1, "tp-cp-ep-dp-pp", 2),  # odd sizes: a permutation, not an exchange
    (2, 1, 4, 1, 2, "tp-cp-ep-dp-pp", 2),  # EP joins the shift when PP is 1
])
def test_safe_plans_never_lose_both_copies_to_one_over_eviction(
        tp: int, pp: int, dp: int, cp: int, ep: int, order: str, rpm: int) -> None:
    plan = backup_plan(Layout(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, order=order), ranks_per_machine=rpm)
    assert plan.safe, plan.notes
    assert [p.rank for p in plan.pairs] == list(range(tp * pp * dp * cp * ep))
    for group in _groups(tp, pp, dp, cp, ep, order):
        evicted = {r // rpm for r in group}  # over-eviction takes every machine of the group
        for pair in plan.pairs:
            assert not (pair.rank // rpm in evicted and pair.peer // rpm in evicted), (pair, sorted(group))


def test_even_layouts_exchange_and_every_rank_stores_one_foreign_shard() -> None:
    plan = backup_plan(Layout(tp=2, pp=4, dp=4), ranks_per_machine=2)
    peers = {p.rank: p.peer for p in plan.pairs}
    assert all(peers[peers[r]] == r for r in peers)
    assert sorted(peers.values()) == sorted(peers)


def test_table5_scale_is_safe_and_fast_enough_for_the_tui() -> None:
    plan = backup_plan(Layout(tp=8, pp=8, dp=32), ranks_per_machine=16)
    assert plan.safe and plan.rule == "mirror" and len(plan.pairs) == 2048


def test_when_mirrors_collide_the_nearest_free_machine_takes_the_backup() -> None:
    # Machines hold both PP stages of one (dp, cp). The mirror shifts dp and pp, which at machine level moves
    # only dp: rank and mirror would share a DP group's machines. The machine with both dp and cp changed is free.
    layout = Layout(tp=1, pp=2, dp=2, cp=2, order="tp-pp-dp-cp")
    plan = backup_plan(layout, ranks_per_machine=2)
    assert plan.rule == "next-free-machine" and plan.safe
    assert [(p.rank, p.peer) for p in plan.pairs] == [(0, 6), (1, 7), (2, 4), (3, 5), (4, 2), (5, 3), (6, 0), (7, 1)]
    for group in _groups(1, 2, 2, 2, 1, "tp-pp-dp-cp"):
        evicted = {r // 2 for r in group}
        assert not any(p.rank // 2 in evicted and p.peer // 2 in evicted for p in plan.pairs)


def test_layouts_where_one_group_spans_every_machine_are_reported_unsafe() -> None:
    # Each machine holds all TP x PP ranks of one DP replica: every DP group touches every machine.
    plan = backup_plan(Layout(tp=4, pp=2, dp=4, order="tp-cp-ep-pp-dp"), ranks_per_machine=8)
    assert not plan.safe and plan.rule == "neighbour"
    assert all(kinds == ("dp",) for _, _, kinds in plan.unsafe) and len(plan.unsafe) == 32
    assert all(p.machine != p.peer_machine for p in plan.pairs)


def test_a_single_parallel_group_falls_back_to_the_neighbouring_machine() -> None:
    plan = backup_plan(Layout(dp=8), ranks_per_machine=2)
    assert plan.rule == "neighbour"
    assert [(p.rank, p.peer) for p in plan.pairs] == [(0, 2), (1, 3), (2, 0), (3, 1), (4, 6), (5, 7), (6, 4), (7, 5)]
    assert not plan.safe  # one DP group is the whole job: saying "safe" would be a lie
    assert any("neighbouring machine" in n for n in plan.notes)


def test_real_machine_names_from_the_job_replace_consecutive_blocks() -> None:
    machine_of = {r: f"node-{'abcdefgh'[r // 2]}" for r in range(16)}
    plan = backup_plan(Layout(tp=2, pp=4, dp=2), machine_of=machine_of)
    by_rank = {p.rank: p for p in plan.pairs}
    assert (by_rank[8].machine, by_rank[8].peer_machine) == ("node-e", "node-b")
    assert plan.machines[0] == ("node-a", (0, 1))


@pytest.mark.parametrize(("layout", "world", "rpm", "needle"), [
    (Layout(tp=2, pp=4, dp=2), 32, 2, "covers 16 ranks"),
    (Layout(tp=2, pp=4, dp=2), None, 3, "cannot be split"),
    (Layout(tp=2, pp=4, dp=2), None, 16, "one machine"),
    (Layout(tp=2, pp=4, dp=2, order="tp-xx-pp"), None, 2, "bad rank order"),
    (Layout(tp=2, pp=4, dp=2, order="tp-pp"), None, 2, "does not place dp"),
    (Layout(tp=0, pp=4, dp=2), None, 2, "tp must be a whole number of at least 1, got 0"),
])
def test_bad_layouts_raise_with_a_fix(layout: Layout, world: int | None, rpm: int, needle: str) -> None:
    with pytest.raises(RankscopeError) as err:
        backup_plan(layout, world_size=world, ranks_per_machine=rpm)
    assert needle in err.value.message and err.value.fix


def test_cli_json_prints_pairs_of_rank_and_peer(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backup-plan", "--tp", "2", "--pp", "4", "--dp", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    pairs = {p["rank"]: p["peer"] for p in out["pairs"]}
    assert all(set(p) == {"rank", "peer"} for p in out["pairs"])
    assert (pairs[8], pairs[9], pairs[2], pairs[3]) == (2, 3, 8, 9)
    assert out["safe"] is True and out["world_size"] == 16 and len(out["machines"]) == 8


def test_cli_text_names_machines(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backup-plan", "--tp", "2", "--pp", "4", "--dp", "2", "--ranks-per-machine", "2"]) == 0
    out = capsys.readouterr().out
    assert "rank  8 (machine-4) -> rank  2 (machine-1)" in out
    assert "safe:" in out


@pytest.mark.parametrize("argv", [
    ["--tp", "2", "--pp", "4", "--dp", "0"],
    ["--tp", "3", "--pp", "4", "--ranks-per-machine", "5"],
    ["--tp", "2", "--pp", "2", "--order", "tp-qq"],
])
def test_cli_bad_sizes_exit_2_with_the_fix(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backup-plan", *argv]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "fix:" in err and "Traceback" not in err


def test_every_rank_has_exactly_one_pair_for_all_small_layouts() -> None:
    for tp, pp, dp in itertools.product((1, 2), (1, 2, 4), (1, 2, 3)):
        world = tp * pp * dp
        if world < 4:
            continue
        plan = backup_plan(Layout(tp=tp, pp=pp, dp=dp), ranks_per_machine=2 if world % 2 == 0 else 1)
        assert [p.rank for p in plan.pairs] == list(range(world))
        assert all(p.machine != p.peer_machine for p in plan.pairs)


def test_recorded_communicator_membership_overrides_the_typed_sizes() -> None:
    # The CCL plugin recorded PP groups that put rank 8 and its mirror 2 together: the mirror must not be used.
    from rankscope.analyzers.topology import Topology

    real_pp = ((0, 2, 8, 10), (1, 3, 9, 11), (4, 6, 12, 14), (5, 7, 13, 15))
    topo = Topology(Layout(tp=2, pp=4, dp=2, ranks_per_machine=2), 16, explicit=(("pp", real_pp),))
    plan = backup_plan(topo)
    peers = {p.rank: p.peer for p in plan.pairs}
    assert peers[8] not in real_pp[0]
    groups = [set(g) for g in real_pp] + [set(topo.group_of(r, k)) for r in range(16) for k in ("tp", "dp")]
    assert plan.safe
    for group in groups:
        evicted = {r // 2 for r in group}
        assert not any(p.rank // 2 in evicted and p.peer // 2 in evicted for p in plan.pairs), sorted(group)
