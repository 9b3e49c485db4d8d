"""PyTorch flight-recorder entries as records: what a dump's reader and the analyzer that judges dumps share.

``read_entry`` turns one entry of a rank's dump (pickle or JSON, already
loaded) into a ``FrOp`` and names what was wrong with it; ``parse_members``
reads a group's members as dumps write them. ``formats.flight_recorder``
reads the files with them; ``analyzers.flight_recorder`` judges the ops.
Stdlib and the operations' vocabulary only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rankscope.contract.vocabulary import is_point_to_point

INTS = re.compile(r"-?\d+")


@dataclass(frozen=True, slots=True)
class FrOp:
    """One readable flight-recorder entry of one rank."""

    rank: int
    record_id: int | None
    pg_name: str
    pg_desc: str
    op: str  # "all_reduce", "send", "coalesced", ...
    peer: str  # p2p's "0->1" / "1<-0" (group-local ranks), else ""
    is_p2p: bool
    seq: int  # collective_seq_id, or p2p_seq_id for p2p ops
    input_sizes: tuple[tuple[int, ...], ...] | None
    output_sizes: tuple[tuple[int, ...], ...] | None
    input_dtypes: tuple[str, ...] | None
    output_dtypes: tuple[str, ...] | None
    state: str | None


def whole_number(value: Any) -> int | None:
    """A dump's integer field, as dumps write it (an int, a float with no fraction, a numeric string); else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _sizes(value: Any) -> tuple[tuple[int, ...], ...] | None:
    if not isinstance(value, list | tuple):
        return None
    out: list[tuple[int, ...]] = []
    for shape in value:
        if not isinstance(shape, list | tuple):
            return None
        if all(type(d) is int for d in shape):  # the usual case, without a parse per dimension
            out.append(tuple(shape))
            continue
        dims = [whole_number(d) for d in shape]
        if any(d is None for d in dims):
            return None
        out.append(tuple(d for d in dims if d is not None))
    return tuple(out)


def _dtypes(value: Any) -> tuple[str, ...] | None:
    if isinstance(value, str):  # PyTorch's own tests write one dtype as a string
        return (value,) if value else ()
    if isinstance(value, list | tuple) and all(isinstance(d, str) for d in value):
        return tuple(value)
    return None


def read_entry(raw: Any, rank: int) -> tuple[FrOp | None, list[str]]:
    """One dump entry as an op, and what was wrong with it (an op of None: unusable)."""
    if not isinstance(raw, Mapping):
        return None, [f"an entry that is a {type(raw).__name__}, not a mapping"]
    problems: list[str] = []
    pg = raw.get("process_group")
    if not isinstance(pg, list | tuple) or not pg or not isinstance(pg[0], str | int):
        return None, ["no process_group"]
    pg_name = str(pg[0])
    pg_desc = str(pg[1]) if len(pg) > 1 and isinstance(pg[1], str | int) else ""
    name = raw.get("profiling_name")
    if not isinstance(name, str) or not name.strip():
        return None, ["no profiling_name"]
    body = name.split(":", 1)[1] if ":" in name else name
    parts = body.strip().split(" ", 1)
    op = parts[0]
    peer = parts[1].strip() if len(parts) > 1 else ""
    p2p_flag = raw.get("is_p2p")
    is_p2p = bool(p2p_flag) if isinstance(p2p_flag, bool) else is_point_to_point(op)
    seq = whole_number(raw.get("p2p_seq_id" if is_p2p else "collective_seq_id"))
    if seq is None:
        return None, ["no " + ("p2p_seq_id" if is_p2p else "collective_seq_id")]
    record = whole_number(raw.get("record_id"))
    if "record_id" in raw and record is None:
        problems.append("record_id")
    fields: dict[str, Any] = {}
    for key, parse in (("input_sizes", _sizes), ("output_sizes", _sizes),
                       ("input_dtypes", _dtypes), ("output_dtypes", _dtypes)):
        got = parse(raw.get(key)) if key in raw else None
        if key in raw and got is None:
            problems.append(key)
        fields[key] = got
    state = raw.get("state")
    if state is not None and not isinstance(state, str):
        problems.append("state")
        state = None
    return FrOp(rank, record, pg_name, pg_desc, op, peer, is_p2p, seq, fields["input_sizes"],
                fields["output_sizes"], fields["input_dtypes"], fields["output_dtypes"], state), problems


def parse_members(value: Any) -> tuple[int, ...] | None:
    """pg_config's ``ranks``: a list, or the string "[0, 1]" real dumps hold."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            value = [int(x) for x in INTS.findall(value)]
    if not isinstance(value, list | tuple):
        return None
    ranks = [whole_number(r) for r in value]
    if any(r is None for r in ranks):
        return None
    return tuple(sorted({r for r in ranks if r is not None})) or None


__all__ = ["INTS", "FrOp", "parse_members", "read_entry", "whole_number"]
