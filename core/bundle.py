"""Bundles: snapshots saved as versioned JSON (see docs/bundle-format.md).

A bundle is what an engineer attaches to a ticket: one snapshot or a series,
plus optional ground truth (from a drill) and free-form metadata. Reading is
strict: a malformed bundle raises ``BundleError`` naming the exact field and
what was expected, never a bare traceback from deep inside the decoder.

The codec is generic over the frozen dataclasses of ``rankscope.snapshot``
so the JSON follows the contract field by field with no second schema to
keep in sync.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

from rankscope.errors import RankscopeError
from rankscope.snapshot import JobSnapshot

FORMAT = "rankscope.bundle"
VERSION = 1

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


def to_jsonable(value: Any) -> Any:
    """Turn contract dataclasses (and containers of them) into plain JSON values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    return value


def bundle_to_dict(bundle: Bundle) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "created_wall": bundle.created_wall,
        "ground_truth": to_jsonable(bundle.ground_truth) if bundle.ground_truth is not None else None,
        "meta": to_jsonable(bundle.meta),
        "snapshots": [to_jsonable(s) for s in bundle.snapshots],
    }


def dumps(bundle: Bundle, indent: int | None = None) -> str:
    return json.dumps(bundle_to_dict(bundle), indent=indent, allow_nan=False)


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
            try:
                return tuple([item(v) for v in data])
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
        return build(data)

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
    if version != VERSION:
        raise BundleError(
            f"{source}: bundle version {version!r} is not supported by this rankscope (reads version {VERSION}); "
            "upgrade rankscope or re-export the bundle"
        )
    raw = data.get("snapshots")
    if not isinstance(raw, list) or not raw:
        raise BundleError(f"{source}: 'snapshots' must be a non-empty list")
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


def loads(text: str, source: str = "bundle") -> Bundle:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BundleError(f"{source}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    return bundle_from_dict(data, source)


def read_bundle(path: str | Path) -> Bundle:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        # Neutral about the option: `analyze` takes the bundle as an argument, `attach` with --bundle.
        raise BundleError(f"{p}: no such file", "check the bundle's path (a file written by `rankscope snapshot -o`, "
                          "`w` in the TUI or the drill)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BundleError(f"{p}: cannot read the bundle ({exc})") from None
    return loads(text, str(p))
