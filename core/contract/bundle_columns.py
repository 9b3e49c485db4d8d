"""Version 3 of the bundle: the snapshots as columns of distinct values (see docs/bundle-format.md).

A 16,384-rank capture holds ~400,000 contract objects. Written one JSON object
each (versions 1 and 2) that is 97 MB whose field names alone are half the
bytes, and reading it built every object through a per-value checking decoder
(7.6 s). Here every contract type is one table: a column (a JSON list) per
field, one row per distinct object; an object-valued field holds the row
number of its value in that type's table, and a tuple of objects the number
of an entry in the type's list of distinct tuples. Equal objects (the frames
and stacks that thousands of ranks share) are one row, read once into one
shared object. Reading checks a whole column at a time and builds each
type's objects in one pass, the types an object refers to first.

Strict like the other versions: a value of the wrong type, a row number out
of range or columns of different lengths raise ``BundleError`` naming the
table, the column and the row.
"""

from __future__ import annotations

import typing
from itertools import chain
from typing import Any

from rankscope.contract.fast_make import maker
from rankscope.contract.packed import PackError, is_packed, pack_lists, pack_numbers, split, unpack
from rankscope.contract.schema import ENUM, FLOAT, INT, REF, REFS, SCALARS, Column, columns_of
from rankscope.contract.snapshot import JobSnapshot


class ColumnError(Exception):
    """A value that does not fit; ``bundle.py`` turns it into a BundleError with the bundle's name."""


def _types_in_order(root: type) -> list[type]:
    """Every contract type reachable from ``root``, each after the types its fields refer to."""
    order: list[type] = []
    visiting: set[type] = set()

    def visit(cls: type) -> None:
        if cls in order:
            return
        if cls in visiting:
            raise TypeError(f"{cls.__name__} refers to itself: no column form")
        visiting.add(cls)
        for f in columns_of(cls):
            if f.kind in (REF, REFS):
                visit(f.target)
        visiting.discard(cls)
        order.append(cls)

    visit(root)
    return order


TYPES = _types_in_order(JobSnapshot)
_FIELDS = {cls: columns_of(cls) for cls in TYPES}
_BY_NAME = {cls.__name__: cls for cls in TYPES}


# ---- writing -----------------------------------------------------------------------


class ColumnWriter:
    """Collects the snapshots' distinct objects into per-type tables.

    Each type's rows are added by a function written out for it (``_writer_code``): the generic loop over
    fields and their kinds cost ~4 us a field, 2 s of CPU for a 16,384-rank capture (the TUI's ``w``).
    """

    def __init__(self) -> None:
        self.columns: dict[type, dict[str, list[Any]]] = {cls: {f.name: [] for f in _FIELDS[cls]} for cls in TYPES}
        self.rows: dict[type, dict[Any, int]] = {cls: {} for cls in TYPES}  # a row's values -> its number
        self.by_id: dict[int, int] = {}  # id(object or tuple) -> its row or tuple number (the objects stay alive)
        self.tuples: dict[type, list[list[int]]] = {cls: [] for cls in TYPES}
        self.tuple_rows: dict[type, dict[tuple[int, ...], int]] = {cls: {} for cls in TYPES}
        namespace: dict[str, Any] = {"by_id": self.by_id, "by_id_get": self.by_id.get}
        for cls in TYPES:
            name = cls.__name__
            namespace[f"rows_{name}"] = self.rows[cls]
            namespace[f"known_{name}"] = self.tuple_rows[cls]
            namespace[f"tuples_{name}"] = self.tuples[cls]
            for i, f in enumerate(_FIELDS[cls]):
                namespace[f"c_{name}_{i}"] = self.columns[cls][f.name]
        for cls in TYPES:  # all in one namespace: a type's adder calls those of the types it refers to by name
            exec(_writer_code(cls), namespace)
        self._add = {cls: namespace[f"add_{cls.__name__}"] for cls in TYPES}
        self._add_tuple = {cls: namespace[f"tuple_{cls.__name__}"] for cls in TYPES}

    def add(self, obj: Any) -> int:
        """The row of ``obj`` in its type's table (added, with what it refers to, if new)."""
        return int(self._add[type(obj)](obj))

    def add_tuple(self, item: type, objs: tuple[Any, ...]) -> int:
        """The number of ``objs`` (objects of type ``item``) in that type's list of distinct tuples."""
        return int(self._add_tuple[item](objs))

    def jsonable(self, *, packed: bool = False) -> dict[str, Any]:
        """The tables and tuples as JSON values; ``packed`` (version 4): number columns as ``rankscope.contract.packed``
        forms where they fit one."""
        def column(f: Column, values: list[Any]) -> Any:
            if not packed:
                return values
            if f.kind in (INT, FLOAT, REF, REFS):
                return pack_numbers(values) or values
            if f.kind == SCALARS and f.target in (int, float):
                return pack_lists(values) or values
            return values

        return {
            "tables": {cls.__name__: {"rows": len(self.rows[cls]),
                                      "columns": {f.name: column(f, self.columns[cls][f.name]) for f in _FIELDS[cls]}}
                       for cls in TYPES if self.rows[cls]},
            "tuples": {cls.__name__: (packed and pack_lists(self.tuples[cls])) or self.tuples[cls]
                       for cls in TYPES if self.tuples[cls]},
        }


_WRITER_CODE: dict[type, Any] = {}


def _writer_code(cls: type) -> Any:
    """Compiled ``add_<Type>(obj)`` and ``tuple_<Type>(objs)`` for one type, from its fields only.

    ``add_`` gives the row of an object (an object seen before, by identity, or an equal one, by its values:
    one row), appending its values to the columns when new; object fields become the row numbers of their
    values and tuples of objects the numbers of their entries. ``tuple_`` does the same for a tuple.
    """
    code = _WRITER_CODE.get(cls)
    if code is not None:
        return code
    name = cls.__name__
    fields = _FIELDS[cls]
    lines = [f"def add_{name}(obj):", "    hit = by_id_get(id(obj))", "    if hit is not None:", "        return hit"]
    appends = []
    for i, f in enumerate(fields):
        lines.append(f"    v{i} = obj.{f.name}")
        convert = {REF: f"add_{f.target.__name__}(v{i})", REFS: f"tuple_{f.target.__name__}(v{i})",
                   SCALARS: f"tuple(v{i})", ENUM: f"v{i}.value"}.get(f.kind)  # (every target is a class)
        if convert is not None:
            lines.append(f"    if v{i} is not None:")
            lines.append(f"        v{i} = {convert}")
        appends.append(f"c_{name}_{i}.append(None if v{i} is None else list(v{i}))" if f.kind == SCALARS
                       else f"c_{name}_{i}.append(v{i})")
    lines += [f"    key = ({''.join(f'v{i}, ' for i in range(len(fields)))})",
              f"    row = rows_{name}.get(key)",
              "    if row is None:",
              f"        row = rows_{name}[key] = len(rows_{name})",
              *(f"        {a}" for a in appends),
              "    by_id[id(obj)] = row",
              "    return row",
              "",
              f"def tuple_{name}(objs):",
              "    hit = by_id_get(id(objs))",
              "    if hit is not None:",
              "        return hit",
              f"    key = tuple([add_{name}(o) for o in objs])",
              f"    number = known_{name}.get(key)",
              "    if number is None:",
              f"        number = known_{name}[key] = len(known_{name})",
              f"        tuples_{name}.append(list(key))",
              "    if objs:  # the empty tuple is one object everywhere: never key it by id",
              "        by_id[id(objs)] = number",
              "    return number",
              ""]
    code = _WRITER_CODE[cls] = compile("\n".join(lines), f"<column writer of {name}>", "exec")
    return code


# ---- reading -----------------------------------------------------------------------


def read_columns(data: dict[str, Any], snapshot_rows: Any) -> list[JobSnapshot]:
    """The snapshots whose JobSnapshot rows are ``snapshot_rows``, from a version-3 or -4 bundle's tables."""
    tables, tuples = data.get("tables"), data.get("tuples", {})
    if not isinstance(tables, dict):
        raise ColumnError("tables: expected an object of per-type tables")
    if not isinstance(tuples, dict):
        raise ColumnError("tuples: expected an object of per-type lists")
    built: dict[type, list[Any]] = {}
    built_tuples: dict[type, list[tuple[Any, ...]]] = {}
    for cls in TYPES:
        built[cls] = _read_table(cls, tables.get(cls.__name__), built, built_tuples)
        raw = tuples.get(cls.__name__, [])
        built_tuples[cls] = _read_tuples(cls, raw, built[cls])
    roots = built[JobSnapshot]
    if not isinstance(snapshot_rows, list) or not snapshot_rows:
        raise ColumnError("snapshots: expected a non-empty list of JobSnapshot row numbers")
    return [_index(roots, i, f"snapshots[{k}]", "JobSnapshot") for k, i in enumerate(snapshot_rows)]


def _index(table: list[Any], i: Any, where: str, name: str) -> Any:
    if type(i) is not int or not 0 <= i < len(table):
        raise ColumnError(f"{where}: {i!r} is not a row of {name} (it has {len(table)})")
    return table[i]


def _read_tuples(cls: type, raw: Any, rows: list[Any]) -> list[tuple[Any, ...]]:
    where = f"tuples.{cls.__name__}"
    n = len(rows)
    if is_packed(raw):
        items, lengths = _unpack_ints(raw, where, lists=True)
        if not _in_range(items, n):
            bad = next(i for i in items if not 0 <= i < n)
            raise ColumnError(f"{where}: {bad} is not a row of {cls.__name__} (it has {n})")
        return split(tuple([rows[i] for i in items]), lengths)
    if not isinstance(raw, list):
        raise ColumnError(f"{where}: expected a list of lists of row numbers")
    if set(map(type, raw)) <= {list} and set(map(type, items := list(chain.from_iterable(raw)))) <= {int} \
            and _in_range(items, n):
        return [tuple([rows[i] for i in e]) for e in raw]
    for k, entry in enumerate(raw):
        if type(entry) is not list:
            raise ColumnError(f"{where}[{k}]: expected a list of row numbers")
        for i in entry:
            if type(i) is not int or not 0 <= i < n:
                raise ColumnError(f"{where}[{k}]: {i!r} is not a row of {cls.__name__} (it has {n})")
    raise AssertionError("unreachable: a bad entry was found above")


def _read_table(cls: type, table: Any, built: dict[type, list[Any]],
                built_tuples: dict[type, list[tuple[Any, ...]]]) -> list[Any]:
    name = cls.__name__
    if table is None:
        return []
    if not isinstance(table, dict) or type(table.get("rows")) is not int or table["rows"] < 0:
        raise ColumnError(f"tables.{name}: expected an object with 'rows' (a count) and 'columns'")
    rows, columns = table["rows"], table.get("columns")
    if not isinstance(columns, dict):
        raise ColumnError(f"tables.{name}.columns: expected an object of columns")
    # The columns present are read (and their lengths checked against ``rows``) before a missing one is filled with
    # defaults: ``rows`` is the file's word, and only a column that holds that many values makes it true.
    read: dict[str, list[Any]] = {}
    for f in _FIELDS[cls]:
        where = f"tables.{name}.columns.{f.name}"
        col = columns.get(f.name)
        if col is None:
            if f.required:
                raise ColumnError(f"{where}: the column is missing but {name}.{f.name} has no default")
            continue
        if is_packed(col):
            read[f.name] = _read_packed(f, col, rows, where, built, built_tuples)
            continue
        if not isinstance(col, list) or len(col) != rows:
            raise ColumnError(f"{where}: expected a list of {rows} values")
        read[f.name] = _read_column(f, col, where, built, built_tuples)
    if rows and not read:
        raise ColumnError(f"tables.{name}: 'rows' says {rows} but no column holds them")
    values = [read[f.name] if f.name in read else [f.default] * rows for f in _FIELDS[cls]]
    # Every column holds ``rows`` values (checked above), so map walks them in step without zip's tuples.
    return list(map(maker(cls), *values)) if values else [cls() for _ in range(rows)]


def _read_column(f: Column, col: list[Any], where: str, built: dict[type, list[Any]],
                 built_tuples: dict[type, list[tuple[Any, ...]]]) -> list[Any]:
    kind = f.kind
    if kind in (REF, REFS):
        target = built[f.target] if kind == REF else built_tuples[f.target]
        n = len(target)
        found = set(map(type, col))
        if found <= {int, type(None)} and _in_range([i for i in col if i is not None] if type(None) in found else col, n):
            return _no_nulls(f, [None if i is None else target[i] for i in col], col, where)
        k, bad = next((k, i) for k, i in enumerate(col) if i is not None and (type(i) is not int or not 0 <= i < n))
        what = f.target.__name__ if kind == REF else f"tuples.{f.target.__name__}"
        raise ColumnError(f"{where}[{k}]: {bad!r} is not a row of {what} (it has {n})")
    if kind == ENUM:
        by_value = {m.value: m for m in f.target}
        try:
            return _no_nulls(f, [None if v is None else by_value[v] for v in col], col, where)
        except (KeyError, TypeError):
            k, bad = next((k, v) for k, v in enumerate(col) if v is not None and (type(v) not in (str, int, float, bool) or v not in by_value))
            raise ColumnError(f"{where}[{k}]: {bad!r} is not one of {', '.join(map(str, by_value))}") from None
    allowed = _ALLOWED[f.target]
    if kind == SCALARS:
        # The whole column's lists and their items checked in two passes, not list by list.
        if (lists := set(map(type, col))) <= {list, type(None)} and (found := set(map(type, chain.from_iterable(
                [v for v in col if v is not None] if type(None) in lists else col)))) <= allowed:
            if f.target is float and int in found:
                out = [None if v is None else tuple([float(x) for x in v]) for v in col]
            else:
                out = [None if v is None else tuple(v) for v in col]
            return _no_nulls(f, out, col, where)
        k = next(k for k, v in enumerate(col)
                 if v is not None and (type(v) is not list or not {type(x) for x in v} <= allowed))
        raise ColumnError(f"{where}[{k}]: expected a list of {f.target.__name__} values")
    found = set(map(type, col))  # a whole column at once
    if not found <= allowed | {type(None)}:
        k, bad = next((k, v) for k, v in enumerate(col) if v is not None and type(v) not in allowed)
        raise ColumnError(f"{where}[{k}]: expected {f.target.__name__}, got {type(bad).__name__}")
    if kind == FLOAT and int in found:  # JSON wrote a whole number of seconds without its ".0"
        col = [v if v is None or type(v) is float else float(v) for v in col]
    if not f.optional and type(None) in found:
        raise ColumnError(f"{where}[{col.index(None)}]: value is missing (null) but is required")
    return col


def _read_packed(f: Column, packed: Any, rows: int, where: str, built: dict[type, list[Any]],
                 built_tuples: dict[type, list[tuple[Any, ...]]]) -> list[Any]:
    """A packed column (version 4): its numbers' types are known, so only counts and row numbers are checked."""
    kind = f.kind
    if kind == SCALARS and f.target in (int, float):
        values, number, lengths = _unpack(packed, where)
        if lengths is None:
            raise ColumnError(f"{where}: a column of lists needs its lengths")
        if number is not f.target and f.target is int:
            raise ColumnError(f"{where}: expected int values, got float64")
        if len(lengths) != rows:
            raise ColumnError(f"{where}: expected {rows} lists, got {len(lengths)}")
        # whole numbers packed for a float field are read as floats
        return split(tuple(values) if number is f.target else tuple(map(float, values)), lengths)
    if kind not in (INT, FLOAT, REF, REFS):
        raise ColumnError(f"{where}: a column of {f.target.__name__} values cannot be packed")
    if kind == FLOAT:
        values, number, lengths = _unpack(packed, where)
        if lengths is not None:
            raise ColumnError(f"{where}: a column of single values has no lengths")
        if len(values) != rows:
            raise ColumnError(f"{where}: expected {rows} values, got {len(values)}")
        return values if number is float else [float(v) for v in values]
    values, _ = _unpack_ints(packed, where, lists=False)
    if len(values) != rows:
        raise ColumnError(f"{where}: expected {rows} values, got {len(values)}")
    if kind == INT:
        return values
    target = built[f.target] if kind == REF else built_tuples[f.target]
    n = len(target)
    if not _in_range(values, n):
        k, bad = next((k, i) for k, i in enumerate(values) if not 0 <= i < n)
        what = f.target.__name__ if kind == REF else f"tuples.{f.target.__name__}"
        raise ColumnError(f"{where}[{k}]: {bad!r} is not a row of {what} (it has {n})")
    return [target[i] for i in values]


def _unpack(packed: Any, where: str) -> tuple[list[Any], type, list[int] | None]:
    try:
        return unpack(packed)
    except PackError as exc:
        raise ColumnError(f"{where}: {exc}") from None


@typing.overload
def _unpack_ints(packed: Any, where: str, *, lists: typing.Literal[True]) -> tuple[list[int], list[int]]: ...
@typing.overload
def _unpack_ints(packed: Any, where: str, *, lists: typing.Literal[False]) -> tuple[list[int], None]: ...
def _unpack_ints(packed: Any, where: str, *, lists: bool) -> tuple[list[int], list[int] | None]:
    """The whole numbers of a packed column and, with ``lists``, its lengths (required then, refused otherwise)."""
    values, number, split = _unpack(packed, where)
    if number is not int:
        raise ColumnError(f"{where}: expected whole numbers, got float64")
    if lists and split is None:
        raise ColumnError(f"{where}: a packed list of lists needs its lengths")
    if not lists and split is not None:
        raise ColumnError(f"{where}: a column of single values has no lengths")
    return values, split


def _in_range(rows: list[int], n: int) -> bool:
    """Whether every row number (all ints) is a row of a table of ``n``."""
    return not rows or (min(rows) >= 0 and max(rows) < n)


def _no_nulls(f: Column, out: list[Any], col: list[Any], where: str) -> list[Any]:
    if not f.optional and None in col:
        raise ColumnError(f"{where}[{col.index(None)}]: value is missing (null) but is required")
    return out


# The JSON types a scalar field accepts (exactly: a bool is no integer here; an integer is a whole number of seconds).
_ALLOWED: dict[type, frozenset[type]] = {
    int: frozenset({int}), float: frozenset({float, int}), str: frozenset({str}), bool: frozenset({bool}),
}
