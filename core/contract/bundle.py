"""Bundles: snapshots saved as versioned JSON (see docs/bundle-format.md).

A bundle is what an engineer attaches to a ticket: one snapshot or a series,
plus optional ground truth (from a drill) and free-form metadata. Reading is
strict: a malformed bundle raises ``BundleError`` naming the exact field and
what was expected, never a bare traceback from deep inside the decoder.

The codec is generic over the frozen dataclasses of ``rankscope.contract.snapshot``
so the JSON follows the contract field by field with no second schema to
keep in sync.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

from rankscope.contract.bundle_columns import ColumnError, ColumnWriter, read_columns
from rankscope.contract.errors import RankscopeError
from rankscope.contract.heap import collector_paused
from rankscope.contract.snapshot import Communicator, Frame, JobSnapshot, RankCounters, ThreadStack

FORMAT = "rankscope.bundle"
# What is written: 2 added per-snapshot frame, stack and communicator tables; 3 writes every contract type as
# columns of distinct values (rankscope.contract.bundle_columns; docs/bundle-format.md); 4 packs its number
# columns (rankscope.contract.packed).
VERSION = 4
READS = (1, 2, 3, 4)
# A bundle is an outside file: bounded before it is read. 16,384 ranks take 34-97 MB a snapshot.
MAX_BUNDLE_BYTES = 4 * 1024 ** 3

T = TypeVar("T")


class BundleError(RankscopeError, ValueError):
    """A bundle could not be read; the message names the field and the fix."""

    def __init__(self, message: str, fix: str = "check that the file is a bundle written by `rankscope snapshot -o` or `w` in the TUI") -> None:
        super().__init__(message, fix)


@dataclass(frozen=True, slots=True)
class Bundle:
    """A series of snapshots (oldest first) with what is known about them."""

    snapshots: tuple[JobSnapshot, ...]
    created_wall: float
    ground_truth: Mapping[str, Any] | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)

    @property
    def latest(self) -> JobSnapshot:
        return self.snapshots[-1]


# --------------------------------------------------------------------------
# encoding
# --------------------------------------------------------------------------


Hooks = Mapping[type, typing.Callable[[Any], Any]]


def to_jsonable(value: Any, hooks: Hooks | None = None) -> Any:
    """Turn contract dataclasses (and containers of them) into plain JSON values.

    ``hooks``: types written another way (the tables of version 2).
    """
    if hooks is not None and (hook := hooks.get(type(value))) is not None:
        return hook(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name), hooks) for f in dataclasses.fields(value)}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [to_jsonable(v, hooks) for v in value]
    if isinstance(value, (set, frozenset)):  # a set of facts (a suspect's sides): sorted, so the output is stable
        return sorted((to_jsonable(v, hooks) for v in value), key=str)
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v, hooks) for k, v in value.items()}
    return value


class _Tables:
    """One snapshot's distinct frames, stacks and communicators (version 2): ranks of a job share most of them."""

    def __init__(self) -> None:
        self.frames: dict[Frame, int] = {}
        self.stacks: dict[tuple[Frame, ...], int] = {}
        self.stack_by_id: dict[int, int] = {}
        self.comms: dict[Communicator, int] = {}
        self.hooks: Hooks = {ThreadStack: self.thread, RankCounters: self.counters}

    def stack(self, frames: tuple[Frame, ...]) -> int:
        i = self.stack_by_id.get(id(frames))
        if i is None:
            i = self.stacks.setdefault(frames, len(self.stacks))
            self.stack_by_id[id(frames)] = i
            for f in frames:
                self.frames.setdefault(f, len(self.frames))
        return i

    def thread(self, t: ThreadStack) -> dict[str, Any]:
        out = {f.name: to_jsonable(getattr(t, f.name)) for f in dataclasses.fields(t) if f.name != "frames"}
        out["stack"] = self.stack(t.frames)
        return out

    def counters(self, c: RankCounters) -> dict[str, Any]:
        out = {f.name: to_jsonable(getattr(c, f.name)) for f in dataclasses.fields(c) if f.name != "communicators"}
        out["communicator_refs"] = [self.comms.setdefault(m, len(self.comms)) for m in c.communicators]
        return out

    def snapshot(self, snap: JobSnapshot) -> dict[str, Any]:
        out: dict[str, Any] = to_jsonable(snap, self.hooks)
        out["frame_table"] = [to_jsonable(f) for f in self.frames]
        out["stack_table"] = [[self.frames[f] for f in frames] for frames in self.stacks]
        out["communicator_table"] = [to_jsonable(c) for c in self.comms]
        return out


def bundle_to_dict(bundle: Bundle, *, compact: bool = False, version: int | None = None) -> dict[str, Any]:
    """The bundle as JSON values: version 1 (every field in place, for tools that edit bundles), or with
    ``compact`` the newest (what ``dumps`` and ``write_bundle`` write); ``version`` picks one of READS."""
    version = version if version is not None else (VERSION if compact else 1)
    out: dict[str, Any] = {
        "format": FORMAT,
        "version": version,
        "created_wall": bundle.created_wall,
        "ground_truth": to_jsonable(bundle.ground_truth) if bundle.ground_truth is not None else None,
        "meta": to_jsonable(bundle.meta),
    }
    if version in (3, 4):
        writer = ColumnWriter()
        out["snapshots"] = [writer.add(s) for s in bundle.snapshots]
        out.update(writer.jsonable(packed=version == 4))
    elif version == 2:
        out["snapshots"] = [_Tables().snapshot(s) for s in bundle.snapshots]
    elif version == 1:
        out["snapshots"] = [to_jsonable(s) for s in bundle.snapshots]
    else:
        raise ValueError(f"bundle version {version} is not one this rankscope writes ({READS})")
    return out


def dumps(bundle: Bundle, indent: int | None = None, *, version: int = VERSION) -> str:
    with collector_paused():  # as in ``loads``: many containers made, none in a cycle
        return json.dumps(bundle_to_dict(bundle, version=version), indent=indent, allow_nan=False)


def write_bundle(bundle: Bundle, path: str | Path, text: str | None = None) -> Path:
    """Write atomically: a reader never sees half a bundle. ``text``: ``dumps(bundle)`` when the caller has it."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(dumps(bundle) if text is None else text, encoding="utf-8")
    tmp.replace(target)
    return target


# --------------------------------------------------------------------------
# decoding
# --------------------------------------------------------------------------


def from_jsonable(cls: type[T], data: Any, where: str = "$") -> T:
    """Rebuild a contract dataclass from JSON values, checking every field."""
    try:
        return typing.cast(T, _decoder(cls)(data))
    except _FieldError as exc:
        raise BundleError(f"{where}{''.join(reversed(exc.path))}: {exc.problem}") from None
    finally:
        _MEMO.clear()
        _SHARED.clear()


# Decoding is compiled once per type into a closure: a 16k-rank bundle holds
# millions of values, and re-inspecting type hints for each one cost seconds.
# Paths are only built on the way out of an error, never for good values.

Decoder = typing.Callable[[Any], Any]


class _FieldError(Exception):
    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem
        self.path: list[str] = []  # innermost part first


_DECODERS: dict[Any, Decoder] = {}
# Decoded leaf objects of the bundle being read (see _dataclass_decoder); emptied after each read.
_MEMO: dict[tuple[Any, ...], Any] = {}
# Decoded values of JSON objects and lists that a version-2 table made shared (one stack referred to by
# thousands of threads), by (decoder, id of the JSON value); emptied after each read, while the JSON lives.
_SHARED: dict[tuple[int, int], Any] = {}


def _is_scalar(tp: Any) -> bool:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return all(_is_scalar(a) for a in typing.get_args(tp))
    return tp in (str, int, float, bool, type(None)) or (isinstance(tp, type) and issubclass(tp, Enum))


def _decoder(tp: Any) -> Decoder:
    dec = _DECODERS.get(tp)
    if dec is None:
        dec = _build_decoder(tp)
        _DECODERS[tp] = dec
    return dec


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _build_decoder(tp: Any) -> Decoder:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _union_decoder(tp)
    if origin is tuple:
        return _tuple_decoder(tp)
    if origin in (Mapping, dict) or tp is Any:
        return _mapping_decoder(tp is Any)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _dataclass_decoder(tp)
    if isinstance(tp, type) and issubclass(tp, Enum):
        return _enum_decoder(tp)
    if tp is float:
        return _float
    if tp is int:
        return _int
    if tp in (str, bool):
        return _exact(tp)
    raise TypeError(f"the bundle codec cannot decode {_type_name(tp)}")


def _union_decoder(tp: Any) -> Decoder:
    args = typing.get_args(tp)
    optional = type(None) in args
    decoders = [_decoder(a) for a in args if a is not type(None)]

    def decode(data: Any) -> Any:
        if data is None:
            if optional:
                return None
            raise _FieldError("value is missing (null) but is required")
        first: _FieldError | None = None
        for dec in decoders:
            try:
                return dec(data)
            except _FieldError as exc:
                first = first or exc
        raise first or _FieldError(f"unexpected value {data!r}")

    return decode


def _tuple_decoder(tp: Any) -> Decoder:
    args = typing.get_args(tp)
    if len(args) == 2 and args[1] is Ellipsis:
        item = _decoder(args[0])

        def decode_var(data: Any) -> Any:
            if not isinstance(data, list):
                raise _FieldError(f"expected a list, got {type(data).__name__}")
            key = (id(decode_var), id(data))
            hit = _SHARED.get(key)
            if hit is not None:
                return hit
            try:
                made = _SHARED[key] = tuple([item(v) for v in data])
                return made
            except _FieldError as exc:
                for i, v in enumerate(data):  # find which item, only on the error path
                    try:
                        item(v)
                    except _FieldError:
                        exc.path.append(f"[{i}]")
                        break
                raise

        return decode_var
    items = [_decoder(a) for a in args]

    def decode_fixed(data: Any) -> Any:
        if not isinstance(data, list):
            raise _FieldError(f"expected a list, got {type(data).__name__}")
        if len(items) != len(data):
            raise _FieldError(f"expected {len(items)} items, got {len(data)}")
        out = []
        for i, (dec, v) in enumerate(zip(items, data, strict=True)):
            try:
                out.append(dec(v))
            except _FieldError as exc:
                exc.path.append(f"[{i}]")
                raise
        return tuple(out)

    return decode_fixed


def _mapping_decoder(anything: bool) -> Decoder:
    def decode(data: Any) -> Any:
        if not anything and not isinstance(data, dict):
            raise _FieldError(f"expected an object, got {type(data).__name__}")
        return data

    return decode


def _dataclass_decoder(cls: type) -> Decoder:
    hints = typing.get_type_hints(cls)
    fields = [
        (f.name, f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        for f in dataclasses.fields(cls)
    ]
    # Filled lazily: a contract type may refer to itself (nested stacks) or to
    # types declared further down.
    decoders: dict[str, Decoder] = {}

    leaf = all(_is_scalar(hints[name]) for name, _ in fields)

    def decode(data: Any) -> Any:
        if not isinstance(data, dict):
            raise _FieldError(f"expected an object for {cls.__name__}, got {type(data).__name__}")
        if leaf:
            # Thousands of ranks share the same frames: decode each distinct one
            # once and share the (frozen) object, which also saves most of the memory.
            values = [data.get(name) for name, _ in fields]
            # types are part of the key so that `true` never passes as a cached `1`
            key = (cls, len(data), *values, *map(type, values))
            try:
                hit = _MEMO.get(key)
            except TypeError:  # an unhashable value: let the decoder report it
                hit = None
            if hit is not None:
                return hit
            made = build(data)
            with contextlib.suppress(TypeError):
                _MEMO[key] = made
            return made
        key = (id(decode), id(data))
        hit = _SHARED.get(key)
        if hit is None:
            hit = _SHARED[key] = build(data)
        return hit

    def build(data: dict[str, Any]) -> Any:
        if not decoders:
            decoders.update({name: _decoder(hints[name]) for name, _ in fields})
        kwargs: dict[str, Any] = {}
        for name, required in fields:
            if name in data:
                try:
                    kwargs[name] = decoders[name](data[name])
                except _FieldError as exc:
                    exc.path.append(f".{name}")
                    raise
            elif required:
                raise _FieldError(f"required field '{name}' of {cls.__name__} is missing")
        return cls(**kwargs)

    return decode


def _enum_decoder(cls: type[Enum]) -> Decoder:
    by_value = {m.value: m for m in cls}
    allowed = ", ".join(str(v) for v in by_value)

    def decode(data: Any) -> Any:
        try:
            return by_value[data]
        except (KeyError, TypeError):
            raise _FieldError(f"{data!r} is not one of {allowed}") from None

    return decode


def _float(data: Any) -> float:
    if isinstance(data, bool) or not isinstance(data, (int, float)):
        raise _FieldError(f"expected a number, got {type(data).__name__}")
    return float(data)


def _int(data: Any) -> int:
    if isinstance(data, bool) or not isinstance(data, int):
        raise _FieldError(f"expected an integer, got {type(data).__name__}")
    return data


def _exact(tp: type) -> Decoder:
    def decode(data: Any) -> Any:
        if not isinstance(data, tp):
            raise _FieldError(f"expected {_type_name(tp)}, got {type(data).__name__}")
        return data

    return decode


def bundle_from_dict(data: Any, source: str = "bundle") -> Bundle:
    if not isinstance(data, dict):
        raise BundleError(f"{source}: not a rankscope bundle (top level is not a JSON object)")
    if data.get("format") != FORMAT:
        raise BundleError(f"{source}: not a rankscope bundle (format is {data.get('format')!r}, expected {FORMAT!r})")
    version = data.get("version")
    if version not in READS or isinstance(version, bool):
        raise BundleError(
            f"{source}: bundle version {version!r} is not supported by this rankscope (reads versions "
            f"{', '.join(map(str, READS))}); upgrade rankscope or re-export the bundle"
        )
    raw = data.get("snapshots")
    if not isinstance(raw, list) or not raw:
        raise BundleError(f"{source}: 'snapshots' must be a non-empty list")
    if version in (3, 4):
        try:
            snaps = tuple(read_columns(data, raw))
        except ColumnError as exc:
            raise BundleError(f"{source}: {exc}") from None
    else:
        if version == 2:
            for i, s in enumerate(raw):
                _resolve_tables(s, f"{source}: snapshots[{i}]")
        snaps = tuple(from_jsonable(JobSnapshot, s, f"snapshots[{i}]") for i, s in enumerate(raw))
    created = data.get("created_wall", snaps[-1].captured.wall)
    if isinstance(created, bool) or not isinstance(created, (int, float)):
        raise BundleError(f"{source}: 'created_wall' must be a number")
    gt = data.get("ground_truth")
    if gt is not None and not isinstance(gt, dict):
        raise BundleError(f"{source}: 'ground_truth' must be an object or null")
    meta = data.get("meta") or {}
    if not isinstance(meta, dict):
        raise BundleError(f"{source}: 'meta' must be an object")
    return Bundle(snapshots=snaps, created_wall=float(created), ground_truth=gt, meta=meta)


def _resolve_tables(snap: Any, where: str) -> None:
    """Put a version-2 snapshot's shared frames and groups back where they are referred to (the same JSON
    value for every reference, so each is decoded once); a bad reference names its field."""
    if not isinstance(snap, dict):
        return  # the decoder says what is wrong
    frames, stacks, comms = (snap.pop(k, []) for k in ("frame_table", "stack_table", "communicator_table"))
    for name, table in (("frame_table", frames), ("stack_table", stacks), ("communicator_table", comms)):
        if not isinstance(table, list):
            raise BundleError(f"{where}.{name}: expected a list, got {type(table).__name__}")

    def ref(table: list[Any], i: Any, at: str) -> Any:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(table):
            raise BundleError(f"{where}{at}: {i!r} is not an index into a table of {len(table)}")
        return table[i]

    resolved = []
    for s_i, stack in enumerate(stacks):
        if not isinstance(stack, list):
            raise BundleError(f"{where}.stack_table[{s_i}]: expected a list of frame indexes")
        resolved.append([ref(frames, f, f".stack_table[{s_i}]") for f in stack])
    machines = snap.get("machines")
    for m_i, m in enumerate(machines if isinstance(machines, list) else ()):
        if not isinstance(m, dict):
            continue
        for s_i, rank in enumerate(m.get("stacks") or ()):
            if not isinstance(rank, dict):
                continue
            procs = [("main", rank.get("main"))] + [(f"subprocesses[{k}]", p)
                                                    for k, p in enumerate(rank.get("subprocesses") or ())]
            for p_name, proc in procs:
                threads = proc.get("threads") if isinstance(proc, dict) else None
                for t_i, t in enumerate(threads if isinstance(threads, list) else ()):
                    if isinstance(t, dict) and "stack" in t:
                        at = f".machines[{m_i}].stacks[{s_i}].{p_name}.threads[{t_i}].stack"
                        t["frames"] = ref(resolved, t.pop("stack"), at)
        for c_i, c in enumerate(m.get("counters") or ()):
            if isinstance(c, dict) and "communicator_refs" in c:
                refs = c.pop("communicator_refs")
                at = f".machines[{m_i}].counters[{c_i}].communicator_refs"
                if not isinstance(refs, list):
                    raise BundleError(f"{where}{at}: expected a list of indexes")
                c["communicators"] = [ref(comms, r, at) for r in refs]


def loads(text: str, source: str = "bundle") -> Bundle:
    # Reading makes hundreds of thousands of objects that all live on, none of them in a cycle: the cyclic
    # collector would only walk them again and again as they pile up (a third of the time at 16k ranks).
    with collector_paused():
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise BundleError(f"{source}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
        except RecursionError:
            raise BundleError(f"{source}: not a rankscope bundle (its JSON is nested deeper than Python can read; "
                              "a bundle nests a few levels)") from None
        except ValueError as exc:  # an integer of more than sys.get_int_max_str_digits() digits
            raise BundleError(f"{source}: not a rankscope bundle ({str(exc).split(';')[0]})") from None
        try:
            return bundle_from_dict(data, source)
        except RecursionError:
            raise BundleError(f"{source}: not a rankscope bundle (a value nests deeper than a bundle's do)") from None


def read_bundle(path: str | Path) -> Bundle:
    p = Path(path)
    try:
        with p.open("rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size > MAX_BUNDLE_BYTES:
                raise BundleError(f"{p}: {size / 1024 ** 3:.1f} GiB is more than a bundle can be "
                                  f"({MAX_BUNDLE_BYTES // 1024 ** 3} GiB)")
            # Read by the size it has, not by the limit: read(n) sets aside n bytes before reading any.
            text = fh.read(size + 1).decode("utf-8")
    except FileNotFoundError:
        # Neutral about the option: `analyze` takes the bundle as an argument, `attach` with --bundle.
        raise BundleError(f"{p}: no such file", "check the bundle's path (a file written by `rankscope snapshot -o`, "
                          "`w` in the TUI or the drill)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BundleError(f"{p}: cannot read the bundle ({exc})") from None
    return loads(text, str(p))
