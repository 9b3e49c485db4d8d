"""Another local user or a peer without a token, round two: overwrite, crash, lock out, blow up.

Each test here was red before its fix: a rank wrote its counters through a
link another user planted; a counter file truncated under the agent's mapping
killed it; any process claiming torchrun's variables was a rank; token-less
calls and silent connections held every place of an agent; row counts and
member counts were believed before anything was checked; a deep stack ended
the analysis in a RecursionError; and the smaller ones of item 6. The
lockouts are tested with real sockets against a real agent process, and
``benchmarks/bench_lockout.py`` measures how long a real client waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path

import grpc
import pytest
from agent_helpers import PY, START_TIMEOUT_S, Processes, clean_env, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rankscope.actions.config import load_actions_config
from rankscope.actions.hot_update import CodeVersions
from rankscope.ccl_plugin import layout as L
from rankscope.ccl_plugin.writer import CounterWriter
from rankscope.contract import snapshot as snapshot_module
from rankscope.contract.bundle import Bundle, BundleError, bundle_to_dict, loads, read_bundle
from rankscope.contract.errors import RankscopeError
from rankscope.contract.schema import columns_of
from rankscope.contract.snapshot import (
    Frame,
    Instant,
    JobSnapshot,
    Layout,
    MachineSnapshot,
    ProcessRole,
    ProcessStack,
    RankInfo,
    RankStacks,
    ThreadStack,
)
from rankscope.probes.ccl_counters import read_counter_file
from rankscope.probes.discovery import discover
from rankscope.wire.fanout import auth_metadata
from rankscope.wire.proto import rankscope_pb2 as pb
from rankscope.wire.tokens import load_tokens
from repo_paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_lockout

pytestmark = pytest.mark.timeout(180)

READ = "read-harden-0123456789abcdef0123"
CALL_S = 15.0
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")
NOBODY = 65534


def _tokens(folder: Path) -> Path:
    tokens = folder / "tokens"
    tokens.write_text(f"read:{READ}\n")
    tokens.chmod(0o600)
    return tokens


# ---- 1. a planted link at the writer's temporary name ------------------------------------------------------------


def test_a_link_planted_at_the_temporary_name_is_never_written_through(tmp_path: Path) -> None:
    shared = tmp_path / "shm-rs"
    shared.mkdir()
    shared.chmod(0o777)  # made first, open to all, as another user would leave /dev/shm/rankscope
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    os.symlink(victim, shared / f".job.rank0.ccl.{os.getpid()}.tmp")
    writer = CounterWriter(shared, rank=0, world_size=1, job_id="job")
    try:
        assert victim.read_text() == "precious\n"
        assert writer.enabled
        published = shared / "job.rank0.ccl"
        assert not published.is_symlink() and published.read_bytes()[:8] == L.MAGIC
        assert os.stat(shared).st_mode & 0o777 == 0o700  # ours: tightened so no one plants anything more
    finally:
        writer.close()


@ROOT_ONLY
def test_a_counter_directory_of_another_user_turns_the_writer_off_with_one_line(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o777)
    theirs.chmod(0o777)
    os.chown(theirs, NOBODY, NOBODY)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    os.symlink(victim, theirs / "job.rank0.ccl")
    writer = CounterWriter(theirs, rank=0, world_size=1, job_id="job")  # never raises into the training code
    writer.step()
    writer.close()
    assert not writer.enabled
    assert victim.read_text() == "precious\n"
    assert os.listdir(theirs) == ["job.rank0.ccl"] and (theirs / "job.rank0.ccl").is_symlink()
    err = capfd.readouterr().err
    assert f"belongs to uid {NOBODY}" in err and "counters are off" in err, err
    assert len([line for line in err.splitlines() if "rankscope:" in line]) == 1, err


# ---- 2. a counter file truncated while it is read; ranks only of the job's users ----------------------------------


def _counter_file(folder: Path) -> Path:
    folder.mkdir(mode=0o700, exist_ok=True)
    writer = CounterWriter(folder, rank=3, world_size=8, job_id="job")
    writer.comm("c0", "nccl", "DATA_PARALLEL_GROUP", tuple(range(8)))
    writer.launch(writer.slot(0, "all_reduce"), 1024)
    return writer.path


_TRUNCATING_READER = """
import os, sys
from pathlib import Path
from rankscope.probes import ccl_counters
parse = ccl_counters._parse
def truncated_then_parsed(*args, **kwargs):
    os.truncate(sys.argv[1], 4096)  # the file shrinks after the reader opened it and took its size
    return parse(*args, **kwargs)
ccl_counters._parse = truncated_then_parsed
print(ccl_counters.read_counter_file(Path(sys.argv[1])).counters.error)
"""


def test_a_counter_file_truncated_while_it_is_read_is_an_error_not_a_crash(tmp_path: Path) -> None:
    path = _counter_file(tmp_path / "c")
    done = subprocess.run([PY, "-c", _TRUNCATING_READER, str(path)], capture_output=True, text=True, timeout=60,
                          env=clean_env())
    assert done.returncode == 0, f"the reader died ({done.returncode}, -7 is SIGBUS): {done.stderr}"
    assert "truncated" in done.stdout, done.stdout


def _header_offset(name: str) -> tuple[int, str]:
    """Where a header field lies in the file, and its struct code."""
    codes = "<"
    for field, code, _ in L.HEADER_FIELDS:
        if field == name:
            return struct.calcsize(codes), "<" + code
        codes += code
    raise KeyError(name)


def _patch(path: Path, **fields: int) -> None:
    data = bytearray(path.read_bytes())
    for name, value in fields.items():
        at, code = _header_offset(name)
        struct.pack_into(code, data, at, value)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("fields", "needle"), [
    ({"member_pool_size": 2_500_000}, "larger than any counter file"),  # 20 communicators x 2.5 M members
    ({"max_comms": 1 << 20, "n_comms": 1 << 20}, "table sizes in the header do not fit"),
    ({"rank": -2**31}, "not a rank of any job"),
    ({"world_size": -1}, "not a rank of any job"),
])
def test_counts_and_ranks_in_a_counter_header_are_bounded_before_use(tmp_path: Path, fields: dict[str, int],
                                                                      needle: str) -> None:
    path = _counter_file(tmp_path / "c")
    _patch(path, **fields)
    if "member_pool_size" in fields:  # a file as large as the pool it declares, every communicator holding it all
        with path.open("r+b") as fh:
            fh.truncate(L.MEMBER_POOL_OFFSET + fields["member_pool_size"] * L.MEMBER.size)
        _patch(path, n_comms=20)
        data = bytearray(path.read_bytes())
        for i in range(20):
            L.COMM.pack_into(data, L.comm_offset(i), 2, 0, fields["member_pool_size"], b"c%d" % i, b"nccl", b"", 0, -1)
        path.write_bytes(bytes(data))
    tracemalloc.start()
    try:
        got = read_counter_file(path).counters
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got.error is not None and needle in got.error, got.error
    assert peak < 4 << 20, f"reading a lying header took {peak >> 20} MB"


def test_the_writer_and_reader_agree_on_a_real_file(tmp_path: Path) -> None:
    got = read_counter_file(_counter_file(tmp_path / "c")).counters
    assert got.error is None and got.rank == 3 and got.world_size == 8
    assert got.communicators[0].ranks == tuple(range(8)) and got.ops[0].wr == 1


@ROOT_ONLY
def test_a_process_of_another_user_claiming_rank_variables_is_no_rank(tmp_path: Path) -> None:
    run_id = f"claimed-{os.getpid()}"
    env = clean_env()
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", TORCHELASTIC_RUN_ID=run_id)
    claimer = subprocess.Popen(["sleep", "120"], env=env, user=NOBODY, group=NOBODY, extra_groups=[])
    mine = subprocess.Popen(["sleep", "120"], env={**env, "RANK": "1"})
    try:
        def both_seen() -> bool:
            found = discover(run_id=run_id)
            return claimer.pid in {s.pid for s in found.skipped} and mine.pid in {r.pid for r in found.ranks}

        wait_for(both_seen, 30, "discovery to see both processes")
        found = discover(run_id=run_id)
        assert [r.pid for r in found.ranks] == [mine.pid]  # root's own process: trusted by a root agent
        (why,) = [s.reason for s in found.skipped if s.pid == claimer.pid]
        assert "claims RANK" in why and f"uid {NOBODY}" in why, why
        pinned = discover(run_id=run_id, users=frozenset({NOBODY}))  # --job-user nobody
        assert [r.pid for r in pinned.ranks] == [claimer.pid]
    finally:
        for p in (claimer, mine):
            p.kill()
            p.wait()


# ---- 3. lockouts, with real sockets against a real agent ---------------------------------------------------------


async def test_token_less_calls_that_never_send_their_message_are_refused_at_once(procs: Processes,
                                                                                   tmp_path: Path) -> None:
    agent = procs.agent("calls", "--run-id", "nobody", "--counter-dir", str(tmp_path / "c"),
                        token_file=_tokens(tmp_path))
    ended: list[grpc.StatusCode] = []
    attack = asyncio.create_task(bench_lockout.hold_calls(agent.address, 64, ended=ended))
    try:
        await asyncio.to_thread(wait_for, lambda: len(ended) >= 128, 60, "the agent to end the attacker's calls")
        channel = grpc.aio.insecure_channel(agent.address)
        async with channel:
            reply = await channel.unary_unary("/rankscope.v1.RankscopeAgent/Describe")(
                pb.DescribeRequest().SerializeToString(), metadata=auth_metadata(READ), timeout=CALL_S)
        assert pb.MachineSnapshot.FromString(reply).machine == "calls"
    finally:
        attack.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await attack
    assert set(ended) == {grpc.StatusCode.UNAUTHENTICATED}, set(ended)


async def test_a_call_with_a_token_that_never_sends_its_message_is_ended_saying_why(procs: Processes,
                                                                                     tmp_path: Path) -> None:
    agent = procs.agent("late", "--run-id", "nobody", "--counter-dir", str(tmp_path / "c"),
                        token_file=_tokens(tmp_path))
    never = asyncio.Event()

    async def silence() -> object:
        await never.wait()
        yield b""  # pragma: no cover

    async with grpc.aio.insecure_channel(agent.address) as channel:
        call = channel.stream_unary("/rankscope.v1.RankscopeAgent/Describe")(
            silence(), metadata=auth_metadata(READ), timeout=60.0)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "no request message within" in (info.value.details() or ""), info.value.details()


def test_a_connection_that_never_calls_is_closed(procs: Processes, tmp_path: Path) -> None:
    agent = procs.agent("silent", "--run-id", "nobody", "--counter-dir", str(tmp_path / "c"),
                        token_file=_tokens(tmp_path))
    with socket.create_connection(("127.0.0.1", agent.port)) as sock:
        sock.sendall(bench_lockout.PREFACE + bench_lockout.EMPTY_SETTINGS)
        sock.settimeout(60.0)  # the agent closes it after CALL_WAIT_S; before, it kept it for 300 s
        assert sock.recv(65536)  # the agent's settings...
        sock.sendall(bench_lockout.SETTINGS_ACK)  # ...acknowledged: the handshake is over; then nothing
        while sock.recv(65536):
            pass  # until the agent ends the connection


@ROOT_ONLY
def test_another_users_connections_filling_every_place_do_not_keep_a_client_out(tmp_path: Path) -> None:
    procs = Processes(tmp_path)
    port_file = tmp_path / "low.port"
    # a low descriptor limit makes the places few (512 descriptors: 85 connections; the old agent took 256); a shim
    # sets it, then execs the agent
    shim = ("import os, resource, sys\nresource.setrlimit(resource.RLIMIT_NOFILE, (512, 512))\n"
            "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])\n")
    with (tmp_path / "low.log").open("wb") as out:
        agent = subprocess.Popen([PY, "-c", shim, "-m", "rankscope", "agent", "--port", "0", "--port-file",
                                  str(port_file), "--machine-name", "low", "--token-file", str(_tokens(tmp_path)),
                                  "--run-id", "nobody", "--counter-dir", str(tmp_path / "c")],
                                 stdout=out, stderr=subprocess.STDOUT, env=clean_env(), start_new_session=True)
    procs.started.append(agent)
    try:
        wait_for(port_file.exists, START_TIMEOUT_S, "the agent to start")
        port = int(port_file.read_text())
        # another user keeps 280 connections open that finish the handshake and say nothing, reopening each one
        # the agent closes at once (the old agent took 256 of them and kept them for 300 s)
        attacker = subprocess.Popen([PY, str(ROOT / "benchmarks" / "bench_lockout.py"), "--attacker", "silent",
                                     "127.0.0.1", str(port), "280", str(NOBODY)], stdout=subprocess.PIPE,
                                    env=clean_env(), start_new_session=True)
        procs.started.append(attacker)
        assert attacker.stdout is not None and attacker.stdout.readline().strip() == b"ready"
        took = asyncio.run(bench_lockout.time_to_get_in(f"127.0.0.1:{port}", READ, limit_s=60.0))
        assert took is not None, f"a client never got in:\n{(tmp_path / 'low.log').read_text()}"
        assert attacker.poll() is None and agent.poll() is None  # the attack was still on, the agent alive
    finally:
        procs.close()


# ---- 4. counts a bundle declares ---------------------------------------------------------------------------------


def _bundle_dict() -> dict[str, object]:
    frames = (Frame("wait", "dist.py", 1, None), Frame("main", "train.py", 3, None))
    machine = MachineSnapshot("m0", "x", True, Instant(1.0, 2.0), ranks=(RankInfo(0, 0, 1, 10),),
                              stacks=(RankStacks(0, ProcessStack(10, ProcessRole.MAIN,
                                                                 (ThreadStack(1, frames, "MainThread"),))),))
    snap = JobSnapshot(Instant(1.0, 2.0), (machine,), job_id="j", layout=Layout(tp=1))
    return bundle_to_dict(Bundle(snapshots=(snap,), created_wall=3.0), compact=True)


@pytest.mark.parametrize("rows", [10**7, 10**9])
def test_a_bundle_whose_row_count_lies_is_refused_without_the_memory(rows: int) -> None:
    data = _bundle_dict()
    data["tables"]["Layout"]["rows"] = rows  # type: ignore[index]
    data["tables"]["Layout"]["columns"] = {}  # type: ignore[index]  # every field of a Layout has a default
    text = json.dumps(data)
    assert len(text) < 16_000
    tracemalloc.start()
    try:
        with pytest.raises(BundleError) as info:
            loads(text, "lying.json")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "Layout" in str(info.value) and str(rows) in str(info.value), str(info.value)
    assert peak < 32 << 20, f"refusing a 16 KB bundle took {peak >> 20} MB"


def test_reading_a_small_bundle_sets_no_large_buffer_aside(tmp_path: Path) -> None:
    path = tmp_path / "b.json"
    path.write_text(json.dumps(_bundle_dict()))
    tracemalloc.start()
    try:
        bundle = read_bundle(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert bundle.latest.machines[0].machine == "m0"
    assert peak < 32 << 20, f"reading a {path.stat().st_size}-byte bundle set {peak >> 20} MB aside"


# ---- 5. a deep stack -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [600, 10_000])
def test_a_deep_stack_is_analysed_with_its_whole_depth(depth: int) -> None:
    from rankscope.analyzers.analysis import analyze_job
    from rankscope.tui.analysis import build_stack_view

    machines = []
    for m in range(2):
        ranks, stacks = [], []
        for r in (2 * m, 2 * m + 1):
            outer = tuple(Frame(f"layer{i}", "model.py", i, None) for i in range(depth))
            inner = Frame("sleep" if r == 3 else "wait", "dist.py", 1, None)
            frames = (inner, *reversed(outer))  # innermost first, as py-spy gives them
            stacks.append(RankStacks(r, ProcessStack(100 + r, ProcessRole.MAIN, (ThreadStack(1, frames, "Main"),))))
            ranks.append(RankInfo(rank=r, local_rank=r % 2, world_size=4, pid=100 + r))
        machines.append(MachineSnapshot(f"m{m}", "x", True, Instant(1.0, 2.0), ranks=tuple(ranks),
                                        stacks=tuple(stacks)))
    snapshot = JobSnapshot(Instant(1.0, 2.0), tuple(machines), job_id="j")
    node, chain = analyze_job(snapshot).stacks.tree, 0
    while len(node.children) == 1:
        node, chain = node.children[0], chain + 1
    assert node.ranks == (0, 1, 2, 3) and chain == depth + 1  # the lane's label, then every shared frame
    assert {c.frame.split(" ")[0] for c in node.children} == {"sleep", "wait"}
    assert [c.ranks for c in node.children] == [(0, 1, 2), (3,)]
    view = build_stack_view(snapshot)  # the TUI's tree, converted without recursion
    assert view.tree is not None


# ---- 6. the smaller ones -------------------------------------------------------------------------------------------


def test_a_token_file_others_can_read_is_refused(tmp_path: Path) -> None:
    tokens = _tokens(tmp_path)
    tokens.chmod(0o644)
    with pytest.raises(RankscopeError) as info:
        load_tokens(tokens, private=True)
    assert "can be read or written by other users" in info.value.message and "chmod 600" in info.value.fix
    done = subprocess.run([PY, "-m", "rankscope", "agent", "--port", "0", "--token-file", str(tokens)],
                          capture_output=True, text=True, timeout=120, env=clean_env())
    assert done.returncode != 0 and "chmod 600" in done.stderr, done.stderr


def test_a_tls_key_others_can_read_is_refused(tmp_path: Path) -> None:
    from rankscope.wire.tls import make_session, server_tls, write_private

    session = make_session(["localhost"])
    cert = write_private(tmp_path / "agent.crt", session.server.cert_pem)
    key = write_private(tmp_path / "agent.key", session.server.key_pem)
    assert server_tls(cert, key) is not None  # 0600: accepted
    key.chmod(0o640)
    with pytest.raises(RankscopeError) as info:
        server_tls(cert, key)
    assert "TLS private key" in info.value.message and "chmod 600" in info.value.fix


@pytest.mark.parametrize("args", [["watch", "--agents", "127.0.0.1:1", "--interval", "nan"],
                                  ["watch", "--agents", "127.0.0.1:1", "--duration", "nan"],
                                  ["watch", "--agents", "127.0.0.1:1", "--duration", "inf"],
                                  ["attach", "--agents", "127.0.0.1:1", "--interval", "nan"]])
def test_non_finite_intervals_and_durations_are_refused(args: list[str]) -> None:
    done = subprocess.run([PY, "-m", "rankscope", *args], capture_output=True, text=True, timeout=120,
                          env=clean_env())
    assert done.returncode == 2, done.stdout + done.stderr
    assert "is not a number of seconds above 0" in done.stderr, done.stderr


def test_a_fifo_as_the_actions_config_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "actions.toml"
    os.mkfifo(fifo)
    outcome: list[BaseException | None] = []

    def load() -> None:
        try:
            load_actions_config(fifo, tmp_path / "state")
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(30)
    if reader.is_alive():
        with open(fifo, "w"):  # release the stuck reader before failing
            pass
        pytest.fail("reading a FIFO as the actions config waited for a writer")
    (exc,) = outcome
    assert isinstance(exc, RankscopeError) and "not a regular file" in exc.message, exc


@pytest.mark.parametrize("machine", ["../../x", "..", "a/b", ".hidden"])
def test_a_machine_name_cannot_take_the_state_dir_outside_its_folder(tmp_path: Path, machine: str) -> None:
    from rankscope.actions.config import state_dir_for

    folder = tmp_path / "state"
    made = state_dir_for(folder / "%n", machine)
    assert made.parent == folder and made.name not in ("", ".", "..") and "/" not in made.name


@ROOT_ONLY
def test_a_prepared_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "prepared"
    theirs = root / "v9"
    theirs.mkdir(parents=True)
    theirs.chmod(0o755)
    os.chown(theirs, NOBODY, NOBODY)
    versions = CodeVersions(tmp_path / "current", tmp_path / "versions", prepared_roots=(root,))
    with pytest.raises(RankscopeError) as info:
        versions.prepared(str(theirs))
    assert f"belongs to uid {NOBODY}" in info.value.message, info.value.message


def test_the_audit_name_cannot_pass_for_the_agents_own_token_note() -> None:
    from rankscope.actions.audit import _who
    from rankscope.actions.model import ActionKind, ActionRequest, EvictArgs, Targets

    request = ActionRequest("a-1", ActionKind.EVICT, Targets(("m0",)), EvictArgs("x"), "bob (act token deadbeef)",
                            caller="act token d8f53a77")
    assert _who(request) == "bob [act token deadbeef] (act token d8f53a77)"


# ---- the property test: declared sizes that lie ---------------------------------------------------------------------


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(["n_comms", "n_ops", "max_comms", "max_ops", "member_pool_size", "file_size",
                              "comm_table_offset", "op_table_offset", "member_pool_offset", "rank", "world_size"]),
       value=st.integers(min_value=-2**31, max_value=2**31 - 1) | st.integers(min_value=0, max_value=2**32 - 1))
def test_any_count_a_counter_header_declares_is_bounded(tmp_path: Path, field: str, value: int) -> None:
    path = tmp_path / "c" / "job.rank3.ccl"
    if not path.exists():
        _counter_file(tmp_path / "c")
    data = bytearray(path.read_bytes())
    at, code = _header_offset(field)
    with contextlib.suppress(struct.error):  # a negative value for an unsigned field: not a header anyone writes
        struct.pack_into(code, data, at, value)
        lying = tmp_path / "lying.rank3.ccl"
        lying.write_bytes(bytes(data))
        tracemalloc.start()
        try:
            got = read_counter_file(lying).counters
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 8 << 20, f"{field}={value}: reading took {peak >> 20} MB"
        assert got.error is None or "counter file" in got.error
        if got.error is None:
            assert 0 <= got.rank < (got.world_size or 0) and len(got.communicators) <= L.MAX_COMMS


@settings(max_examples=60, deadline=None)
@given(table=st.sampled_from(["Layout", "Frame", "ThreadStack", "MachineSnapshot", "JobSnapshot", "RankInfo"]),
       rows=st.integers(min_value=0, max_value=10**12))
def test_any_row_count_a_bundle_declares_is_bounded(table: str, rows: int) -> None:
    data = _bundle_dict()
    tables = data["tables"]
    assert isinstance(tables, dict)
    if table not in tables:
        return
    honest = tables[table]["rows"]
    tables[table]["rows"] = rows
    # the columns a reader would fill with defaults go, so only the count is left to believe
    fields = {f.name: f for f in columns_of(getattr(snapshot_module, table))}
    columns = tables[table]["columns"]
    for name in [n for n in columns if not fields[n].required]:
        del columns[name]
    tracemalloc.start()
    try:
        try:
            loads(json.dumps(data), "lying.json")
            error = None
        except BundleError as exc:
            error = exc
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, f"{table} rows={rows}: {peak >> 20} MB"
    if rows != honest:
        assert error is not None and table in str(error), error
