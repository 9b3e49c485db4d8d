"""The agent's front door: who may hold a connection, decided before gRPC reads a byte.

gRPC bounds how many connections an agent accepts, but not who holds them or
for how long before a call: 512 connections that finish the HTTP/2 handshake
and then say nothing took every place, and a real client could not get in.
gRPC gives a server no say over single connections, so the agent listens
itself and passes each accepted connection's bytes, unchanged (TLS included),
to its gRPC server on a private Unix socket. Here, before any token is seen:

- a plaintext connection must start a call (an HTTP/2 HEADERS frame) within
  ``call_wait_s`` of connecting, or it is closed;
- when every place is taken, a newcomer whose peer already holds the most
  connections is refused; any other newcomer is let in and a connection of
  the peer holding the most is closed to make room (one that never called
  first, then the one quiet the longest). A loopback peer is the local user
  that owns the client's socket (asked of the kernel, as ``ss -e`` does), another is its
  address. A client of another user or address therefore gets in however
  many connections an attacker opens or keeps busy.

Within a connection, gRPC's own limits and the token check hold as before
(``rankscope.wire.agent``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import socket
import struct
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_HEADER = 9
HEADERS_FRAME = 0x1
CHUNK = 256 * 1024
REFUSED_CLOSE_S = 1.0  # a refused connection is closed after this pause, while few enough wait (Gate.waiting_max)


NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
_NO_COOKIE = 0xFFFFFFFF
_UID_AT = 16 + 4 + 48 + 12  # nlmsghdr, then inet_diag_msg: family..retrans, sockid, expires/rqueue/wqueue, uid


def _v4(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    address = ipaddress.ip_address(host)
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return mapped if mapped is not None else address


def socket_uid(client: tuple[str, int], server: tuple[str, int]) -> int | None:
    """The uid owning a loopback client's socket (the connection ``client`` -> ``server``), asked of the kernel by
    one sock_diag query (what ``ss -e`` shows); None when it cannot tell (another network namespace, no netlink)."""
    try:
        src, dst = _v4(client[0]), _v4(server[0])
    except ValueError:
        return None
    if src.version != dst.version:
        return None
    family = socket.AF_INET if src.version == 4 else socket.AF_INET6
    sockid = struct.pack("!HH16s16s", client[1], server[1], src.packed.ljust(16, b"\0"), dst.packed.ljust(16, b"\0"))
    sockid += struct.pack("=III", 0, _NO_COOKIE, _NO_COOKIE)
    request = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sockid
    header = struct.pack("=IHHII", 16 + len(request), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, 1, 0)
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG) as nl:
            nl.settimeout(0.5)
            nl.send(header + request)
            reply = nl.recv(65536)
    except OSError:
        return None
    if len(reply) < _UID_AT + 4 or struct.unpack_from("=H", reply, 4)[0] != SOCK_DIAG_BY_FAMILY:
        return None  # NLMSG_ERROR: no such socket here
    return int(struct.unpack_from("=I", reply, _UID_AT)[0])


def peer_key(client: tuple[str, int], server: tuple[str, int]) -> str:
    """Who holds a connection: on loopback the local user that owns the client's socket, else its address."""
    try:
        address = _v4(client[0])
    except ValueError:
        return client[0]
    if address.is_loopback:
        uid = socket_uid(client, server)
        if uid is not None:
            return f"uid {uid}"
    return str(address)


@dataclass(eq=False)
class _Conn:
    key: str  # who holds it (peer_key)
    opened: float
    writer: asyncio.StreamWriter
    last_active: float = 0.0
    called: bool = False
    backend: asyncio.StreamWriter | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def close(self) -> None:
        for w in (self.writer, self.backend):
            if w is not None:
                with contextlib.suppress(Exception):
                    w.transport.abort()
        for t in self.tasks:
            t.cancel()


class Gate:
    """Listens on the agent's address and hands each admitted connection to the gRPC server's Unix socket."""

    def __init__(self, limit: int, *, call_wait_s: float, inspect_calls: bool, waiting_max: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.waiting_max = waiting_max  # refused connections that may wait out their pause (each holds a descriptor)
        self.call_wait_s = call_wait_s
        self.inspect_calls = inspect_calls  # plaintext: HTTP/2 frames can be read; under TLS they cannot
        self.clock = clock
        self._dir = tempfile.mkdtemp(prefix="rankscope-agent-")  # mode 0700: only this user reaches the socket
        self.backend_path = os.path.join(self._dir, "grpc.sock")
        self._conns: set[_Conn] = set()
        self._server: asyncio.Server | None = None
        self.closed_silent = 0  # connections closed for never calling (figures for the log and the tests)
        self.evicted = 0  # connections closed to make room
        self.refused = 0  # newcomers refused: their peer held the most places already
        self._waiting = 0  # refused connections in their pause before being closed

    @property
    def backend_target(self) -> str:
        return f"unix:{self.backend_path}"

    async def listen(self, host: str, port: int) -> int:
        """Start listening (refuses a port another socket holds: no SO_REUSEPORT); returns the port bound."""
        self._server = await asyncio.start_server(self._accept, host.strip("[]"), port, reuse_port=False,
                                                  limit=CHUNK, backlog=1024)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop_listening(self) -> None:
        """No new connections; those open keep going (the agent's graceful stop lets their calls finish)."""
        if self._server is not None:
            self._server.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            conn.close()
        self._conns.clear()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
        with contextlib.suppress(OSError):
            os.unlink(self.backend_path)
        with contextlib.suppress(OSError):
            os.rmdir(self._dir)

    def _admit(self, conn: _Conn) -> bool:
        """Whether ``conn`` may take a place; when every place is taken, the newcomer is refused if its peer
        already holds the most, else one connection of the peer holding the most is closed to make room."""
        if len(self._conns) < self.limit or not self._conns:
            return True
        held: dict[str, int] = {}
        for c in self._conns:
            held[c.key] = held.get(c.key, 0) + 1
        if held.get(conn.key, 0) >= max(held.values()):
            self.refused += 1
            return False
        victim = max(self._conns, key=lambda c: (held[c.key], not c.called, -c.last_active))
        self._conns.discard(victim)
        self.evicted += 1
        victim.close()
        return True

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername") or ("?", 0)
        here = writer.get_extra_info("sockname") or ("?", 0)
        now = self.clock()
        client = (str(peer[0]), int(peer[1]))
        conn = _Conn(key=peer_key(client, (str(here[0]), int(here[1]))), opened=now, writer=writer, last_active=now)
        if not self._admit(conn):
            # Closed after a pause, not at once: a peer that reconnects as soon as it is refused would otherwise
            # keep the agent busy accepting and refusing. The pause costs a descriptor, so only so many wait.
            if self._waiting < self.waiting_max:
                self._waiting += 1
                await asyncio.sleep(REFUSED_CLOSE_S)
                self._waiting -= 1
            conn.close()
            return
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._conns.add(conn)
        try:
            backend_reader, backend_writer = await asyncio.open_unix_connection(self.backend_path, limit=CHUNK)
        except OSError:
            self._drop(conn)
            return
        conn.backend = backend_writer
        conn.tasks = [asyncio.create_task(self._upstream(conn, reader, backend_writer)),
                      asyncio.create_task(self._pump(backend_reader, writer, conn))]
        if self.inspect_calls:
            conn.tasks.append(asyncio.create_task(self._watch(conn)))
        await asyncio.gather(*conn.tasks, return_exceptions=True)
        self._drop(conn)

    def _drop(self, conn: _Conn) -> None:
        self._conns.discard(conn)
        conn.close()

    async def _watch(self, conn: _Conn) -> None:
        """Close a plaintext connection that has not started a call within ``call_wait_s``."""
        await asyncio.sleep(self.call_wait_s)
        if not conn.called and conn in self._conns:
            self.closed_silent += 1
            self._drop(conn)

    async def _upstream(self, conn: _Conn, reader: asyncio.StreamReader, out: asyncio.StreamWriter) -> None:
        """Client to gRPC; in plaintext, reads HTTP/2 frame headers until the first call (HEADERS) is seen."""
        seen = b""  # bytes not yet parsed, only until the first call
        skip = len(PREFACE) if self.inspect_calls else 0
        try:
            while True:
                data = await reader.read(CHUNK)
                if not data:
                    break
                conn.last_active = self.clock()
                if self.inspect_calls and not conn.called:
                    seen += data
                    while True:
                        if skip:
                            cut = min(skip, len(seen))
                            seen, skip = seen[cut:], skip - cut
                            if skip:
                                break
                        if len(seen) < FRAME_HEADER:
                            break
                        if seen[3] == HEADERS_FRAME:
                            conn.called = True
                            seen = b""
                            break
                        skip = FRAME_HEADER + int.from_bytes(seen[:3], "big")
                elif not self.inspect_calls:
                    conn.called = True  # under TLS nothing can be read: any bytes count
                out.write(data)
                await out.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            with contextlib.suppress(Exception):
                out.write_eof()

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, out: asyncio.StreamWriter, conn: _Conn) -> None:
        """gRPC to client."""
        try:
            while True:
                data = await reader.read(CHUNK)
                if not data:
                    break
                out.write(data)
                await out.drain()
        except OSError:
            pass
        finally:
            with contextlib.suppress(Exception):
                out.write_eof()
