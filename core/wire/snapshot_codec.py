"""A machine's reply <-> ``MachineSnapshot``: the entry to the codec for readings.

An agent encodes its reading with ``machine_to_proto`` (the compact form by
default); a client decodes a reply with ``machines_from_proto`` (the agent's
own reading and those it relayed), or with ``rankscope.wire.delta.held_from_proto``
when the reply may be a delta.
"""

from __future__ import annotations

from rankscope.contract.snapshot import (
    MachineSnapshot,
)
from rankscope.wire.codec import (
    ENCODING,
    encoder,
)
from rankscope.wire.compact import WireTables
from rankscope.wire.delta import decode_machine
from rankscope.wire.merge import merged_children
from rankscope.wire.proto import rankscope_pb2 as pb


def machine_to_proto(machine: MachineSnapshot, *, compact: bool = True) -> pb.MachineSnapshot:
    """``compact``: stacks and communicators as per-machine tables (see ``rankscope.proto``'s StackTable).

    A client decodes both forms; the plain form is what agents sent before the tables existed.
    """
    msg = pb.MachineSnapshot()
    if not compact:
        encoder(MachineSnapshot)(machine, msg)
        return msg
    tables = WireTables()
    ENCODING.tables = tables
    try:
        encoder(MachineSnapshot)(machine, msg)
    finally:
        ENCODING.tables = None
    tables.write(msg)
    return msg


def machine_from_proto(msg: pb.MachineSnapshot) -> MachineSnapshot:
    """One agent's own reply (without what it relayed: ``machines_from_proto`` gives those too)."""
    return decode_machine(msg, "MachineSnapshot")


def machines_from_proto(msg: pb.MachineSnapshot) -> list[MachineSnapshot]:
    """An agent's reply and, for a relaying agent, the replies it forwarded or merged (its own first, depth
    first)."""
    return machines_from_proto_at(msg, "MachineSnapshot")


def machines_from_proto_at(msg: pb.MachineSnapshot, where: str) -> list[MachineSnapshot]:
    out = [decode_machine(msg, where)]
    for i, child in enumerate(msg.relayed):
        out.extend(machines_from_proto_at(child, f"{where}.relayed[{i}]"))
    if msg.HasField("merged"):
        merged_children(msg, where, lambda child, at: out.extend(machines_from_proto_at(child, at)))
    return out
