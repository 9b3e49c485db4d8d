"""An attacker on the same machine, and a client on loopback without the right token, against a real agent.

Each case here once stalled the agent, leaked a file's bytes, let a token do
more than its role, or ended in a traceback. Agents are real ``rankscope
agent`` processes (tests/agent_helpers.py); one agent reads a counter
directory full of traps (with a rank of its own so every trap reaches a
client), one serves actions and the raw requests, one runs under a low
descriptor limit. Memory is read from /proc (the agent's VmHWM, its peak RSS).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from agent_helpers import PY, START_TIMEOUT_S, AgentProcess, Processes, clean_env, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rankscope.actions.agent_protocol import Confirmation
from rankscope.actions.model import (
    ActionKind,
    ActionRequest,
    ActionResult,
    ActionState,
    EvictArgs,
    HotUpdateArgs,
    Targets,
    VersionSource,
)
from rankscope.ccl_plugin import layout as L
from rankscope.contract.bundle import BundleError, loads
from rankscope.contract.errors import RankscopeError
from rankscope.probes import ccl_counters
from rankscope.probes.ccl_counters import list_counter_files, read_counter_file
from rankscope.wire.access import token_fingerprint
from rankscope.wire.action_messages import confirmation_to_proto, event_from_proto, request_to_proto
from rankscope.wire.client import JobClient
from rankscope.wire.fanout import auth_metadata
from rankscope.wire.limits import MAX_REQUEST_BYTES, checked_number
from rankscope.wire.proto import rankscope_pb2 as pb
from rankscope.wire.proto import rankscope_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(120)

READ = "read-abuse-0123456789abcdef01234"
ACT = "act-abuse-0123456789abcdef012345"
SECRET = b"S3CR3T!!"
CALL_S = 15.0  # a deadline on every call: a stalled agent fails the test instead of hanging it


@dataclass
class World:
    folder: Path
    procs: Processes
    counters: AgentProcess  # reads the trapped counter directory
    actions: AgentProcess  # serves actions; takes the raw requests
    counter_dir: Path
    versions: Path
    current: Path
    outside: Path  # a directory beside the versions, outside every prepared root


def _planted(counter_dir: Path, secret: Path) -> None:
    """A FIFO, a link to another file and random bytes, each named like rank 0's counter file."""
    os.mkfifo(counter_dir / "job-fifo.rank0.ccl")
    os.symlink(secret, counter_dir / "job-link.rank0.ccl")
    noise = bytearray(os.urandom(L.HEADER_SIZE + 4096))
    noise[L.HEADER_SEQ_OFFSET] |= 1  # an odd seqlock: the old reader spun on it for 0.2 s a capture
    (counter_dir / "job-rand.rank0.ccl").write_bytes(bytes(noise))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    folder = tmp_path_factory.mktemp("abuse")
    procs = Processes(folder)
    try:
        tokens = folder / "tokens"
        tokens.write_text(f"read:{READ}\nact:{ACT}\n")
        tokens.chmod(0o600)
        secret = folder / "secret.txt"
        secret.write_bytes(SECRET + b"." * (L.HEADER_SIZE + 64))
        counter_dir = folder / "counters"
        counter_dir.mkdir(mode=0o700)
        _planted(counter_dir, secret)
        run_id = f"rankscope-abuse-{uuid.uuid4().hex[:12]}"
        procs.rank(0, 1, run_id=run_id)
        counters = procs.agent("trapped", "--run-id", run_id, "--counter-dir", str(counter_dir),
                               token_file=tokens)

        versions, outside = folder / "versions", folder / "evil_code"
        (versions / "v1").mkdir(parents=True)
        (versions / "v2").mkdir()
        outside.mkdir()
        current = folder / "job" / "code"
        current.parent.mkdir()
        os.symlink(versions / "v1", current)
        os.symlink(outside, versions / "sneaky")  # a link under the root that leads out of it
        config = folder / "actions.toml"
        config.write_text(f'[hot_update]\ncurrent = "{current}"\nversions_dir = "{versions}"\n')
        empty = folder / "empty-counters"
        empty.mkdir(mode=0o700)
        actions = procs.agent("acting", "--run-id", f"nobody-{run_id}", "--counter-dir", str(empty),
                              "--state-dir", str(folder / "state"), "--actions-config", str(config),
                              token_file=tokens)
        yield World(folder, procs, counters, actions, counter_dir, versions, current, outside)
    finally:
        procs.close()


def _stub(address: str, **options: int) -> tuple[grpc.aio.Channel, pb_grpc.RankscopeAgentStub]:
    channel = grpc.aio.insecure_channel(address, options=list(options.items()))
    return channel, pb_grpc.RankscopeAgentStub(channel)  # type: ignore[no-untyped-call]


def _rss_peak_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")


# ---- counter files: FIFO, link, random bytes ------------------------------------------------------------


async def test_trapped_counter_files_are_refused_and_the_agent_keeps_answering(world: World) -> None:
    channel, stub = _stub(world.counters.address)
    async with channel:
        for _ in range(3):  # each reading once left a worker stuck in open() on the FIFO
            reply = await stub.Describe(pb.DescribeRequest(), metadata=auth_metadata(READ), timeout=CALL_S)
        (rank0,) = [c for c in reply.counters if c.rank == 0]
    error = rank0.error
    assert "not a regular file" in error, error  # the FIFO
    assert "symbolic link" in error, error
    assert "not a rankscope counter file" in error and "mid-update" not in error, error
    assert "S3CR3T" not in error and "b'" not in error, "a refusal echoed a file's bytes"
    log = world.counters.log_text()
    assert log.count("job-fifo.rank0.ccl is refused") == 1, log  # said once, not every reading
    assert "delete it" in log


def test_a_counter_directory_others_can_write_is_refused_once(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # the way another local user would leave /dev/shm/rankscope for us to find
    (shared / "job.rank0.ccl").write_bytes(b"\0" * L.HEADER_SIZE)
    assert list_counter_files(shared) == () and list_counter_files(shared) == ()
    err = capsys.readouterr().err
    assert err.count("can be written by other users (mode 777)") == 1, err
    assert ccl_counters.DIR_FIX in err


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory another user's needs root")
def test_a_counter_directory_of_another_user_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    (theirs / "job.rank0.ccl").write_bytes(b"\0" * L.HEADER_SIZE)
    os.chown(theirs, 54321, 54321)
    assert list_counter_files(theirs, frozenset({os.geteuid()})) == ()
    assert "belongs to uid 54321" in capsys.readouterr().err


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=64) | st.binary(min_size=L.HEADER_SIZE, max_size=L.HEADER_SIZE + 256))
def test_any_bytes_in_a_counter_file_give_an_error_never_an_exception_or_the_bytes(tmp_path: Path,
                                                                                   data: bytes) -> None:
    path = tmp_path / "fuzz.rank3.ccl"
    path.write_bytes(data)
    started = time.monotonic()
    got = read_counter_file(path).counters
    if not data.startswith(L.MAGIC):
        assert got.error is not None and got.rank == 3
        assert time.monotonic() - started < ccl_counters.SEQLOCK_PATIENCE_S, "spun on a file that is not ours"
        assert len(data) < 8 or repr(data[:8]) not in got.error, "the error echoed the file's first bytes"


# ---- limits before the token check ------------------------------------------------------------------------


async def test_tokenless_oversized_requests_in_parallel_leave_memory_bounded(world: World) -> None:
    pid = world.actions.proc.pid
    before = _rss_peak_kb(pid)
    size_mb = int(os.environ.get("RANKSCOPE_ABUSE_REQUEST_MB", "20"))  # the README's figure: 60
    blob = pb.DescribeRequest(relayed_since={"x" * (size_mb * 1024 * 1024): 1}).SerializeToString()
    channel = grpc.aio.insecure_channel(world.actions.address, options=[("grpc.max_send_message_length", 64 << 20)])
    async with channel:
        describe = channel.unary_unary("/rankscope.v1.RankscopeAgent/Describe")  # bytes in, bytes out

        async def one() -> grpc.StatusCode:
            try:
                await describe(blob, timeout=CALL_S)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

        codes = await asyncio.gather(*(one() for _ in range(8)))
    after = _rss_peak_kb(pid)
    print(f"agent peak RSS {before / 1024:.0f} MB before, {after / 1024:.0f} MB after 8 parallel token-less "
          f"{size_mb} MB requests")  # the README's figure (pytest -s)
    # refused for want of a token before gRPC reads the message (its length would refuse it unread as well)
    assert set(codes) <= {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    grown_mb = (after - before) / 1024
    assert grown_mb < 64, f"the agent's peak RSS grew {grown_mb:.0f} MB for 8 refused requests"
    channel, stub = _stub(world.actions.address)
    async with channel:
        await stub.Describe(pb.DescribeRequest(), metadata=auth_metadata(READ), timeout=CALL_S)


def test_the_request_limit_fits_the_largest_real_requests() -> None:
    """A whole-job eviction of 16,384 machines, and a relay's Describe naming 8,192 agents' versions (relays have
    tens): the limit must not refuse a real job."""
    names = [f"gpu-node-{i:05d}" for i in range(16384)]
    evict = ActionRequest("evict-all", ActionKind.EVICT, Targets(names[:1], tuple(range(8))),
                          EvictArgs("x" * 500, tuple(names[1:])), "someone@login-node-01")
    run = pb.RunActionRequest(request=request_to_proto(evict),
                              confirmation=confirmation_to_proto(Confirmation(tuple(names[:1]), tuple(range(8)),
                                                                              "evict " + names[0])))
    relayed = pb.DescribeRequest(sample_hz=2.0, since=2**63)
    for i in range(8192):
        relayed.relayed_since[f"{names[i]}.cluster.example.org:50051"] = 2**63
    assert run.ByteSize() < MAX_REQUEST_BYTES and relayed.ByteSize() < MAX_REQUEST_BYTES


async def test_idle_connections_under_a_low_descriptor_limit_do_not_lock_out_a_client(tmp_path: Path) -> None:
    procs = Processes(tmp_path)
    tokens = tmp_path / "tokens"
    tokens.write_text(f"read:{READ}\n")
    tokens.chmod(0o600)
    port_file = tmp_path / "low.port"
    # RLIMIT_NOFILE is set in a shim that then execs the agent (no preexec_fn: this process runs gRPC threads).
    shim = ("import os, resource, sys\nresource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))\n"
            "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])\n")
    log = tmp_path / "low.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([PY, "-c", shim, "-m", "rankscope", "agent", "--port", "0", "--port-file",
                                 str(port_file), "--machine-name", "low", "--token-file", str(tokens),
                                 "--run-id", "nobody", "--counter-dir", str(tmp_path / "c")],
                                stdout=out, stderr=subprocess.STDOUT, env=clean_env(), start_new_session=True)
    procs.started.append(proc)
    idle: list[socket.socket] = []
    try:
        wait_for(port_file.exists, START_TIMEOUT_S, "the agent under a low descriptor limit to start")
        address = f"127.0.0.1:{int(port_file.read_text())}"
        for _ in range(150):  # more than its descriptors: connect and say nothing, ever
            sock = socket.create_connection(("127.0.0.1", int(port_file.read_text())))
            idle.append(sock)
        channel, stub = _stub(address, **{"grpc.initial_reconnect_backoff_ms": 200,
                                          "grpc.min_reconnect_backoff_ms": 200,
                                          "grpc.max_reconnect_backoff_ms": 500})
        async with channel:
            await stub.Describe(pb.DescribeRequest(), metadata=auth_metadata(READ), timeout=20.0,
                                wait_for_ready=True)
        assert proc.poll() is None, log.read_text()
    finally:
        for sock in idle:
            sock.close()
        procs.close()


# ---- numbers from the wire ------------------------------------------------------------------------------


@pytest.mark.parametrize("call", ["describe_inf_hz", "capture_nan_timeout"])
async def test_non_finite_numbers_are_refused_by_name(world: World, call: str) -> None:
    channel, stub = _stub(world.actions.address)
    meta = auth_metadata(READ)
    async with channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            if call == "describe_inf_hz":
                await stub.Describe(pb.DescribeRequest(sample_hz=float("inf")), metadata=meta, timeout=CALL_S)
            else:
                await stub.Capture(pb.CaptureRequest(timeout_s=float("nan")), metadata=meta, timeout=CALL_S)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    field = {"describe_inf_hz": "sample_hz", "capture_nan_timeout": "timeout_s"}[call]
    assert field in (err.value.details() or "")
    assert "Traceback" not in world.actions.log_text()


@given(st.floats(allow_nan=True, allow_infinity=True), st.floats(-1e6, 1e6), st.floats(0, 1e6))
def test_a_number_from_the_wire_is_finite_and_in_range_or_refused(value: float, low: float, span: float) -> None:
    high = low + span
    try:
        got = checked_number(value, "x", low, high)
    except RankscopeError as exc:
        assert "x must be a number" in exc.message and exc.fix
        assert not (low <= value <= high)  # NaN compares false: refused too
    else:
        assert got == value and low <= got <= high


# ---- actions confined to the configuration -------------------------------------------------------------


def _hot_update(action_id: str, directory: str) -> ActionRequest:
    return ActionRequest(action_id, ActionKind.HOT_UPDATE, Targets(), HotUpdateArgs(VersionSource.DIR, directory),
                         "alice")


async def _plan_error(stub: pb_grpc.RankscopeAgentStub, request: ActionRequest, token: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.PlanAction(request_to_proto(request), metadata=auth_metadata(token), timeout=CALL_S)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value
    return err.value.details() or ""


async def test_hot_update_directories_outside_the_roots_are_refused(world: World) -> None:
    escapes = [f"{world.versions}/../evil_code", str(world.outside), "/etc", "/", f"{world.versions}/sneaky"]
    channel, stub = _stub(world.actions.address)
    async with channel:
        for i, path in enumerate(escapes):
            assert "not under this agent's prepared roots" in await _plan_error(stub, _hot_update(f"e-{i}", path),
                                                                                 ACT), path
        # Run without a plan, with a confirmation of this machine: the agent plans again and refuses.
        run = pb.RunActionRequest(request=request_to_proto(_hot_update("e-run", escapes[0])),
                                  confirmation=confirmation_to_proto(Confirmation(("acting",))))
        events = [event_from_proto(e) async for e in stub.RunAction(run, metadata=auth_metadata(ACT),
                                                                      timeout=CALL_S)]
    (result,) = [e for e in events if isinstance(e, ActionResult)]
    assert result.state == ActionState.REFUSED, result
    assert os.readlink(world.current) == str(world.versions / "v1"), "the job's code link moved"


async def test_a_read_token_cannot_ask_whether_a_path_exists(world: World) -> None:
    home = world.folder / "home" / ".ssh"
    home.mkdir(parents=True)
    channel, stub = _stub(world.actions.address)
    async with channel:
        there = await _plan_error(stub, _hot_update("q-1", str(home)), READ)
        absent = await _plan_error(stub, _hot_update("q-2", str(world.folder / "home" / ".nothing")), READ)
    assert there.replace(str(home), "P") == absent.replace(str(world.folder / "home" / ".nothing"), "P")


async def test_the_audit_log_names_the_token_not_only_the_claimed_requester(world: World) -> None:
    channel, stub = _stub(world.actions.address)
    async with channel:
        # An eviction of a machine this agent is not: refused, and the refusal is audited.
        request = ActionRequest("who-1", ActionKind.EVICT, Targets(("elsewhere",)), EvictArgs("test"), "alice")
        run = pb.RunActionRequest(request=request_to_proto(request),
                                  confirmation=confirmation_to_proto(Confirmation(("elsewhere",))))
        async for _ in stub.RunAction(run, metadata=auth_metadata(ACT), timeout=CALL_S):
            pass
        watch = stub.WatchAudit(pb.WatchAuditRequest(after_seq=0), metadata=auth_metadata(READ), timeout=CALL_S)
        async for record in watch:
            if record.action_id == "who-1":
                break
        watch.cancel()
    assert record.who == f"alice (act token {token_fingerprint(ACT)})", record.who
    assert ACT not in record.who


async def test_a_read_tokens_refused_run_shows_as_refused_not_unknown(world: World) -> None:
    request = _hot_update("ro-1", str(world.versions / "v2"))
    async with JobClient([world.actions.address], READ, acting=True) as client:
        await client.plan_action(request)  # planning is allowed with a read token
        updates = [u async for u in client.run_action(request, Confirmation(("acting",)))]
    (result,) = [u.event for u in updates if isinstance(u.event, ActionResult)]
    assert result.state == ActionState.REFUSED and "nothing was done" in result.message, result
    assert "unknown" not in result.message
    assert os.readlink(world.current) == str(world.versions / "v1")


# ---- outside files: deep and huge JSON -----------------------------------------------------------------


@pytest.mark.parametrize("body", ["deep", "digits"])
def test_rankscope_analyze_refuses_deep_and_huge_json_without_a_traceback(tmp_path: Path, body: str) -> None:
    inner = "[" * 100_000 + "]" * 100_000 if body == "deep" else "1" * 5000
    bundle = tmp_path / f"{body}.json"
    bundle.write_text(f'{{"format": "rankscope.bundle", "version": 4, "snapshots": [{inner}]}}')
    run = subprocess.run([PY, "-m", "rankscope", "analyze", str(bundle)], capture_output=True, text=True,
                         env=clean_env(), timeout=60, check=False)
    assert run.returncode != 0
    assert "Traceback" not in run.stderr, run.stderr
    assert "not a rankscope bundle" in run.stderr, run.stderr


@settings(max_examples=80, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                max_size=4), max_leaves=30))
def test_any_json_as_a_bundle_is_a_bundle_error_or_a_bundle(value: object) -> None:
    import json

    text = json.dumps({"format": "rankscope.bundle", "version": 4, "snapshots": value})
    with contextlib.suppress(BundleError):  # anything else (a traceback) fails the test
        loads(text, "fuzz")


# ---- SIGTERM while a worker is stuck -----------------------------------------------------------------------


def test_sigterm_stops_the_agent_while_a_worker_is_busy(tmp_path: Path) -> None:
    """A worker thread busy for minutes: an eviction whose site script takes ten (the old agent waited for it)."""
    procs = Processes(tmp_path)
    try:
        started = tmp_path / "script-started"
        script = tmp_path / "evict.sh"
        script.write_text(f"#!/bin/sh\ntouch {started}\nsleep 600\n")
        script.chmod(0o755)
        config = tmp_path / "actions.toml"
        config.write_text(f'[eviction]\nbackend = "command"\n[eviction.command]\nscript = "{script}"\n'
                          "timeout_s = 600\n")
        tokens = tmp_path / "tokens"
        tokens.write_text(f"act:{ACT}\n")
        tokens.chmod(0o600)
        agent = procs.agent("busy", "--run-id", "nobody", "--counter-dir", str(tmp_path / "c"),
                            "--state-dir", str(tmp_path / "state"), "--actions-config", str(config),
                            token_file=tokens)
        request = ActionRequest("busy-1", ActionKind.EVICT, Targets(("busy",)), EvictArgs("test"), "alice")

        async def run_until_the_script_runs() -> None:
            channel, stub = _stub(agent.address)
            async with channel:
                plan = await stub.PlanAction(request_to_proto(request), metadata=auth_metadata(ACT), timeout=CALL_S)
                confirm = Confirmation(tuple(plan.machines), (), plan.confirm_phrase)
                run = pb.RunActionRequest(request=request_to_proto(request),
                                          confirmation=confirmation_to_proto(confirm))
                # no deadline on the stream: the action streams nothing while its script sleeps, so the
                # file the script touches (not the stream) says when it runs
                stream = stub.RunAction(run, metadata=auth_metadata(ACT))

                async def drain() -> None:
                    async for _ in stream:
                        pass

                reader = asyncio.ensure_future(drain())
                try:
                    await asyncio.to_thread(wait_for, started.exists, 4 * CALL_S, "the site script to start")
                finally:
                    stream.cancel()
                    with contextlib.suppress(asyncio.CancelledError, grpc.RpcError):
                        await reader

        asyncio.run(run_until_the_script_runs())
        began = time.monotonic()
        agent.proc.send_signal(signal.SIGTERM)
        try:
            agent.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the agent did not stop within 20 s of SIGTERM:\n{agent.log_text()}")
        assert time.monotonic() - began < 20
        assert "exiting without waiting" in agent.log_text()
    finally:
        procs.close()


async def test_a_fifo_as_the_standby_list_refuses_the_plan_instead_of_stalling(tmp_path: Path) -> None:
    """The standby list is read on every plan, a read token's call: a FIFO there held a worker for good."""
    procs = Processes(tmp_path)
    try:
        fifo = tmp_path / "standbys.json"
        os.mkfifo(fifo)
        config = tmp_path / "actions.toml"
        config.write_text(f'[eviction.local]\nstandbys_file = "{fifo}"\n')
        tokens = tmp_path / "tokens"
        tokens.write_text(f"read:{READ}\n")
        tokens.chmod(0o600)
        agent = procs.agent("fifo", "--run-id", "nobody", "--counter-dir", str(tmp_path / "c"),
                            "--state-dir", str(tmp_path / "state"), "--actions-config", str(config),
                            token_file=tokens)
        request = ActionRequest("fifo-1", ActionKind.EVICT, Targets(("fifo",)), EvictArgs("test"), "alice")
        channel, stub = _stub(agent.address)
        async with channel:
            plan = await stub.PlanAction(request_to_proto(request), metadata=auth_metadata(READ), timeout=CALL_S)
        assert any("not a regular file" in w for w in plan.warnings), plan.warnings
        assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    finally:
        procs.close()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
