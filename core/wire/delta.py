"""The delta form: what did not change since the reading a client holds, on both sides of the wire.

The agent (``ReadingVersions``) gives each reply a version and, for a client
that names the version it holds as ``since``, marks what is the same as then;
the client (``HeldReadings``, ``held_from_proto``) keeps the readings it was
given by version and fills the marks back from the one the reply names.
Importing this module installs the delta's decoding into the generic codec
(``rankscope.wire.codec``), after the compact tables it builds on.
"""

from __future__ import annotations

import hashlib
import os
import typing
from collections.abc import Callable, Iterable
from typing import Any

from rankscope.contract.snapshot import (
    MachineSnapshot,
    OpCounters,
    RankCounters,
    RankInfo,
)
from rankscope.wire.codec import (
    DECODING,
    FIELD_DECODERS,
    INSTALLED,
    SPECIAL_DECODERS,
    ProtoConversionError,
    WireError,
    decoder,
)
from rankscope.wire.columns import read_values, write_columns
from rankscope.wire.compact import COMMS_AT, OPS_AT
from rankscope.wire.merge import merged_children
from rankscope.wire.proto import rankscope_pb2 as pb

# ---- the delta form: what did not change since the reading a client holds --------
#
# A TUI polls every agent every second; a job whose state did not change would
# otherwise cost its whole description again each time (22 MB and seconds of
# decoding at 2,048 agents). The agent remembers, for its last few readings,
# a digest of each rank's description and of each rank's operation counters
# (with its communicators); a client that names one of them as `since` gets
# those that are still the same as a mark only, and keeps its own objects.
# What changes all the time (heartbeats, step counts, host and GPU metrics)
# is always sent.


def _decode_ranks(raw: Any) -> tuple[RankInfo, ...]:
    dec = decoder(RankInfo)
    out: list[RankInfo] = []
    before: dict[int, RankInfo] | None = None
    for i, r in enumerate(raw):
        if r.same:
            if before is None:
                previous: MachineSnapshot | None = getattr(DECODING, "previous", None)
                before = {x.rank: x for x in previous.ranks} if previous is not None else {}
            made = before.get(r.rank)
            if made is None:
                exc = WireError(f"same for rank {r.rank}, which the reading it refers to does not list")
                exc.path.append(f"[{i}]")
                raise exc
            out.append(made)
        else:
            out.append(dec(r))
    return tuple(out)


def _previous_counters() -> dict[int, RankCounters]:
    previous: MachineSnapshot | None = getattr(DECODING, "previous", None)
    if previous is None:
        return {}
    cached: tuple[MachineSnapshot, dict[int, RankCounters]] | None = getattr(DECODING, "counters_of", None)
    if cached is None or cached[0] is not previous:
        cached = DECODING.counters_of = (previous, {c.rank: c for c in previous.counters})
    return cached[1]


class ReadingVersions:
    """An agent's memory of its last few replies, so that a client holding one gets a delta against it."""

    def __init__(self, keep: int = 16) -> None:
        self.keep = keep  # a few clients (a TUI, a script, a relay) poll one agent at once
        self._digests: dict[int, tuple[dict[int, bytes], dict[int, bytes]]] = {}

    def stamp(self, msg: pb.MachineSnapshot, since: int | None) -> None:
        """Give ``msg`` (a whole reading, compact form) a version and, when ``since`` is remembered, make it
        a delta against that reading."""
        ranks = _digests((r.rank, (r.SerializeToString(deterministic=True),)) for r in msg.ranks)
        table = msg.communicator_table
        op_rows = _OpRows(msg)
        ops = _digests((c.rank, (*(o.SerializeToString(deterministic=True) for o in c.ops),
                                 *(table[r].SerializeToString(deterministic=True) for r in c.communicator_refs
                                   if r < len(table)),
                                 *(m.SerializeToString(deterministic=True) for m in c.communicators),
                                 *op_rows.parts(i)))
                       for i, c in enumerate(msg.counters))
        version = int.from_bytes(os.urandom(8), "little")
        old = self._digests.get(since) if since is not None else None
        if old is not None:
            old_ranks, old_ops = old
            for r in msg.ranks:
                if r.rank in ranks and old_ranks.get(r.rank) == ranks[r.rank]:
                    rank = r.rank
                    r.Clear()
                    r.rank, r.same = rank, True
            for i, c in enumerate(msg.counters):
                if c.rank in ops and old_ops.get(c.rank) == ops[c.rank]:
                    op_rows.drop(i)
                    for name in ("ops", "communicator_refs", "communicators", "op_rows"):
                        c.ClearField(name)
                    c.ops_same = True
            op_rows.write(msg)
            if all(c.ops_same for c in msg.counters):
                msg.ClearField("communicator_table")
            msg.since = typing.cast(int, since)
        msg.version = version
        self._digests[version] = (ranks, ops)
        while len(self._digests) > self.keep:
            del self._digests[next(iter(self._digests))]


class _OpRows:
    """A compact reply's op_columns cut by the counters that own the rows: their digest parts, and the columns
    again without the rows of counters a delta marks ``ops_same``."""

    def __init__(self, msg: pb.MachineSnapshot) -> None:
        self.values = read_values(OpCounters, msg.op_columns) if msg.HasField("op_columns") else []
        self.rows: dict[int, range] = {}  # the position of a counters entry in msg.counters -> its rows
        start = 0
        for i, c in enumerate(msg.counters):
            if c.HasField("op_rows"):
                self.rows[i] = range(start, start + c.op_rows)
                start += c.op_rows
        self.dropped: set[int] = set()

    def parts(self, at: int) -> tuple[bytes, ...]:
        rows = self.rows.get(at)
        if rows is None:
            return ()
        # repr of ints, floats (exact), strings and tuples of them: the rows' values, whatever their column order
        return (repr([column[rows.start:rows.stop] for column in self.values]).encode(),)

    def drop(self, at: int) -> None:
        self.dropped.update(self.rows.get(at, ()))

    def write(self, msg: pb.MachineSnapshot) -> None:
        if not self.dropped:
            return
        keep = [i for i in range(len(self.values[0])) if i not in self.dropped]
        msg.ClearField("op_columns")
        if keep:
            write_columns(OpCounters, [[column[i] for i in keep] for column in self.values], msg.op_columns)


def _digests(items: Iterable[tuple[int, tuple[bytes, ...]]]) -> dict[int, bytes]:
    """rank -> a digest of its parts; a rank listed twice has none (it is always sent whole)."""
    out: dict[int, bytes] = {}
    twice: set[int] = set()
    for rank, parts in items:
        if rank in out:
            twice.add(rank)
        h = hashlib.blake2b(digest_size=16)
        for part in parts:
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
        out[rank] = h.digest()
    for rank in twice:
        del out[rank]
    return out


_counters_without_delta = SPECIAL_DECODERS[RankCounters]


def _decode_counters(msg: Any, values: list[Any]) -> list[Any]:
    """A rank's counters; ``ops_same``: the same as in the reading the delta refers to."""
    if msg.ops_same:
        before = _previous_counters().get(msg.rank)
        if before is None:
            raise WireError(f"ops_same for rank {msg.rank}, which the reading it refers to has no counters of")
        values[OPS_AT], values[COMMS_AT] = before.ops, before.communicators
        return values
    return _counters_without_delta(msg, values)


# The reading a client holds of the agent at an address, by the version its agent gave it (None: not held).
Holding = Callable[[str, int], MachineSnapshot | None]


def held_from_proto(msg: pb.MachineSnapshot, address: str,
                    held: Holding) -> list[tuple[str, MachineSnapshot, int | None]]:
    """Like ``machines_from_proto``, for a reply that may be a delta (``MachineSnapshot.since``).

    ``held(address, version)``: the reading of that version this client holds
    of the agent at that address (``address`` for the agent asked, the address
    a relay reported for the ones it relayed): a delta names the reading its
    request named, which need not be the newest one when requests overlap.
    What a delta leaves out is taken from it, the
    same objects, so an unchanged rank costs nothing to decode. Returns each
    machine with the address it is held under and its version.
    """
    out: list[tuple[str, MachineSnapshot, int | None]] = []
    _held_at(msg, address, held, "MachineSnapshot", out)
    return out


def _held_at(msg: pb.MachineSnapshot, address: str, held: Holding, where: str,
             out: list[tuple[str, MachineSnapshot, int | None]]) -> None:
    previous: MachineSnapshot | None = None
    if msg.HasField("since"):
        previous = held(address, msg.since)
        if previous is None:
            raise ProtoConversionError(
                f"agent at {address} sent a delta against reading {msg.since:#x}, which this client does not hold")
    out.append((address, decode_machine(msg, where, previous), msg.version if msg.HasField("version") else None))
    for i, child in enumerate(msg.relayed):
        _held_at(child, child.address, held, f"{where}.relayed[{i}]", out)
    if msg.HasField("merged"):
        merged_children(msg, where, lambda child, at: _held_at(child, child.address, held, at, out))


def decode_machine(msg: pb.MachineSnapshot, where: str, previous: MachineSnapshot | None = None) -> MachineSnapshot:
    DECODING.previous = previous
    try:
        return typing.cast(MachineSnapshot, decoder(MachineSnapshot)(msg))
    except WireError as exc:
        raise ProtoConversionError(f"agent sent a {where} that does not fit the contract: "
                                   f"{where}{''.join(reversed(exc.path))}: {exc.problem}") from None
    finally:
        DECODING.previous = None


# Readings kept per agent to decode deltas against: one per call that may be out at once (the TUI's poll, its
# capture, a watcher's), and a spare.
HELD_READINGS = 4


class HeldReadings:
    """The client's side of the delta: what it holds of each agent, so that it can ask for what changed."""

    def __init__(self) -> None:
        # address -> the last readings decoded from that agent, by version, oldest first: a call asks for what
        # changed since the newest (DescribeRequest.since), and its reply may come after another call's (a TUI
        # polls while a capture is out), so a few are kept. A relay's children are held under the addresses the
        # relay reported.
        self._held: dict[str, dict[int, MachineSnapshot]] = {}
        self._relayed: dict[str, tuple[str, ...]] = {}  # a relay's address -> the addresses it relayed for

    def newest(self, address: str) -> int | None:
        """The version of the newest reading held of the agent at ``address``."""
        readings = self._held.get(address)
        return next(reversed(readings)) if readings else None

    def relayed_since(self, address: str) -> list[tuple[str, int]]:
        """For a relay: each agent it relayed for last time with the newest version held of it."""
        return [(a, v) for a in self._relayed.get(address, ()) if (v := self.newest(a)) is not None]

    def behind(self, address: str) -> list[tuple[str, MachineSnapshot | None]]:
        """For a relay: each agent it relayed for last time, with the newest reading held of it (None: none)."""
        out: list[tuple[str, MachineSnapshot | None]] = []
        for child in self._relayed.get(address, ()):
            readings = self._held.get(child)
            out.append((child, readings[next(reversed(readings))] if readings else None))
        return out

    def _hold(self, address: str, machine: MachineSnapshot, version: int | None) -> None:
        if version is None:  # an agent that does not version its readings: nothing to ask a delta against
            self._held.pop(address, None)
            return
        readings = self._held.setdefault(address, {})
        readings.pop(version, None)  # the same reading again is the newest one
        readings[version] = machine
        while len(readings) > HELD_READINGS:
            del readings[next(iter(readings))]

    def decode(self, reply: pb.MachineSnapshot, address: str) -> list[MachineSnapshot]:
        """The agent's reply (and what it relayed) decoded against what is held, and held in turn.

        A reply that does not fit raises, and what was held of that agent is dropped: the next call asks
        for the whole reading again.
        """
        try:
            held = held_from_proto(reply, address, lambda at, version: self._held.get(at, {}).get(version))
        except Exception:
            for child in self._relayed.pop(address, ()):
                self._held.pop(child, None)
            self._held.pop(address, None)
            raise
        for held_at, machine, version in held:
            self._hold(held_at, machine, version)
        self._relayed[address] = tuple(a for a, _, _ in held[1:])
        return [m for _, m, _ in held]


FIELD_DECODERS[(MachineSnapshot, "ranks")] = _decode_ranks
SPECIAL_DECODERS[RankCounters] = _decode_counters
INSTALLED.add("delta")
