"""The node agent over real gRPC on loopback: tokens, bind address, health, RPCs, shutdown."""

from __future__ import annotations

import asyncio
import ipaddress
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import psutil
import pytest
from agent_helpers import RANK_FUNCTION, Processes, clean_env, make_token_file
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rankscope.contract.errors import RankscopeError
from rankscope.contract.snapshot import ProcessRole
from rankscope.wire.access import bearer_token
from rankscope.wire.agent import AgentConfig, RunningAgent, check_config, is_loopback, start_agent
from rankscope.wire.proto import rankscope_pb2 as pb
from rankscope.wire.proto import rankscope_pb2_grpc as pb_grpc
from rankscope.wire.snapshot_codec import machine_from_proto
from rankscope.wire.tokens import Role, TokenSet, load_client_token, load_tokens, parse_tokens

pytestmark = pytest.mark.timeout(120)

TOKEN = "0123456789abcdef0123456789abcdef"
OTHER = "fedcba9876543210fedcba9876543210"


@pytest.fixture
async def agent() -> AsyncIterator[RunningAgent]:
    """An in-process agent on a free loopback port, scoped to a run id nobody uses (no ranks)."""
    config = AgentConfig(tokens=parse_tokens(TOKEN, "test"), port=0, machine_name="unit", run_id="no-such-run-h2")
    running = await start_agent(config)
    try:
        yield running
    finally:
        await running.stop(0)


async def test_a_restarted_agent_takes_its_port_once_the_predecessor_lets_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """A successor on the same fixed port waits for it instead of failing (a drill's restart hit this)."""
    import rankscope.wire.agent as agent_module

    first = await start_agent(AgentConfig(tokens=parse_tokens(TOKEN, "test"), port=0, run_id="no-such-run-h2"))
    attempts: list[int] = []
    tried_again = asyncio.Event()
    made_options = agent_module.server_options

    def counted(relays: int = 0) -> list[tuple[str, int]]:  # one call per server the agent makes to bind
        attempts.append(relays)
        if len(attempts) >= 2:
            tried_again.set()
        return made_options(relays)

    monkeypatch.setattr(agent_module, "server_options", counted)
    successor = asyncio.create_task(start_agent(
        AgentConfig(tokens=parse_tokens(TOKEN, "test"), port=first.port, run_id="no-such-run-h2")))
    try:
        await asyncio.wait({successor, asyncio.create_task(tried_again.wait())}, return_when=asyncio.FIRST_COMPLETED)
        assert not successor.done(), f"the successor gave up while the port was still held: {successor.exception()}"
    finally:
        await first.stop(0)
    second = await successor
    try:
        assert second.port == first.port
        async with grpc.aio.insecure_channel(second.address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await second.stop(0)


async def test_a_port_another_agent_keeps_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    import rankscope.wire.agent as agent_module

    monkeypatch.setattr(agent_module, "BIND_RETRY_S", 0.0)
    first = await start_agent(AgentConfig(tokens=parse_tokens(TOKEN, "test"), port=0, run_id="no-such-run-h2"))
    try:
        with pytest.raises(RankscopeError) as refused:
            await start_agent(AgentConfig(tokens=parse_tokens(TOKEN, "test"), port=first.port, run_id="no-such-run-h2"))
        assert f":{first.port}" in refused.value.message and "--port 0" in refused.value.fix
    finally:
        await first.stop(0)


def _stub(channel: grpc.aio.Channel) -> pb_grpc.RankscopeAgentStub:
    return pb_grpc.RankscopeAgentStub(channel)


# ---- the token ------------------------------------------------------------


async def test_describe_without_a_token_is_refused(agent: RunningAgent) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{agent.port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _stub(channel).Describe(pb.DescribeRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "no token" in (err.value.details() or "")


async def test_a_wrong_token_is_refused_on_every_rpc(agent: RunningAgent) -> None:
    bad = (("authorization", f"Bearer {OTHER}"),)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{agent.port}") as channel:
        stub = _stub(channel)
        for call in (
            stub.Describe(pb.DescribeRequest(), metadata=bad, timeout=10),
            stub.Capture(pb.CaptureRequest(), metadata=bad, timeout=10),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_the_right_token_gets_a_machine_snapshot(agent: RunningAgent) -> None:
    good = (("authorization", f"Bearer {TOKEN}"),)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{agent.port}") as channel:
        reply = await _stub(channel).Describe(pb.DescribeRequest(), metadata=good, timeout=20)
    snap = machine_from_proto(reply)
    assert snap.machine == "unit" and snap.reachable
    assert snap.ranks == ()  # the run id matches nothing
    assert snap.host is not None and snap.host.cpu_count is not None and snap.host.cpu_count >= 1
    assert snap.stacks == ()


async def test_health_answers_serving_without_a_token(agent: RunningAgent) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{agent.port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "rankscope.v1.RankscopeAgent"):
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_a_method_not_listed_needs_the_act_role() -> None:
    """An RPC added later (an action) is protected even if nobody lists it in METHOD_ROLES."""
    method = "/rankscope.v1.RankscopeAgent/SomeFutureAction"

    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return b"done:" + request

    def register(server: grpc.aio.Server) -> None:
        handler = grpc.unary_unary_rpc_method_handler(echo)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("rankscope.v1.RankscopeAgent", {"SomeFutureAction": handler}),)
        )

    tokens = parse_tokens(f"read:{TOKEN}\nact:{OTHER}\n", "test")
    running = await start_agent(AgentConfig(tokens=tokens, port=0, run_id="no-such-run-h2"), extra_services=[register])
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            call = channel.unary_unary(method)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(b"x", metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=10)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "'act' role" in (err.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(b"x", timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert await call(b"x", metadata=(("authorization", f"Bearer {OTHER}"),), timeout=10) == b"done:x"
            # the read-only token still reads
            reply = await _stub(channel).Describe(
                pb.DescribeRequest(), metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=20)
            assert reply.machine
    finally:
        await running.stop(0)


def test_token_roles_and_constant_time_check() -> None:
    tokens = parse_tokens(f"# ops team\nread:{TOKEN}\nact:{OTHER}\n", "tokens")
    assert tokens.role_of(TOKEN) is Role.READ
    assert tokens.role_of(OTHER) is Role.ACT
    assert tokens.role_of(TOKEN[:-1]) is None and tokens.role_of(None) is None and tokens.role_of("") is None
    assert tokens.allows(TOKEN, Role.READ) and not tokens.allows(TOKEN, Role.ACT)
    assert tokens.allows(OTHER, Role.ACT) and tokens.allows(OTHER, Role.READ)
    # a bare token grants everything (today's one-token setup)
    assert parse_tokens(TOKEN, "t").role_of(TOKEN) is Role.ACT
    assert TOKEN not in repr(tokens)  # secrets never reach a log line


def test_token_file_errors_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(RankscopeError) as err:
        load_tokens(tmp_path / "missing")
    assert "does not exist" in err.value.message and "secrets.token_hex" in err.value.fix
    for text, expected in (("short", "at least 16"), ("admin:" + TOKEN, "unknown token role"), ("# only a comment\n", "no token")):
        with pytest.raises(RankscopeError) as err:
            parse_tokens(text, "f")
        assert expected in err.value.message, text
    assert load_tokens(None, env={}) is None
    assert load_tokens(None, env={"RANKSCOPE_TOKEN": TOKEN}) == TokenSet(parse_tokens(TOKEN, "x").tokens)
    # the client picks a token whose role covers the call
    f = tmp_path / "client-token"
    f.write_text(f"read:{TOKEN}\nact:{OTHER}\n")
    assert load_client_token(f) == TOKEN
    assert load_client_token(f, role=Role.ACT) == OTHER


def test_bearer_token_parsing() -> None:
    assert bearer_token((("authorization", f"Bearer {TOKEN}"),)) == TOKEN
    assert bearer_token((("Authorization", f"bearer  {TOKEN} "),)) == TOKEN
    assert bearer_token((("authorization", f"Basic {TOKEN}"),)) is None
    assert bearer_token(()) is None and bearer_token(None) is None


def test_unsafe_configs_are_refused() -> None:
    with pytest.raises(RankscopeError) as err:
        check_config(AgentConfig(tokens=None))
    assert "no token configured" in err.value.message and "--token-file" in err.value.fix
    with pytest.raises(RankscopeError) as err:
        check_config(AgentConfig(tokens=None, insecure_no_token=True, bind="0.0.0.0"))
    assert "loopback" in err.value.message
    check_config(AgentConfig(tokens=None, insecure_no_token=True))  # loopback without a token: allowed when asked
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")


# ---- the real command --------------------------------------------------------


def test_agent_refuses_to_start_without_a_token() -> None:
    proc = subprocess.run([sys.executable, "-m", "rankscope", "agent", "--port", "0"], env=clean_env(),
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2
    assert "no token configured" in proc.stderr and "fix:" in proc.stderr
    assert "Traceback" not in proc.stderr


def _plain_ip(ip: str) -> str:
    addr = ipaddress.ip_address(ip)
    mapped = addr.ipv4_mapped if isinstance(addr, ipaddress.IPv6Address) else None
    return str(mapped or addr)


def _non_loopback_addresses() -> list[str]:
    return [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback]


def test_agent_listens_on_loopback_only_by_default_and_stops_on_sigterm(procs: Processes, tmp_path: Path) -> None:
    _token, token_file = make_token_file(tmp_path)
    agent = procs.agent("m0", token_file=token_file)
    listening = [c.laddr for c in psutil.Process(agent.proc.pid).net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN]
    assert listening, "the agent listens on nothing"
    # gRPC may listen on a dual-stack socket, shown as the v4-mapped ::ffff:127.0.0.1
    assert {_plain_ip(addr.ip) for addr in listening} == {"127.0.0.1"}
    assert {addr.port for addr in listening} == {agent.port}
    for other in _non_loopback_addresses():  # and from this machine's other addresses nobody gets in
        with pytest.raises(OSError):
            socket.create_connection((other, agent.port), timeout=5).close()
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(timeout=30) == 0
    assert "stopping" in agent.log_text() and "Traceback" not in agent.log_text()


def test_captures_that_ask_for_sampling_start_it_and_bring_its_windows(procs: Processes, tmp_path: Path) -> None:
    """A client that samples and takes stack rounds: its Captures carry sample_hz as its polls do.

    The watch's stack rounds can follow each other for longer than the
    sampler's lease on a loaded machine (each round's dumps taking about as
    long as the interval); if only Describe renewed it, sampling lapsed there.
    Here only Captures are sent: the first one without sample_hz starts
    nothing, then captures alone start the sampler and bring its windows.
    """
    token, token_file = make_token_file(tmp_path)
    rank = procs.rank(1, 2, threads=2, depth=3)
    agent = procs.agent("s1", "--run-id", rank.run_id, token_file=token_file)

    async def go() -> tuple[pb.MachineSnapshot, pb.MachineSnapshot, int]:
        async with grpc.aio.insecure_channel(agent.address) as channel:
            md = (("authorization", f"Bearer {token}"),)
            plain = await _stub(channel).Capture(pb.CaptureRequest(timeout_s=20), metadata=md, timeout=60)
            for calls in range(1, 61):  # a window ends every 5 s; under load, later
                reply = await _stub(channel).Capture(pb.CaptureRequest(timeout_s=20, sample_hz=5), metadata=md,
                                                     timeout=60)
                if reply.samples:
                    return plain, reply, calls
                await asyncio.sleep(1)  # the next capture, as a watch's next round (not a synchronisation)
            raise AssertionError("no sampled window in 60 captures that asked for sampling")

    plain, reply, _ = asyncio.run(go())
    assert not machine_from_proto(plain).samples
    snap = machine_from_proto(reply)
    assert snap.stacks and snap.stacks[0].main.error is None  # still a capture
    w = snap.samples[0]
    assert (w.rank, w.pid, w.error) == (1, rank.proc.pid, None) and w.samples > 0


def test_agent_captures_a_real_ranks_stack(procs: Processes, tmp_path: Path) -> None:
    token, token_file = make_token_file(tmp_path)
    rank = procs.rank(3, 4, threads=2, depth=5)
    agent = procs.agent("m1", "--run-id", rank.run_id, token_file=token_file)

    async def go() -> pb.MachineSnapshot:
        async with grpc.aio.insecure_channel(agent.address) as channel:
            md = (("authorization", f"Bearer {token}"),)
            return await _stub(channel).Capture(pb.CaptureRequest(timeout_s=20), metadata=md, timeout=60)

    snap = machine_from_proto(asyncio.run(go()))
    assert [(r.rank, r.world_size, r.pid, r.run_id) for r in snap.ranks] == [(3, 4, rank.proc.pid, rank.run_id)]
    (stacks,) = snap.stacks
    assert stacks.rank == 3 and stacks.main.pid == rank.proc.pid and stacks.main.role is ProcessRole.MAIN
    assert stacks.main.error is None and stacks.main.threads is not None
    parked = [t for t in stacks.main.threads if any(f.name == RANK_FUNCTION for f in t.frames)]
    assert len(parked) == 2  # the two parked threads (the main thread waits at module level)
    assert all(sum(f.name == RANK_FUNCTION for f in t.frames) == 6 for t in parked)  # depth 5 + the bottom call
