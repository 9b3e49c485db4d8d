"""Rank coordinates, group membership and machine placement (rankscope.analyzers.topology)."""

from __future__ import annotations

import pytest
from rankscope.analyzers.topology import (
    Topology,
    kind_of_description,
    parse_order,
    topology_for,
)
from rankscope.contract.ranks import compact_machines, compact_ranks
from rankscope.contract.snapshot import (
    Communicator,
    Instant,
    JobSnapshot,
    Layout,
    MachineSnapshot,
    RankCounters,
    RankInfo,
)

NOW = Instant(wall=1.0, mono=1.0)


def _snapshot(world: int, rpm: int, layout: Layout | None = None,
              comms: tuple[Communicator, ...] = ()) -> JobSnapshot:
    machines = []
    for m in range(world // rpm):
        ranks = tuple(RankInfo(rank=r, local_rank=r % rpm, world_size=world, pid=100 + r)
                      for r in range(m * rpm, (m + 1) * rpm))
        counters = tuple(RankCounters(rank=r.rank, pid=r.pid, world_size=world, job_id="j", heartbeat_wall=1.0,
                                      communicators=comms) for r in ranks) if comms else ()
        machines.append(MachineSnapshot(machine=f"node{m}", address="127.0.0.1:1", reachable=True, captured=NOW,
                                        ranks=ranks, counters=counters))
    return JobSnapshot(captured=NOW, machines=tuple(machines), layout=layout)


def test_parse_order_completes_short_forms_and_keeps_megatron_default() -> None:
    assert parse_order("tp-cp-ep-dp-pp") == ("tp", "cp", "ep", "dp", "pp")
    assert parse_order("tp-pp-dp") == ("tp", "pp", "dp", "cp", "ep")
    assert parse_order("TP-DP-PP") == ("tp", "dp", "pp", "cp", "ep")


@pytest.mark.parametrize("bad, hint", [("tp-xx-dp", "unknown dimension"), ("tp-tp-dp", "appear twice"),
                                       ("", "empty")])
def test_parse_order_errors_name_the_fix(bad: str, hint: str) -> None:
    with pytest.raises(ValueError, match=hint) as info:
        parse_order(bad)
    assert "tp-" in str(info.value)  # the message shows a valid example


def test_megatron_default_order_coordinates_and_groups() -> None:
    # rank = tp + TP*(cp + CP*(ep + EP*(dp + DP*pp))) with TP=2, DP=2, PP=2
    topo = Topology(layout=Layout(tp=2, dp=2, pp=2), world_size=8)
    assert topo.coords(5) == {"tp": 1, "cp": 0, "ep": 0, "dp": 0, "pp": 1}
    assert topo.group_of(5, "tp") == (4, 5)
    assert topo.group_of(5, "dp") == (5, 7)
    assert topo.group_of(5, "pp") == (1, 5)
    assert topo.groups("pp") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert [topo.group_index(r, "pp") for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_fig7_order_pp_before_dp() -> None:
    topo = Topology(layout=Layout(tp=2, pp=4, dp=4, order="tp-pp-dp"), world_size=32)
    assert topo.coords(30) == {"tp": 0, "cp": 0, "ep": 0, "dp": 3, "pp": 3}
    assert topo.group_of(30, "pp") == (24, 26, 28, 30)
    assert topo.group_of(25, "pp") == (25, 27, 29, 31)
    assert topo.group_of(30, "dp") == (6, 14, 22, 30)
    for kind in ("tp", "pp", "dp"):
        groups = topo.groups(kind)
        assert sorted(r for g in groups for r in g) == list(range(32))  # a partition
        assert all(topo.groups(kind)[topo.group_index(r, kind)] == topo.group_of(r, kind) for r in range(32))


def test_pp_dp_order_swaps_the_slow_dimensions() -> None:
    a = topology_for(_snapshot(8, 2), Layout(tp=2, pp=2, dp=2, order="tp-cp-ep-pp-dp"))
    assert a.group_of(0, "pp") == (0, 2)
    assert a.group_of(0, "dp") == (0, 4)


def test_layout_that_does_not_fit_the_job_is_refused_with_sizes() -> None:
    with pytest.raises(ValueError, match=r"multiply to 12 ranks .* job has 8"):
        topology_for(_snapshot(8, 2), Layout(tp=2, pp=3, dp=2))


def test_no_layout_assumes_one_group_and_says_so() -> None:
    topo = topology_for(_snapshot(8, 2), None)
    assert topo.assumed and topo.world_size == 8
    assert topo.kinds() == ()  # one DP group of the whole job says nothing


def test_communicator_membership_wins_over_typed_sizes() -> None:
    # The recorded PP groups pair ranks (0,6),(1,7),...: not what tp=2,pp=2,dp=2 would give.
    comms = tuple(Communicator(comm_id=f"pp{i}", backend="gloo", description="PIPELINE_MODEL_PARALLEL_GROUP",
                               ranks=(i, i + 6 if i < 2 else i - 2)) for i in range(2))
    comms += (Communicator("pp2", "gloo", "PIPELINE_MODEL_PARALLEL_GROUP", (2, 4)),
              Communicator("pp3", "gloo", "PIPELINE_MODEL_PARALLEL_GROUP", (3, 5)),
              Communicator("world", "gloo", "default_pg", tuple(range(8))))
    topo = topology_for(_snapshot(8, 2, comms=comms), Layout(tp=2, pp=2, dp=2))
    assert topo.group_of(0, "pp") == (0, 6)
    assert topo.group_of(4, "pp") == (2, 4)
    assert topo.coords(6)["pp"] == 1
    assert topo.group_of(0, "tp") == (0, 1)  # not recorded: from the sizes


def test_description_names() -> None:
    assert kind_of_description("PIPELINE_MODEL_PARALLEL_GROUP") == "pp"
    assert kind_of_description("tp") == "tp"
    assert kind_of_description("dp_group") == "dp"
    assert kind_of_description("pipeline-3") == "pp"
    assert kind_of_description("DATA_PARALLEL_GROUP_WITH_CP") is None
    assert kind_of_description("default_pg") is None


def test_compact_forms() -> None:
    assert compact_ranks([3, 0, 1, 2, 8, 10, 11]) == "0-3,8,10-11"
    assert compact_ranks([3, 0, 1, 2, 8, 10, 11], limit=3) == "0-3,8,10-11"  # within the limit: whole


def test_compact_ranks_of_a_large_job_stay_exact_when_strided() -> None:
    pipeline_stage = [r for r in range(16384) if r % 32 // 8 == 1]  # tp 8, pp 4: stage 1 of every replica
    assert compact_ranks(pipeline_stage, 12) == "8-15,40-47,…,16360-16367 (512 runs of 8, one every 32)"
    assert compact_ranks(range(3, 64, 4), 4) == "3,7,…,63 (16 ranks, one every 4)"
    # one rank off the pattern: no pattern is claimed, the set is cut with a count
    assert compact_ranks([r for r in pipeline_stage if r != 40], 2) == "8-15,41-47,… (+510 runs)"
    assert compact_ranks([0, 1, 2, 5, 7, 8], 2) == "0-2,5,… (+1 run)"
    assert compact_ranks([0, 1, 4, 5, 8, 9, 13], 2) == "0-1,4-5,… (+2 runs)"  # the last run is off the stride
    assert compact_ranks([0, 4, 8], 1) == "0,4,8"  # three strided runs: shorter than their pattern
    assert compact_machines(["machine-13", "machine-12", "machine-15", "machine-14", "x"]) == "machine-12..15, x"
    assert compact_machines(["machine-2", "machine-10"]) == "machine-2, machine-10"
