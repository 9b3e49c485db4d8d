"""Parked, pre-warmed interpreters that become the ranks of a job when told to (warm recovery).

A restart on one host is dominated by new rank processes importing torch
(tens of seconds on a loaded 2-core machine); a standby that imports torch
after it is chosen is not warm. So each machine slot keeps a *parked node*
ready: a small supervisor (stdlib only, the role torchrun plays) with one
parked interpreter per local rank that has already imported torch and the
job's modules and waits on a socket pair. When the launcher tells the
supervisor "go" (one JSON line over a local Unix socket, mode 0600: the
environment and the entry point of each rank, never a shell command), each
parked interpreter becomes its rank:

1. it publishes the rank's environment where ``/proc/PID/environ`` shows it
   (see :func:`publish_environment`), so discovery, py-spy and the agents find
   it as they find a torchrun rank, and sets ``os.environ``;
2. it changes to the job's directory, sets ``sys.argv`` and runs the entry
   point as ``__main__`` (``runpy``, as ``python -m module`` or ``python
   script.py`` would), so the user's script runs unchanged: it reads RANK,
   WORLD_SIZE, MASTER_ADDR/PORT... and joins the rendezvous itself.

The supervisor then behaves as torchrun's agent with ``--max-restarts 0``:
it exits 0 when every rank did, else it stops the others and exits with the
first failure's status. Parked interpreters die with their supervisor
(``PR_SET_PDEATHSIG``). A used parked node is never parked again: the
launcher parks a fresh one in its place.

Not preloaded on purpose: the entry module itself (``runpy`` must run it
fresh as ``__main__``) and code that a hot-update switches (the drill's
versioned user code is loaded from its link by the rank, after the go).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PAD_ENV = "RANKSCOPE_PARKED_ENV"  # the placeholder a parked interpreter's rank environment is written over
PAD_BYTES = 16384
# What a parked interpreter of the drill imports while it waits: torch and the job's own (not hot-updated)
# modules; the entry module is left to runpy.
DRILL_PRELOAD = ("torch", "torch.distributed", "torch.utils.data", "torch.optim", "torch._dynamo", "rankscope.drill.model",
                 "rankscope.drill.progress", "rankscope.drill.user_code", "rankscope.analyzers.backup_plan",
                 "rankscope.ccl_plugin.backup")
# The keys discovery reads (probes/discovery.py): written first, so they are never the ones cut off.
RANK_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
             "MASTER_ADDR", "MASTER_PORT", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_NAME")
GO_TIMEOUT_S = 10.0


class WarmError(Exception):
    """A parked node that cannot do what it was told (the launcher turns it into a RankscopeError)."""


class NotListening(WarmError):
    """Nobody accepted the connection: a node started just now may not listen yet (bind comes before listen)."""


# --------------------------------------------------------------------------
# The rank's side
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What one parked interpreter becomes: the environment it adds and the entry point it runs."""

    env: dict[str, str]
    argv: list[str]  # argv[0]: the module (module=True) or the script path
    module: bool = True
    cwd: str = "."
    # This interpreter hosts the job's TCPStore on this port (MASTER_ADDR) before it becomes its rank, and the
    # go is answered once it listens (see ``host_store``); 0: it hosts none.
    store_port: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"env": self.env, "argv": self.argv, "module": self.module, "cwd": self.cwd,
                "store_port": self.store_port}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RankSpec:
        env = data.get("env")
        argv = data.get("argv")
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise WarmError("go: env must map names to strings")
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise WarmError("go: argv must be a non-empty list of strings")
        port = data.get("store_port", 0)
        if not isinstance(port, int) or not 0 <= port < 65536:
            raise WarmError("go: store_port must be a port number (0: no store)")
        return cls(dict(env), list(argv), bool(data.get("module", True)), str(data.get("cwd", ".")), port)


def rank_env(*, rank: int, local_rank: int, world: int, local_world: int, node_rank: int, nodes: int,
             master_addr: str, master_port: int, run_id: str) -> dict[str, str]:
    """The environment torchrun's agent gives a rank (static rendezvous, no restarts)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(local_world), "GROUP_RANK": str(node_rank), "GROUP_WORLD_SIZE": str(nodes),
            "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world), "ROLE_NAME": "default",
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"}


def publish_environment(env: Mapping[str, str]) -> list[str]:
    """Write ``env`` over this process's start-up placeholder (``PAD_ENV``); the keys that did not fit.

    ``/proc/PID/environ`` shows the bytes of the environment block the
    process was exec'd with, as they are now; ``os.environ`` changes never
    reach it. The parked interpreter was started with ``PAD_ENV`` last in its
    environment, a run of spaces; its value is overwritten in place with
    NUL-separated ``KEY=value`` entries (the way setproctitle rewrites argv),
    so readers of /proc, which take the last of repeated keys, see the rank's
    values. Children started later get the real environment (``os.environ``).
    """
    libc = ctypes.CDLL(None)
    libc.getenv.restype = ctypes.c_void_p
    libc.getenv.argtypes = [ctypes.c_char_p]
    address = libc.getenv(PAD_ENV.encode())
    size = len(os.environ.get(PAD_ENV, ""))
    if not address or size == 0:
        return list(env)
    ordered = [k for k in RANK_KEYS if k in env] + [k for k in env if k not in RANK_KEYS]
    block, left = b"\0", []
    for key in ordered:
        entry = f"{key}={env[key]}".encode() + b"\0"
        if len(block) + len(entry) > size:
            left.append(key)
            continue
        block += entry
    ctypes.memmove(address, block.ljust(size, b"\0"), size)
    return left


def become(spec: RankSpec) -> None:
    """Turn this (parked) interpreter into the rank ``spec`` describes and run its entry point as __main__."""
    left = publish_environment(spec.env)
    os.environ.update(spec.env)
    os.environ.pop(PAD_ENV, None)
    if any(k in RANK_KEYS for k in left):
        print(f"rankscope warm: the rank keys {left} did not fit the parked environment block; discovery will "
              "not see this rank", file=sys.stderr, flush=True)
    os.chdir(spec.cwd)
    _environment_changed()
    sys.argv = list(spec.argv)
    if spec.module:
        runpy.run_module(spec.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, str(Path(spec.argv[0]).resolve().parent))
        runpy.run_path(spec.argv[0], run_name="__main__")


def _environment_changed() -> None:
    """Hooks loaded at start-up that read the environment then read it again (the CCL plugin's backup hook)."""
    with contextlib.suppress(Exception):
        from rankscope.ccl_plugin import autoload

        autoload.environment_changed()


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


_HOSTED: list[Any] = []  # the job's TCPStore, kept for as long as this process (its rank 0) lives
# What tells torch's rendezvous that the store is hosted for the ranks (torchrun's agent sets it when it hosts
# one): every rank, rank 0 included, is then its client.
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
STORE_TIMEOUT_S = 900.0  # for the hosting process's own use of the store; the ranks' clients have their own


def host_store(spec: RankSpec) -> None:
    """Serve the job's TCPStore on ``spec.store_port``, as torchrun's agent does for its ranks.

    When rank 0 created it in its rendezvous, a rank of another node that
    asked first was refused and tried again only after torch's back-off:
    0.5-0.66 s on this host, in every restart where rank 0 was not first.
    Hosted here before the other nodes get their go, it is there when they ask.
    """
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore  # type: ignore[attr-defined]  # the public name: torch's stubs do not re-export it
    _HOSTED.append(store(spec.env["MASTER_ADDR"], spec.store_port, int(spec.env["WORLD_SIZE"]), True,
                         timedelta(seconds=STORE_TIMEOUT_S), wait_for_workers=False))


def park(fd: int, preload: Sequence[str]) -> int:
    """A parked interpreter: import ``preload``, say ready on ``fd``, wait for one go, become the rank."""
    _die_with_parent()
    chan = socket.socket(fileno=fd)
    began = time.monotonic()
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception as exc:
            chan.sendall(json.dumps({"error": f"import {name}: {type(exc).__name__}: {exc}"}).encode() + b"\n")
            return 1
    chan.sendall(json.dumps({"ready": round(time.monotonic() - began, 3), "pid": os.getpid()}).encode() + b"\n")
    line = _read_line(chan)
    if not line:
        chan.close()
        return 0  # the supervisor is gone before any go: nothing to become
    spec = RankSpec.from_json(json.loads(line))
    if spec.store_port:
        try:
            host_store(spec)
        except Exception as exc:
            with contextlib.suppress(OSError):
                chan.sendall(json.dumps({"error": f"hosting the job's store: {type(exc).__name__}: {exc}"}
                                        ).encode() + b"\n")
            return 1
        with contextlib.suppress(OSError):  # nobody waits for it when the go came before this was ready
            chan.sendall(json.dumps({"store": spec.store_port}).encode() + b"\n")
    chan.close()  # the rank's own children must not hold the supervisor's channel
    become(spec)
    return 0


def _read_line(sock: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data.strip()


# --------------------------------------------------------------------------
# The supervisor (one parked node)
# --------------------------------------------------------------------------


@dataclass
class _Child:
    proc: subprocess.Popen[bytes]
    chan: socket.socket
    ready_s: float | None = None  # import time, once ready
    spec: RankSpec | None = None
    sent: bool = False
    warm_at_go: bool = False
    buf: bytes = b""


@dataclass
class Supervisor:
    """Parks ``ranks`` interpreters, takes one go over ``socket_path``, then watches them as torchrun would."""

    socket_path: Path
    ranks: int
    preload: Sequence[str]
    children: list[_Child] = field(default_factory=list)
    went: bool = False

    def run(self) -> int:
        _die_with_parent()
        signal.signal(signal.SIGTERM, lambda *_: self._exit(143))
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.socket_path.unlink(missing_ok=True)
        old = os.umask(0o177)
        try:
            server.bind(str(self.socket_path))
        finally:
            os.umask(old)
        server.listen(4)
        env = {k: v for k, v in os.environ.items() if k != PAD_ENV}
        env[PAD_ENV] = " " * PAD_BYTES  # last, so its overwritten entries are the ones readers keep
        for _ in range(self.ranks):
            mine, theirs = socket.socketpair()
            proc = subprocess.Popen([sys.executable, "-m", "rankscope.drill.warm", "park", "--fd", str(theirs.fileno()),
                                     *[a for name in self.preload for a in ("--preload", name)]],
                                    pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
            theirs.close()
            self.children.append(_Child(proc, mine))
        while True:
            chans = {c.chan.fileno(): c for c in self.children if not c.sent}
            readable, _, _ = select.select([server, *[c.chan for c in chans.values()]], [], [], 0.2)
            for r in readable:
                if r is server:
                    self._serve(server)
                else:
                    self._heard(chans[r.fileno()])
            code = self._watch()
            if code is not None:
                return self._exit(code)

    def _heard(self, child: _Child) -> None:
        chunk = child.chan.recv(65536)
        child.buf += chunk
        if not chunk or not child.buf.endswith(b"\n"):
            return
        msg = json.loads(child.buf)
        child.buf = b""
        if "error" in msg:
            print(f"rankscope warm: parked interpreter {child.proc.pid} failed: {msg['error']}", file=sys.stderr,
                  flush=True)
            return
        child.ready_s = float(msg["ready"])
        print(f"rankscope warm: parked interpreter {child.proc.pid} ready after {child.ready_s:.2f} s", flush=True)
        self._send(child)

    def _send(self, child: _Child) -> bool:
        """Send ``child`` its rank spec once it is ready; whether it hosts the job's store now (it answered so)."""
        if child.spec is None or child.ready_s is None or child.sent:
            return False
        child.chan.sendall(json.dumps(child.spec.to_json()).encode() + b"\n")
        hosted = False
        if child.spec.store_port:
            child.chan.settimeout(GO_TIMEOUT_S)
            try:
                answer = json.loads(_read_line(child.chan) or b"{}")
            except (OSError, ValueError) as exc:
                answer = {"error": str(exc)}
            if "error" in answer:
                print(f"rankscope warm: parked interpreter {child.proc.pid} did not host the job's store: "
                      f"{answer['error']}", file=sys.stderr, flush=True)
            hosted = answer.get("store") == child.spec.store_port
        child.chan.close()
        child.sent = True
        return hosted

    def _serve(self, server: socket.socket) -> None:
        conn, _ = server.accept()
        with conn:
            conn.settimeout(GO_TIMEOUT_S)
            try:
                request = json.loads(_read_line(conn) or b"{}")
                reply = self._answer(request)
            except (WarmError, ValueError, OSError) as exc:
                reply = {"error": str(exc)}
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps(reply).encode() + b"\n")

    def _answer(self, request: Mapping[str, Any]) -> dict[str, Any]:
        status = {"pids": [c.proc.pid for c in self.children], "ready": [c.ready_s for c in self.children],
                  "went": self.went}
        if request.get("op") == "status":
            return status
        if request.get("op") != "go":
            raise WarmError(f"unknown request {request.get('op')!r} (status or go)")
        if self.went:
            raise WarmError("this parked node has already become a node of the job; park a fresh one")
        specs = request.get("ranks")
        if not isinstance(specs, list) or len(specs) != len(self.children):
            raise WarmError(f"go needs one rank spec per parked interpreter ({len(self.children)})")
        parsed = [RankSpec.from_json(s) for s in specs]
        self.went = True
        hosted = False
        for child, spec in zip(self.children, parsed, strict=True):
            child.spec = spec
            child.warm_at_go = child.ready_s is not None
            hosted = self._send(child) or hosted
        print(f"rankscope warm: go; warm at go: {[c.warm_at_go for c in self.children]}", flush=True)
        return {**status, "warm": [c.warm_at_go for c in self.children], "store": hosted}

    def _watch(self) -> int | None:
        """torchrun's rule: the first rank that fails ends the node with its status; all done ends it with 0."""
        codes = [c.proc.poll() for c in self.children]
        failed = [code for code in codes if code not in (None, 0)]
        if failed:
            print(f"rankscope warm: a rank exited with status {failed[0]}; stopping the others", flush=True)
            return 1 if failed[0] < 0 else failed[0]
        if all(code == 0 for code in codes):
            return 0 if self.went else 1
        return None

    def _exit(self, code: int) -> int:
        for c in self.children:
            with contextlib.suppress(OSError):
                c.proc.terminate()
        end = time.monotonic() + 2.0
        for c in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.proc.wait(max(0.0, end - time.monotonic()))
            if c.proc.poll() is None:
                c.proc.kill()
        with contextlib.suppress(OSError):
            self.socket_path.unlink()
        os._exit(code)


# --------------------------------------------------------------------------
# The launcher's side
# --------------------------------------------------------------------------


def node_argv(python: str, socket_path: Path, ranks: int, preload: Sequence[str]) -> list[str]:
    """The command line of one parked node (started by the launcher like any of its processes)."""
    return [python, "-m", "rankscope.drill.warm", "node", "--socket", str(socket_path), "--ranks", str(ranks),
            *[a for name in preload for a in ("--preload", name)]]


def ask(socket_path: Path, request: Mapping[str, Any], timeout_s: float = GO_TIMEOUT_S) -> dict[str, Any]:
    """One request to a parked node over its Unix socket; its JSON answer. Raises WarmError."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect(str(socket_path))
            s.sendall(json.dumps(request).encode() + b"\n")
            line = _read_line(s)
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        raise NotListening(f"the parked node at {socket_path} did not answer: {exc}") from exc
    except OSError as exc:
        raise WarmError(f"the parked node at {socket_path} did not answer: {exc}") from exc
    try:
        reply = json.loads(line)
    except ValueError as exc:
        raise WarmError(f"the parked node at {socket_path} answered {line[:200]!r}") from exc
    if not isinstance(reply, dict):
        raise WarmError(f"the parked node at {socket_path} answered {line[:200]!r}")
    if "error" in reply:
        raise WarmError(str(reply["error"]))
    return reply


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rankscope.drill.warm")
    sub = p.add_subparsers(dest="cmd", required=True)
    n = sub.add_parser("node", help="a parked node: one parked interpreter per local rank, and its supervisor")
    n.add_argument("--socket", required=True, help="the Unix socket the go arrives on (created 0600)")
    n.add_argument("--ranks", type=int, required=True)
    n.add_argument("--preload", action="append", default=[])
    k = sub.add_parser("park", help="one parked interpreter (started by its node)")
    k.add_argument("--fd", type=int, required=True)
    k.add_argument("--preload", action="append", default=[])
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "node":
        return Supervisor(Path(args.socket), args.ranks, args.preload).run()
    return park(args.fd, args.preload)


if __name__ == "__main__":
    raise SystemExit(main())
