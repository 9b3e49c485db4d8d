"""How long a real client waits to get into an agent that a peer without a token is trying to lock out.

A real ``rankscope agent`` process (plaintext on loopback, a token file) is
attacked by a second process, and a client with the token then calls
Describe on a fresh channel, again and again, until one call succeeds; the
time from the attack being in place to that success is printed per attack
(goal: 5 s or less), beside the same client with no attack.

Attacks (each keeps itself in place: whatever the agent closes is reopened at once):

- ``calls``: 64 token-less calls that send their headers and never their message
  (over 4 connections, 16 calls each);
- ``silent``: as many connections as the agent's open-file limit allows and more,
  each sending the HTTP/2 preface and settings and then nothing.

``--as-user UID`` runs the attacker as that user (needs root): another local
user, which is who the agent's gate tells apart on loopback.

    .venv/bin/python benchmarks/bench_lockout.py [--attacks calls,silent] [--silent 600] [--as-user 65534] [--ref main]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

TOKEN = "read-lockout-0123456789abcdef0123"
METHOD = "/rankscope.v1.RankscopeAgent/Describe"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
EMPTY_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
SETTINGS_ACK = b"\x00\x00\x00\x04\x01\x00\x00\x00\x00"
GOAL_S = 5.0


# ---- the attacks (also used by tests/integration/test_abuse.py) ---------------------------------------------------


async def hold_calls(address: str, calls: int = 64, connections: int = 4,
                     ended: list[grpc.StatusCode] | None = None) -> None:
    """Keep ``calls`` token-less calls open that never send their message; each that ends is opened again.
    ``ended``: the status of every call the agent ended, in order."""
    channels = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(connections)]
    never = asyncio.Event()

    async def silence() -> object:  # a request stream that never yields: headers go out, no message does
        await never.wait()
        yield b""  # pragma: no cover

    async def one(channel: grpc.aio.Channel) -> None:
        while True:
            call = channel.stream_unary(METHOD)(silence())
            try:
                await call
            except grpc.aio.AioRpcError as exc:
                if ended is not None:
                    ended.append(exc.code())
            await asyncio.sleep(0.01)

    try:
        await asyncio.gather(*(one(channels[i % connections]) for i in range(calls)))
    finally:
        for channel in channels:
            await channel.close(None)


async def hold_silent(host: str, port: int, count: int, closed: list[float] | None = None) -> None:
    """Keep ``count`` connections open that send the HTTP/2 preface and settings, then nothing; each one the
    agent closes is opened again at once. ``closed``: for each close, seconds since that connection opened."""

    async def one() -> None:
        while True:
            try:
                reader, writer = await asyncio.open_connection(host, port)
            except OSError:
                await asyncio.sleep(0.05)
                continue
            opened = time.monotonic()
            writer.write(PREFACE + EMPTY_SETTINGS)
            with contextlib.suppress(OSError):
                await writer.drain()
                if await reader.read(65536):  # the agent's settings, acknowledged: the handshake is over
                    writer.write(SETTINGS_ACK)
                    await writer.drain()
                while await reader.read(65536):
                    pass
            if closed is not None:
                closed.append(time.monotonic() - opened)
            writer.close()

    await asyncio.gather(*(one() for _ in range(count)))


async def time_to_get_in(address: str, token: str, limit_s: float = 60.0) -> float | None:
    """Seconds until a Describe with ``token`` on a fresh channel succeeds (None: not within ``limit_s``)."""
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        async with grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            try:
                await channel.unary_unary(METHOD)(b"", metadata=(("authorization", f"Bearer {token}"),), timeout=2.0)
                return time.monotonic() - started
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.1)
    return None


# ---- the run ----------------------------------------------------------------------------------------------------


def _attacker(argv: list[str]) -> None:
    """``--attacker KIND HOST PORT N [UID]``: run one attack until killed, saying 'ready' once it is in place."""
    kind, host, port, n = argv[0], argv[1], int(argv[2]), int(argv[3])
    if len(argv) > 4:  # another local user (the interpreter is started as root: another user may not run it)
        os.setgroups([])
        os.setgid(int(argv[4]))
        os.setuid(int(argv[4]))

    async def main() -> None:
        if kind == "calls":
            task = asyncio.create_task(hold_calls(f"{host}:{port}", n))
        else:
            task = asyncio.create_task(hold_silent(host, port, n))
        await asyncio.sleep(2.0)  # the attack's connections are open by then
        print("ready", flush=True)
        await task

    asyncio.run(main())


def _start_agent(folder: Path, base: Path | None = None) -> tuple[subprocess.Popen[bytes], int]:
    """A ``rankscope agent`` of this checkout, or (``base``) of the tree at another ref."""
    tokens = folder / "tokens"
    tokens.write_text(f"read:{TOKEN}\n")
    tokens.chmod(0o600)
    port_file = folder / "port"
    proc = subprocess.Popen([sys.executable, "-m", "rankscope", "agent", "--port", "0", "--port-file", str(port_file),
                             "--token-file", str(tokens), "--machine-name", "bench", "--run-id", "nobody",
                             "--counter-dir", str(folder / "counters")],
                            stdout=subprocess.DEVNULL, stderr=(folder / "agent.log").open("wb"),
                            start_new_session=True, env=_env(base))
    deadline = time.monotonic() + 120
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the agent did not start:\n{(folder / 'agent.log').read_text()}")
        time.sleep(0.1)
    return proc, int(port_file.read_text())


def _env(base: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    if base is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(base), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def measure(label: str, args: argparse.Namespace, base: Path | None) -> None:
    """Every attack in ``args.attacks`` against one agent (this checkout's, or ``base``'s), printed per attack."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        agent, port = _start_agent(folder, base)
        address = f"127.0.0.1:{port}"
        try:
            alone = asyncio.run(time_to_get_in(address, TOKEN))
            print(f"[{label}] no attack: client in after {alone:.2f} s" if alone is not None
                  else f"[{label}] no attack: client never in")
            for kind in args.attacks.split(","):
                n = args.calls if kind == "calls" else args.silent
                attacker = subprocess.Popen(
                    [sys.executable, __file__, "--attacker", kind, "127.0.0.1", str(port), str(n),
                     *([str(args.as_user)] if args.as_user is not None else [])],
                    stdout=subprocess.PIPE, start_new_session=True)
                try:
                    assert attacker.stdout is not None
                    attacker.stdout.readline()  # "ready"
                    took = asyncio.run(time_to_get_in(address, TOKEN, args.limit))
                finally:
                    attacker.kill()
                    attacker.wait()
                what = {"calls": f"{n} token-less calls holding their message",
                        "silent": f"{n} connections silent after the HTTP/2 handshake"}[kind]
                verdict = "within" if took is not None and took <= GOAL_S else "OVER"
                shown = f"{took:.2f} s" if took is not None else f"never ({args.limit:g} s)"
                print(f"[{label}] {what}: client in after {shown} ({verdict} the {GOAL_S:g} s goal)", flush=True)
        finally:
            agent.kill()
            agent.wait()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--attacker":
        _attacker(sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attacks", default="calls,silent")
    p.add_argument("--calls", type=int, default=64)
    p.add_argument("--silent", type=int, default=600, help="silent connections (default 600: above the agent's 512)")
    p.add_argument("--as-user", type=int, help="run the attacker as this uid (needs root)")
    p.add_argument("--limit", type=float, default=60.0, help="give up on a client after this long (default 60 s)")
    p.add_argument("--ref", help="also measure the agent of this git ref (e.g. main), side by side")
    args = p.parse_args()
    if args.ref:
        sys.path.insert(0, str(Path(__file__).parent))
        from base_code import base_tree

        measure(args.ref, args, base_tree(args.ref))
    measure("this checkout", args, None)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
