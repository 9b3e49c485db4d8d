"""The lease of agents started for a session: renewed while the client lives, so they end soon after it.

Agents started with ``--lease`` (inside a Slurm job, ``rankscope.wire.slurm``)
stop by themselves when nobody has been heard from for that long: the agent's
side is ``Lease`` (renewed by every call with an accepted token) and
``lease_expired``; the client's side is ``KeepAlive``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from rankscope.wire.fanout import CHANNEL_OPTIONS, auth_metadata
from rankscope.wire.tls import ClientTLS, channel_credentials, channel_options


class Lease:
    """When a client last called with an accepted token (any method, health checks included)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.renewed = clock()

    def renew(self) -> None:
        self.renewed = self.clock()

    def idle_s(self) -> float:
        return self.clock() - self.renewed


async def lease_expired(lease: Lease, lease_s: float) -> None:
    """Returns once ``lease_s`` passed without an accepted call."""
    while (idle := lease.idle_s()) < lease_s:
        await asyncio.sleep(lease_s - idle)


class KeepAlive:
    """Renews the lease of agents started with ``--lease`` while this client lives.

    A thread sends each agent a health check with the session's token every
    ``every_s`` seconds; an agent that hears from nobody for its lease stops by
    itself, so agents outlive a client only by their lease however that client
    ended (SIGKILL, a lost login node). ``agents`` is read at each round, so
    agents that replace others (a requeued Slurm job) are kept too.
    """

    def __init__(self, agents: Callable[[], Sequence[str]], token: str | None, *, tls: ClientTLS | None = None,
                 every_s: float = 5.0) -> None:
        import threading

        self.agents, self.token, self.tls, self.every_s = agents, token, tls, every_s
        self.rounds = 0  # rounds completed (each agent asked once)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rankscope-keep-alive", daemon=True)
        self._channels: dict[str, Any] = {}

    def __enter__(self) -> KeepAlive:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _channel(self, address: str) -> Any:
        if address not in self._channels:
            if self.tls is not None:
                self._channels[address] = grpc.secure_channel(
                    address, channel_credentials(self.tls), options=CHANNEL_OPTIONS + channel_options(self.tls))
            else:
                self._channels[address] = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        return self._channels[address]

    def _run(self) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            while not self._stop.is_set():
                for address in list(self.agents()):
                    stub = health_pb2_grpc.HealthStub(self._channel(address))  # type: ignore[no-untyped-call]
                    # An agent that does not answer is the polls' business; keep renewing the others.
                    with contextlib.suppress(grpc.RpcError):
                        stub.Check(health_pb2.HealthCheckRequest(), metadata=auth_metadata(self.token),
                                   timeout=self.every_s)
                self.rounds += 1
                self._stop.wait(self.every_s)
        finally:
            for channel in self._channels.values():
                channel.close()
