"""Contract objects of one type as columns on the wire (the compact form's ``Columns`` message).

A 16,384-rank capture carries ~180,000 operation counters. Sent one message
each, the client read every field of every message through protobuf's
attribute access (~4.6 us an object, 0.84 s). As columns, a field of all of a
machine's objects is one packed list that protobuf turns into a Python list in
C, and the objects are made in one pass over the columns (``fast_make.maker``).

The fields and their kinds are the contract's one column schema
(``rankscope.contract.schema``, which the bundle's tables use too). Only flat
types have a column form here: fields that are int, float, str or bool,
optional or not, and tuples of int, float or str; a field of another type
travels as a column of ints that the caller codes (``coded``: a thread's
frames as the number of its stack in the machine's stack table). A column is named by its
field; a reader fills a field without a column from its default (a column all
of whose values are the default is not sent), and ignores a column it does not
know (a newer sender's field).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from itertools import chain
from typing import Any

from rankscope.contract.fast_make import maker
from rankscope.contract.packed import FLOAT64, PackError, from_bytes, int_type, split, to_bytes
from rankscope.contract.schema import BOOL, FLOAT, INT, SCALARS, STR, Column, columns_of
from rankscope.wire.proto import rankscope_pb2 as pb

_INT, _FLOAT, _STR, _BOOL = int, float, str, bool
_SCALAR_KINDS = (_INT, _FLOAT, _STR, _BOOL)


class ColumnsError(Exception):
    """Columns that do not fit the type (``rankscope.wire.compact`` names the message they came in)."""


@dataclasses.dataclass(frozen=True)
class _Col:
    name: str
    kind: type  # int, float, str or bool: of the value, or of each item of a tuple
    is_tuple: bool
    optional: bool
    default: Any  # dataclasses.MISSING: the field must have a column


_PLANS: dict[tuple[type, frozenset[str]], list[_Col]] = {}
NOT_CODED: frozenset[str] = frozenset()


def _plan(cls: type, coded: frozenset[str]) -> list[_Col]:
    plan = _PLANS.get((cls, coded))
    if plan is None:
        plan = _PLANS[cls, coded] = [
            _Col(c.name, _INT, False, False, dataclasses.MISSING) if c.name in coded else _column_of(cls, c)
            for c in columns_of(cls)]
    return plan


def _column_of(cls: type, c: Column) -> _Col:
    """The wire's form of a column of the contract schema: flat kinds only (no tuple of bools)."""
    if c.kind in (INT, FLOAT, STR, BOOL):
        return _Col(c.name, c.target, False, c.optional, c.default)
    if c.kind == SCALARS and c.target is not _BOOL:
        return _Col(c.name, c.target, True, c.optional, c.default)
    raise TypeError(f"{cls.__name__}.{c.name}: a {c.kind} field has no column form on the wire")


# ---- writing ----------------------------------------------------------------------


def field_values(cls: type, objs: Sequence[Any]) -> list[list[Any]]:
    """Each field's values over ``objs``, in field order: what ``write_columns`` writes and ``read_values`` reads."""
    return [[getattr(o, f.name) for o in objs] for f in dataclasses.fields(cls)]


def write_columns(cls: type, values: list[list[Any]], msg: pb.Columns, coded: frozenset[str] = NOT_CODED) -> None:
    """Fill ``msg`` (empty) with ``values`` (as ``field_values`` gives them, the ``coded`` fields' values made ints)."""
    plan = _plan(cls, coded)
    rows = len(values[0]) if values else 0
    msg.rows = rows
    strings: dict[str, int] = {}

    def index(text: str) -> int:
        i = strings.get(text)
        if i is None:
            i = strings[text] = len(strings)
        return i

    for c, vals in zip(plan, values, strict=True):
        if c.default is not dataclasses.MISSING and all(v == c.default and type(v) is type(c.default)
                                                        for v in vals):
            continue  # the reader fills it from the default
        col = msg.columns.add(field=c.name)
        if c.optional:
            absent = [i for i, v in enumerate(vals) if v is None]
            if absent:
                col.absent.extend(absent)
                zero: Any = () if c.is_tuple else (0 if c.kind is not _STR else "")
                vals = [zero if v is None else v for v in vals]
        if c.is_tuple:
            col.lengths.extend(map(len, vals))
            vals = list(chain.from_iterable(vals))
        if c.kind is _FLOAT:
            col.type = FLOAT64
        else:
            if c.kind is not _INT:
                vals = list(map(index, vals)) if c.kind is _STR else list(map(int, vals))  # bools as 0 and 1
            name = int_type(vals)
            if name is None:
                raise ValueError(f"{cls.__name__}.{c.name}: a value does not fit 64 bits")
            col.type = name
        col.values = to_bytes(col.type, vals)
    msg.strings.extend(strings)


# ---- reading ----------------------------------------------------------------------


def read_values(cls: type, msg: pb.Columns, coded: frozenset[str] = NOT_CODED) -> list[list[Any]]:
    """Each field's values, in field order, checked against the type (the ``coded`` fields' as the ints sent, for
    the caller to turn into values); raises ``ColumnsError`` naming the column."""
    rows = msg.rows
    strings = list(msg.strings)
    given: dict[str, Any] = {}
    for col in msg.columns:
        if col.field in given:
            raise ColumnsError(f"column {col.field!r} is sent twice")
        given[col.field] = col
    out: list[list[Any]] = []
    for c in _plan(cls, coded):
        sent = given.get(c.name)
        if sent is None:
            if c.default is dataclasses.MISSING:
                raise ColumnsError(f"column {c.name!r} is missing and {cls.__name__}.{c.name} has no default")
            out.append([c.default] * rows)
            continue
        try:
            out.append(_read_column(c, sent, rows, strings))
        except ColumnsError as exc:
            raise ColumnsError(f"column {c.name!r}: {exc}") from None
    return out


def _read_column(c: _Col, col: Any, rows: int, strings: list[str]) -> list[Any]:
    if (col.type == FLOAT64) != (c.kind is _FLOAT):
        raise ColumnsError(f"holds {col.type or 'no type'} values for a field of type {c.kind.__name__}")
    try:
        values: list[Any] = from_bytes(col.type, col.values)
    except PackError as exc:
        raise ColumnsError(str(exc)) from None
    if c.kind is _STR:
        if values and (min(values) < 0 or max(values) >= len(strings)):
            raise ColumnsError(f"indexes a string outside the {len(strings)} sent")
        values = list(map(strings.__getitem__, values))
    elif c.kind is _BOOL:
        values = list(map(bool, values))
    if c.is_tuple:
        lengths = list(col.lengths)
        if len(lengths) != rows:
            raise ColumnsError(f"has {len(lengths)} lengths for {rows} rows")
        if sum(lengths) != len(values):
            raise ColumnsError(f"lengths add up to {sum(lengths)} but {len(values)} values are sent")
        values = split(tuple(values), lengths) if rows else []
    elif len(col.lengths):
        raise ColumnsError("has lengths but the field is not a tuple")
    elif len(values) != rows:
        raise ColumnsError(f"has {len(values)} values for {rows} rows")
    absent = col.absent
    if len(absent):
        if not c.optional:
            raise ColumnsError("marks values absent but the field is not optional")
        if min(absent) < 0 or max(absent) >= rows:
            raise ColumnsError(f"marks a row absent outside the {rows} rows")
        for i in absent:
            values[i] = None
    return values


def make_objects(cls: type, values: list[list[Any]]) -> list[Any]:
    """The objects whose field values ``values`` holds (as ``read_values`` gives them)."""
    return list(map(maker(cls), *values))
