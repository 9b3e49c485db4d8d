"""Parsing what `--agents` / `--hostfile` name into host:port addresses."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rankscope.wire.agents_spec import AgentSpecError, expand_hostlist, parse_agents, read_hostfile, resolve_agents


def test_a_plain_comma_list_keeps_its_order() -> None:
    assert parse_agents("b:2, a:1,10.0.0.7:50051") == ["b:2", "a:1", "10.0.0.7:50051"]


def test_slurm_ranges_expand_with_their_zero_padding() -> None:
    assert parse_agents("node[01-04,07]:50051") == [
        "node01:50051", "node02:50051", "node03:50051", "node04:50051", "node07:50051"]
    assert parse_agents("n[8-10]:1") == ["n8:1", "n9:1", "n10:1"]
    assert parse_agents("gpu[098-101]:1") == ["gpu098:1", "gpu099:1", "gpu100:1", "gpu101:1"]


def test_several_ranges_in_one_name_and_a_range_of_ports() -> None:
    assert expand_hostlist("r[1-2]-g[1,3]") == ["r1-g1", "r1-g3", "r2-g1", "r2-g3"]
    assert parse_agents("127.0.0.1:[50051-50053]") == ["127.0.0.1:50051", "127.0.0.1:50052", "127.0.0.1:50053"]


def test_ranges_mix_with_plain_entries_and_duplicates_are_dropped() -> None:
    assert parse_agents("node[1-2]:5,node1:5,x:6") == ["node1:5", "node2:5", "x:6"]


def test_ipv6_literals_are_not_mistaken_for_ranges() -> None:
    assert parse_agents("[::1]:50051,[fe80::1]:7") == ["[::1]:50051", "[fe80::1]:7"]


def test_default_port_fills_entries_without_one() -> None:
    assert parse_agents("a,b:9,c[1-2]", default_port=50051) == ["a:50051", "b:9", "c1:50051", "c2:50051"]


@pytest.mark.parametrize(
    ("spec", "message", "fix"),
    [
        ("node01", "no port given", "node01:50051"),
        ("a:0", "port '0'", "host:port"),
        ("a:http", "port 'http'", "host:port"),
        ("n[4-1]:1", "runs backwards", "1-4"),
        ("n[1-2:1", "without a matching ']'", "host:port"),
        ("n]:1", "without a matching '['", "host:port"),
        ("a:1,,b:2", "empty agent entry", "host:port"),
        ("a:1,", "empty agent entry", "host:port"),
        ("n[x]:1", "not a number", "node[01-04,07]"),
        ("n[1-999999]:1", "more than", "range bounds"),
        (":50051", "host name is missing", "host:port"),
        ("a b:1", "no spaces", "host:port"),
    ],
)
def test_bad_input_says_what_is_wrong_and_how_to_write_it(spec: str, message: str, fix: str) -> None:
    with pytest.raises(AgentSpecError) as err:
        parse_agents(spec)
    assert message in err.value.message
    assert fix in err.value.fix


def test_hostfile_lines_comments_and_mpi_slots(tmp_path: Path) -> None:
    f = tmp_path / "hosts"
    f.write_text("# the job's machines\nnode[01-02]:50051 slots=8\n\nnode09:50052  # spare\n")
    assert read_hostfile(f) == ["node01:50051", "node02:50051", "node09:50052"]
    assert parse_agents(f"x:1,@{f}") == ["x:1", "node01:50051", "node02:50051", "node09:50052"]
    assert resolve_agents("x:1", f) == ["x:1", "node01:50051", "node02:50051", "node09:50052"]


def test_hostfile_errors_name_the_file_and_line(tmp_path: Path) -> None:
    f = tmp_path / "hosts"
    f.write_text("ok:1\nbroken\n")
    with pytest.raises(AgentSpecError) as err:
        read_hostfile(f)
    assert f"{f}:2" in err.value.message and "no port given" in err.value.message
    with pytest.raises(AgentSpecError) as err:
        read_hostfile(tmp_path / "nope")
    assert "does not exist" in err.value.message and "--hostfile" in err.value.fix


def test_nothing_to_contact_is_an_error() -> None:
    with pytest.raises(AgentSpecError) as err:
        resolve_agents(None, None)
    assert "--agents" in err.value.fix


def test_a_hostfile_marks_evicted_agents_and_the_drill_marks_them_after_an_eviction(tmp_path: Path) -> None:
    from rankscope.drill.control import mark_evicted_in_hostfile
    from rankscope.wire.agents_spec import hostfile_members, read_hostfile, write_hostfile

    path = tmp_path / "agents.txt"
    write_hostfile(path, ["127.0.0.1:5001", "127.0.0.1:5002", "127.0.0.1:5003"])
    machines = {"machine-0": "127.0.0.1:5001", "machine-1": "127.0.0.1:5002"}
    mark_evicted_in_hostfile(path, machines, ("machine-0",))
    # the evicted line names its machine: a view attached later never polled that agent
    assert path.read_text() == "127.0.0.1:5002\n127.0.0.1:5003\n127.0.0.1:5001 evicted machine=machine-0\n"
    assert hostfile_members(path) == (["127.0.0.1:5002", "127.0.0.1:5003"], ["127.0.0.1:5001"],
                                      {"127.0.0.1:5001": "machine-0"})
    assert read_hostfile(path) == ["127.0.0.1:5002", "127.0.0.1:5003"]  # an evicted agent is not contacted
    mark_evicted_in_hostfile(path, machines, ("machine-1",))  # a second eviction keeps the first one's name
    assert hostfile_members(path).names == {"127.0.0.1:5001": "machine-0", "127.0.0.1:5002": "machine-1"}
    path.write_text("node01:50051 slots=8\nnode02:50051 evicted  # taken out at 03:12\n"
                    "node[03-04]:50051 evicted machine=gpu3\nnode01:50052 machine=gpu9\n")
    # no name without the mark, none for a range (one name cannot be two machines'), none given: none kept
    assert hostfile_members(path) == (["node01:50051", "node01:50052"], ["node02:50051", "node03:50051", "node04:50051"],
                                      {})
    write_hostfile(path, ["a:1"], ["b:1", "c:1"], {"b:1": "rack 2 gpu", "c:1": "gpu-7"})
    assert path.read_text() == "a:1\nb:1 evicted\nc:1 evicted machine=gpu-7\n"  # a name with a space is not written


def test_a_live_source_follows_its_hostfile(tmp_path: Path) -> None:
    from rankscope.tui.sources import LiveSource
    from rankscope.wire.agents_spec import write_hostfile

    path = tmp_path / "agents.txt"
    write_hostfile(path, ["127.0.0.1:5001", "127.0.0.1:5002"])
    source = LiveSource(["127.0.0.1:5001", "127.0.0.1:5002"], None, hostfile=path)
    assert not source.reread_hostfile()  # unchanged
    write_hostfile(path, ["127.0.0.1:5002", "127.0.0.1:5009"], ["127.0.0.1:5001"])
    assert source.reread_hostfile()
    assert source.evicted_addresses == {"127.0.0.1:5001"}
    assert source._client.members == ("127.0.0.1:5002", "127.0.0.1:5009")  # the new agent is asked, the evicted not
    assert source.label == "2 agents"


def test_a_view_attached_after_an_eviction_shows_the_evicted_machine_by_its_name(tmp_path: Path) -> None:
    import asyncio

    from rankscope.drill.control import mark_evicted_in_hostfile
    from rankscope.tui.sources import LiveSource
    from rankscope.wire.agents_spec import hostfile_members, write_hostfile

    path = tmp_path / "agents.txt"
    agents = ["127.0.0.1:5001", "127.0.0.1:5002"]
    write_hostfile(path, agents)
    mark_evicted_in_hostfile(path, {"machine-0": agents[0], "machine-1": agents[1]}, ("machine-0", "machine-1"))
    members, evicted, names = hostfile_members(path)  # as `rankscope attach --hostfile` reads it
    source = LiveSource(agents, None, hostfile=path, evicted=evicted, machine_names=names, deadline_s=2.0)
    snapshot = asyncio.run(source.poll())  # every agent evicted: nobody is asked, the stand-ins say why
    assert snapshot is not None and members == []
    assert [(m.machine, m.address, m.reachable) for m in snapshot.machines] == [
        ("machine-0", agents[0], False), ("machine-1", agents[1], False)]
    assert all("was evicted" in (m.error.message if m.error else "") for m in snapshot.machines)


def test_a_live_source_names_the_agents_it_polls_after_an_eviction() -> None:
    from rankscope.tui.sources import LiveSource

    agents = [f"127.0.0.1:{5001 + i}" for i in range(6)]
    assert LiveSource(agents, None).label == "6 agents"
    assert LiveSource(agents, None, evicted=agents[:1]).label == "5 agents"
    source = LiveSource(agents, None)
    source.retire(agents[:2])  # the TUI saw the eviction succeed: the header counts the agents still polled
    assert source.label == "4 agents"


_ADDRESS = st.builds(lambda host, port: f"{host}:{port}", st.from_regex(r"[a-z][a-z0-9-]{0,8}", fullmatch=True),
                     st.integers(1, 65535))


@settings(max_examples=150, deadline=None)
@given(agents=st.lists(_ADDRESS, max_size=6, unique=True), data=st.data())
def test_a_written_hostfile_reads_back_with_its_evicted_machines_names(agents: list[str], data: st.DataObject) -> None:
    import tempfile

    from rankscope.wire.agents_spec import hostfile_members, write_hostfile

    evicted = data.draw(st.lists(st.sampled_from(agents), unique=True) if agents else st.just([]), label="evicted")
    names = {a: data.draw(st.text(min_size=1, max_size=12), label=f"name of {a}") for a in evicted}
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "agents.txt"
        write_hostfile(path, [a for a in agents if a not in evicted], evicted, names)
        back = hostfile_members(path)
    assert back.members == [a for a in agents if a not in evicted] and back.evicted == evicted
    # every name that is one printable word comes back exactly; any other is left out, never mangled
    assert back.names == {a: n for a, n in names.items()
                          if n.isprintable() and not any(c.isspace() or c == "#" for c in n)}


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_any_hostfile_text_is_read_or_refused_with_the_line_named(text: str) -> None:
    import tempfile

    from rankscope.wire.agents_spec import hostfile_members

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "agents.txt"
        path.write_text(text, encoding="utf-8")
        try:
            back = hostfile_members(path, default_port=50051)
        except AgentSpecError as exc:
            assert f"{path}:" in exc.message and exc.fix
            return
    assert set(back.names) <= set(back.evicted)
