"""The agent's limits: what a request may weigh and carry, how many calls and connections it serves at once.

Every limit holds before the token is checked (gRPC reads a whole request
before any handler runs); the README's "Hardening" section says why each.
Every number a request carries is checked for range and finiteness before use.
"""

from __future__ import annotations

import contextlib
import math
import resource

from rankscope.contract.errors import RankscopeError

MAX_PYSPY_TIMEOUT_S = 60.0
DEFAULT_PYSPY_TIMEOUT_S = 5.0
MAX_SAMPLE_HZ = 1000.0  # the sampler runs at most probes.sampler.MAX_RATE_HZ; above this a request is nonsense
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # replies: a whole machine's stacks
# Requests (read before the token is checked). The largest real ones: a RunAction evicting a machine together with
# the 16,383 others of a whole-job restart, 0.26 MB; a relay's Describe naming the versions it holds of 8,192
# agents, 0.44 MB (relays have tens). Peak memory is about this times the calls in flight, times 3.
MAX_REQUEST_BYTES = 512 * 1024
MAX_CONCURRENT_RPCS = 64  # calls in flight at once, all clients together (a TUI holds 3-4 per agent)
MAX_STREAMS_PER_CONNECTION = 32  # calls in flight on one connection
MAX_CONNECTIONS = 512  # also at most half the descriptors the agent may open (connection_limit)
HANDSHAKE_TIMEOUT_S = 5.0  # a connection that has not finished TLS and the HTTP/2 settings by then is closed
CALL_WAIT_S = 5.0  # a plaintext connection that has started no call by then is closed (rankscope.wire.gate)
MESSAGE_WAIT_S = 5.0  # a call with an accepted token (or a health check) must send its request by then
DESCRIPTORS_PER_CONNECTION = 3  # the client's socket and the gate's Unix socket to gRPC, both ends
REFUSED_WAITING_MAX = 64  # refused connections held for a pause before they are closed (rankscope.wire.gate)
IDLE_CONNECTION_S = 300.0  # a connection with no call in flight for this long is closed (clients reconnect)


def connection_limit(relays: int = 0) -> int:
    """How many client connections the agent accepts: half the descriptors it may open, minus the connections it
    makes itself (relaying), at most MAX_CONNECTIONS: the other half stays for py-spy's pipes, counter files and
    the audit log, so idle connections cannot starve a capture."""
    return max(4, min(MAX_CONNECTIONS, _connection_descriptors(relays) // DESCRIPTORS_PER_CONNECTION))


def refused_waiting_limit(relays: int = 0) -> int:
    """How many refused connections may wait out their pause (rankscope.wire.gate): what the connections leave of
    their half of the descriptors, at most REFUSED_WAITING_MAX."""
    spare = _connection_descriptors(relays) - connection_limit(relays) * DESCRIPTORS_PER_CONNECTION
    return max(0, min(REFUSED_WAITING_MAX, spare))


def _connection_descriptors(relays: int) -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS * DESCRIPTORS_PER_CONNECTION + REFUSED_WAITING_MAX
    return soft // 2 - relays


def raise_descriptor_limit() -> None:
    """Use the hard descriptor limit: the soft one (often 1024) is a default, not a decision."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def server_options(relays: int = 0) -> list[tuple[str, int]]:
    """The gRPC server's limits (each one named, with why, in the README's "Hardening" section). The connections
    are bounded before gRPC, by the gate (``rankscope.wire.gate``), which also decides who gives a place up."""
    return [
        ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
        ("grpc.server_handshake_timeout_ms", int(HANDSHAKE_TIMEOUT_S * 1000)),
        ("grpc.max_connection_idle_ms", int(IDLE_CONNECTION_S * 1000)),
        ("grpc.so_reuseport", 0),  # a second agent on the same port must fail, not share it
    ]


def checked_number(value: float, name: str, low: float, high: float) -> float:
    """``value`` if finite and within [low, high]; else a RankscopeError naming the field (INVALID_ARGUMENT)."""
    if not math.isfinite(value) or not low <= value <= high:
        raise RankscopeError(f"{name} must be a number from {low:g} to {high:g}, got {value!r}",
                             "send a finite number in that range (0 leaves the agent's default)")
    return value
