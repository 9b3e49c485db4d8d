"""Packed number columns: a list of numbers as one base64 string (bundle version 4, docs/bundle-format.md).

A 16,384-rank bundle holds about a million counters, row numbers and
timestamps. As JSON numbers each is a token the parser reads and a value
the reader checks one by one; packed, a column is one string that the
standard library turns back into numbers in C. The form is a JSON object:

- ``{"int8" | "int16" | "int32" | "int64" | "float64": "<base64>"}``: the
  numbers, little-endian, the narrowest integer type that holds them all;
- the same with ``"lengths": {"int8" ...: "<base64>"}``: a list of lists of
  numbers, its lists' lengths in order and all their numbers one after the
  other.

Reading is strict: bad base64, a byte count that is not whole numbers, a
length that does not add up, or a float that is not finite raise
``PackError`` naming what is wrong.
"""

from __future__ import annotations

import base64
import binascii
import math
import sys
from array import array
from itertools import accumulate, chain
from typing import Any


class PackError(Exception):
    """A packed column that does not decode; the reader names the column."""


def _int_code(size: int) -> str:
    """The array typecode of a ``size``-byte integer on this platform."""
    code = next((c for c in ("b", "h", "i", "l", "q") if array(c).itemsize == size), None)
    if code is None:
        raise ImportError(f"this platform's array module has no {size}-byte integer")
    return code


# name -> (array typecode, smallest value, one past the largest); integers narrowest first.
_INTS: dict[str, tuple[str, int, int]] = {
    f"int{bits}": (_int_code(bits // 8), -(1 << (bits - 1)), 1 << (bits - 1)) for bits in (8, 16, 32, 64)}
FLOAT64 = "float64"
_CODES = {**{name: code for name, (code, _, _) in _INTS.items()}, FLOAT64: "d"}  # "d": a C double, IEEE binary64
_SWAP = sys.byteorder != "little"


def to_bytes(name: str, values: list[Any]) -> bytes:
    """``values`` as little-endian numbers of the type ``name`` (int8 ... int64, float64)."""
    a = array(_CODES[name], values)
    if _SWAP:
        a.byteswap()
    return a.tobytes()


def from_bytes(name: Any, data: bytes) -> list[Any]:
    """The numbers ``to_bytes`` wrote; ``PackError`` for a type it does not write or a byte count not whole."""
    code = _CODES.get(name) if isinstance(name, str) else None
    if code is None:
        raise PackError(f"{name!r} is not a packed number type ({', '.join(_CODES)})")
    a = array(code)
    if len(data) % a.itemsize:
        raise PackError(f"{name}: {len(data)} bytes is not a whole number of {a.itemsize}-byte values")
    a.frombytes(data)
    if _SWAP:
        a.byteswap()
    return a.tolist()


def int_type(values: list[int]) -> str | None:
    """The narrowest integer type that holds every one of ``values`` (int8 for none); None past 64 bits."""
    if not values:
        return "int8"
    lo, hi = min(values), max(values)
    return next((n for n, (_, low, high) in _INTS.items() if low <= lo and hi < high), None)


def _encode(name: str, values: list[Any]) -> dict[str, Any]:
    return {name: base64.b64encode(to_bytes(name, values)).decode("ascii")}


def pack_numbers(values: list[Any]) -> dict[str, Any] | None:
    """``values`` packed, or None when they are not all ints that fit 64 bits or all finite floats."""
    if not values:
        return None
    kinds = set(map(type, values))
    if kinds == {int}:
        name = int_type(values)
        return _encode(name, values) if name is not None else None
    if kinds == {float} and all(map(math.isfinite, values)):
        return _encode(FLOAT64, values)
    return None


def pack_lists(lists: list[Any]) -> dict[str, Any] | None:
    """A list of lists of numbers packed, or None when one is not a list or its numbers do not pack."""
    if not lists or set(map(type, lists)) != {list}:
        return None
    flat = list(chain.from_iterable(lists))
    numbers = pack_numbers(flat) if flat else {"int8": ""}
    lengths = pack_numbers(list(map(len, lists)))
    if numbers is None or lengths is None:
        return None
    return {**numbers, "lengths": lengths}


def is_packed(value: Any) -> bool:
    return type(value) is dict


def unpack(packed: Any) -> tuple[list[Any], type, list[int] | None]:
    """The numbers, their type (int or float) and, when ``packed`` has them, the lengths of its lists (checked to
    add up to the numbers: ``split`` makes the lists)."""
    if not isinstance(packed, dict):
        raise PackError("expected a packed column (an object)")
    names = [k for k in packed if k != "lengths"]
    if len(names) != 1 or names[0] not in _CODES:
        raise PackError(f"expected one of {', '.join(_CODES)} as the packed column's key, got {sorted(packed)}")
    (name,) = names
    values = _decode(name, packed[name])
    kind: type = float if name == FLOAT64 else int
    if kind is float and not all(map(math.isfinite, values)):
        raise PackError("holds a float that is not finite (NaN or infinity)")
    if "lengths" not in packed:
        return values, kind, None
    raw_lengths = packed["lengths"]
    if not isinstance(raw_lengths, dict) or len(raw_lengths) != 1 or next(iter(raw_lengths)) not in _INTS:
        raise PackError(f"lengths: expected one of {', '.join(_INTS)} as its key")
    ((lname, text),) = raw_lengths.items()
    lengths = _decode(lname, text)
    if lengths and min(lengths) < 0:
        raise PackError("lengths: a list cannot have a negative length")
    if sum(lengths) != len(values):
        raise PackError(f"lengths add up to {sum(lengths)} but {len(values)} numbers are packed")
    return values, kind, lengths


def split(items: tuple[Any, ...], lengths: list[int]) -> list[tuple[Any, ...]]:
    """``items`` cut into consecutive tuples of ``lengths`` (which add up to ``len(items)``)."""
    if len(set(lengths)) == 1:  # most columns: every rank has as many (ops, threads, ranks per machine)
        n = lengths[0]
        return [()] * len(lengths) if n == 0 else list(zip(*[iter(items)] * n, strict=True))
    return [items[end - n:end] for n, end in zip(lengths, accumulate(lengths), strict=True)]


def _decode(name: str, text: Any) -> list[Any]:
    if not isinstance(text, str):
        raise PackError(f"{name}: expected a base64 string")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise PackError(f"{name}: not base64 ({exc})") from None
    return from_bytes(name, data)
