"""TLS between clients and agents, over real gRPC, with certificates made in the test.

Covers: TLS and mutual TLS work; a wrong CA, an expired certificate, a
missing client certificate, a plaintext client against a TLS agent and a TLS
client against a plaintext agent each fail with words naming the fix; an
agent bound beyond loopback refuses to start without TLS unless --insecure.
"""

from __future__ import annotations

import datetime as dt
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from agent_helpers import PY, clean_env
from hypothesis import given
from hypothesis import strategies as st
from rankscope.contract.errors import RankscopeError
from rankscope.contract.snapshot import MachineSnapshot
from rankscope.wire import tls
from rankscope.wire.agent import AgentConfig, RunningAgent, check_config, start_agent
from rankscope.wire.client import JobClient
from rankscope.wire.tokens import parse_tokens

TOKEN = "tls0123456789abcdef0123456789abcd"
LONG_AGO = dt.datetime.now(dt.UTC) - dt.timedelta(days=30)


@asynccontextmanager
async def agent_with(server: tls.ServerTLS | None) -> AsyncIterator[RunningAgent]:
    agent = await start_agent(AgentConfig(tokens=parse_tokens(TOKEN, "test"), port=0, tls=server,
                                          machine_name="m-tls"))
    try:
        yield agent
    finally:
        await agent.stop(0)


async def describe(agent: RunningAgent, client: tls.ClientTLS | None) -> MachineSnapshot:
    async with JobClient([f"127.0.0.1:{agent.port}"], TOKEN, tls=client, deadline_s=20) as c:
        (machine,) = (await c.describe()).machines
    return machine


@pytest.fixture(scope="module")
def session() -> tls.Session:
    return tls.make_session()


async def test_tls_and_mutual_tls_serve_a_client_with_the_right_certificates(session: tls.Session) -> None:
    async with agent_with(session.server_tls(mutual=False)) as agent:
        machine = await describe(agent, session.client_tls(mutual=False))
        assert machine.reachable and machine.machine == "m-tls"
    async with agent_with(session.server_tls(mutual=True)) as agent:
        machine = await describe(agent, session.client_tls(mutual=True))
        assert machine.reachable and machine.machine == "m-tls"


async def test_a_wrong_ca_is_named_with_the_fix(session: tls.Session) -> None:
    other = tls.make_session()
    async with agent_with(session.server_tls(mutual=False)) as agent:
        machine = await describe(agent, other.client_tls(mutual=False))
    assert not machine.reachable and machine.error is not None
    assert "TLS/handshake failure" in machine.error.message and "not signed by the --tls-ca" in machine.error.message
    assert "--tls-ca" in machine.error.fix


async def test_an_expired_agent_certificate_is_named_and_refused_at_load(tmp_path: Path) -> None:
    ca = tls.make_ca()
    old = tls.issue(ca, "agent", (tls.SESSION_SERVER_NAME,), days=1, now=LONG_AGO)
    async with agent_with(tls.ServerTLS(old.cert_pem, old.key_pem)) as agent:
        machine = await describe(agent, tls.ClientTLS(ca.cert_pem, server_name=tls.SESSION_SERVER_NAME))
    assert machine.error is not None and "certificate has expired" in machine.error.message
    assert "issue a new certificate" in machine.error.fix
    # Loading it for an agent refuses it before anything listens, saying when it expired and what to do.
    cert, key = tmp_path / "agent.pem", tmp_path / "agent.key"
    cert.write_bytes(old.cert_pem)
    tls.write_private(key, old.key_pem)
    with pytest.raises(RankscopeError, match=r"expired on \d{4}-\d\d-\d\d") as err:
        tls.server_tls(cert, key)
    assert "issue a new certificate" in err.value.fix
    expired_ca = tmp_path / "ca.pem"
    expired_ca.write_bytes(tls.make_ca(now=LONG_AGO).cert_pem)
    with pytest.raises(RankscopeError, match="expired"):
        tls.client_tls(expired_ca)


async def test_mutual_tls_refuses_a_client_without_a_certificate(session: tls.Session) -> None:
    async with agent_with(session.server_tls(mutual=True)) as agent:
        machine = await describe(agent, session.client_tls(mutual=False))
    assert machine.error is not None and "mutual TLS" in machine.error.message
    assert "--tls-cert and --tls-key" in machine.error.fix


async def test_plaintext_against_tls_and_tls_against_plaintext_say_which_side_to_fix(session: tls.Session) -> None:
    async with agent_with(session.server_tls(mutual=False)) as agent:
        machine = await describe(agent, None)
    assert machine.error is not None and "probably serves TLS" in machine.error.message
    assert "--tls-ca" in machine.error.fix
    async with agent_with(None) as agent:
        machine = await describe(agent, session.client_tls(mutual=False))
    assert machine.error is not None and "does not speak TLS" in machine.error.message


async def test_a_name_the_certificate_does_not_list_is_named(session: tls.Session) -> None:
    async with agent_with(session.server_tls(mutual=False)) as agent:
        machine = await describe(agent, tls.ClientTLS(session.ca.cert_pem))  # checks "127.0.0.1"
    assert machine.error is not None and "does not name the address" in machine.error.message
    assert "--tls-server-name" in machine.error.fix


def test_off_loopback_needs_tls_or_an_explicit_insecure(session: tls.Session) -> None:
    tokens = parse_tokens(TOKEN, "test")
    with pytest.raises(RankscopeError, match="without TLS") as err:
        check_config(AgentConfig(tokens=tokens, bind="0.0.0.0"))
    assert "--tls-cert" in err.value.fix and "--insecure" in err.value.fix
    check_config(AgentConfig(tokens=tokens, bind="0.0.0.0", insecure=True))
    check_config(AgentConfig(tokens=tokens, bind="0.0.0.0", tls=session.server_tls()))
    check_config(AgentConfig(tokens=tokens, bind="127.0.0.1"))


def test_the_agent_command_refuses_to_listen_beyond_loopback_in_plaintext(tmp_path: Path) -> None:
    token = tmp_path / "token"
    tls.write_private(token, TOKEN.encode())
    proc = subprocess.run([PY, "-m", "rankscope", "agent", "--bind", "0.0.0.0", "--port", "0", "--token-file",
                           str(token)], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "without TLS" in proc.stderr and "--insecure" in proc.stderr


def test_bad_tls_files_are_refused_with_the_fix(tmp_path: Path, session: tls.Session) -> None:
    cert, key, other_key, junk = (tmp_path / n for n in ("c.pem", "k.pem", "o.pem", "junk.pem"))
    cert.write_bytes(session.server.cert_pem)
    tls.write_private(key, session.server.key_pem)
    tls.write_private(other_key, session.client.key_pem)
    junk.write_text("not a certificate\n")
    assert key.stat().st_mode & 0o077 == 0
    assert tls.server_tls(cert, key) is not None
    with pytest.raises(RankscopeError, match="does not belong to the certificate"):
        tls.server_tls(cert, other_key)
    with pytest.raises(RankscopeError, match="holds no PEM certificate"):
        tls.server_tls(junk, key)
    with pytest.raises(RankscopeError, match="does not exist"):
        tls.client_tls(tmp_path / "missing.pem")
    with pytest.raises(RankscopeError, match="go together"):
        tls.server_tls(cert, None)
    with pytest.raises(RankscopeError, match="need --tls-ca"):
        tls.client_tls(None, cert, key)


def test_the_agent_reads_its_session_certificates_from_the_environment(session: tls.Session) -> None:
    loaded = tls.server_tls(None, None, env=session.server_env(mutual=True))
    assert loaded is not None and loaded.client_ca_pem == session.ca.cert_pem
    assert tls.server_tls(None, None, env={}) is None
    assert "BEGIN" not in repr(loaded) and "BEGIN" not in repr(session.server)  # keys never reach a log


@given(st.binary(max_size=400))
def test_any_bytes_as_a_certificate_are_a_clear_error(data: bytes) -> None:
    try:
        tls.check_validity(data, "input")
    except RankscopeError as exc:
        assert exc.fix


@given(st.text(max_size=300), st.booleans())
def test_any_grpc_details_give_a_fix_or_nothing(details: str, using_tls: bool) -> None:
    answer = tls.handshake_problem(details, using_tls=using_tls)
    assert answer is None or (answer[0].startswith("TLS/handshake failure") and answer[1])
