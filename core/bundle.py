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


def write_bundle(bundle: Bundle, path: str | Path) -> Path:
    """Write atomically: a reader never sees half a bundle."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(dumps(bundle), encoding="utf-8")
    tmp.replace(target)
    return target


# --------------------------------------------------------------------------
# decoding
# --------------------------------------------------------------------------


def from_jsonable(cls: type[T], data: Any, where: str = "$") -> T:
    """Rebuild a contract dataclass from JSON values, checking every field."""
    return typing.cast(T, _decode(cls, data, where))


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = typing.get_type_hints(cls)
        _HINTS[cls] = hints
    return hints


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _decode(tp: Any, data: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if data is None:
            if type(None) in args:
                return None
            raise BundleError(f"{where}: value is missing (null) but is required")
        errors: list[str] = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _decode(arg, data, where)
            except BundleError as exc:
                errors.append(str(exc))
        raise BundleError(errors[0] if errors else f"{where}: unexpected value {data!r}")
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(data, list):
            raise BundleError(f"{where}: expected a list, got {type(data).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v, f"{where}[{i}]") for i, v in enumerate(data))
        if len(args) != len(data):
            raise BundleError(f"{where}: expected {len(args)} items, got {len(data)}")
        return tuple(_decode(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, data, strict=True)))
    if origin in (Mapping, dict) or tp is Any:
        if tp is not Any and not isinstance(data, dict):
            raise BundleError(f"{where}: expected an object, got {type(data).__name__}")
        return data
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(data, dict):
            raise BundleError(f"{where}: expected an object for {tp.__name__}, got {type(data).__name__}")
        hints = _hints(tp)
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(tp):
            if f.name in data:
                kwargs[f.name] = _decode(hints[f.name], data[f.name], f"{where}.{f.name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise BundleError(f"{where}: required field '{f.name}' of {tp.__name__} is missing")
        return tp(**kwargs)
    if isinstance(tp, type) and issubclass(tp, Enum):
        try:
            return tp(data)
        except ValueError:
            allowed = ", ".join(str(m.value) for m in tp)
            raise BundleError(f"{where}: {data!r} is not one of {allowed}") from None
    if tp is float:
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            raise BundleError(f"{where}: expected a number, got {type(data).__name__}")
        return float(data)
    if tp is int:
        if isinstance(data, bool) or not isinstance(data, int):
            raise BundleError(f"{where}: expected an integer, got {type(data).__name__}")
        return data
    if tp in (str, bool):
        if not isinstance(data, tp):
            raise BundleError(f"{where}: expected {_type_name(tp)}, got {type(data).__name__}")
        return data
    raise BundleError(f"{where}: cannot decode type {_type_name(tp)}")


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
        raise BundleError(f"{p}: no such file; check the path given to --bundle") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BundleError(f"{p}: cannot read the bundle ({exc})") from None
    return loads(text, str(p))
