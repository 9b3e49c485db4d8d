"""The column schema of the contract types: one description of each dataclass field, read from its type.

Two column codecs use it: the bundle's tables (``rankscope.contract.bundle_columns``,
versions 3 and 4 of the saved form) and the compact form on the wire
(``rankscope.wire.columns``, a machine's processes, threads and operation
counters). Each field is one ``Column``: its name, its kind (a scalar, a tuple
of scalars, an enum, another contract object or a tuple of them), whether it
may be None, and its default (``dataclasses.MISSING``: none, the column is
required). What each codec does with a kind is its own; which kind a field is
is decided here once.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from enum import Enum
from typing import Any

# A field's kind: a scalar (int, float, str, bool), a tuple of scalars, an enum, a contract object, a tuple of them.
INT, FLOAT, STR, BOOL, SCALARS, ENUM, REF, REFS = "int", "float", "str", "bool", "scalars", "enum", "ref", "refs"
_SCALAR_KIND = {int: INT, float: FLOAT, str: STR, bool: BOOL}


@dataclasses.dataclass(frozen=True)
class Column:
    name: str
    kind: str
    optional: bool
    target: Any  # the scalar type (of the value, or of each item of a tuple), the enum class or the referred dataclass
    default: Any  # dataclasses.MISSING: the field has no default, so its column must be there

    @property
    def required(self) -> bool:
        return self.default is dataclasses.MISSING


_SCHEMAS: dict[type, tuple[Column, ...]] = {}


def columns_of(cls: type) -> tuple[Column, ...]:
    """The columns of dataclass ``cls``, in field order; TypeError for a field that has no column form."""
    schema = _SCHEMAS.get(cls)
    if schema is None:
        hints = typing.get_type_hints(cls)
        schema = _SCHEMAS[cls] = tuple(_column(cls, f, hints[f.name]) for f in dataclasses.fields(cls))
    return schema


def _column(cls: type, f: dataclasses.Field[Any], tp: Any) -> Column:
    optional = False
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"{cls.__name__}.{f.name}: only X | None unions have a column form")
        optional, tp = True, args[0]
    target: Any
    if typing.get_origin(tp) is tuple:
        (item, _) = typing.get_args(tp)
        if dataclasses.is_dataclass(item):
            kind, target = REFS, item
        elif item in _SCALAR_KIND:
            kind, target = SCALARS, item
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: tuples of {item!r} have no column form")
    elif isinstance(tp, type) and dataclasses.is_dataclass(tp):
        kind, target = REF, tp
    elif isinstance(tp, type) and issubclass(tp, Enum):
        kind, target = ENUM, tp
    elif tp in _SCALAR_KIND:
        kind, target = _SCALAR_KIND[tp], tp
    else:
        raise TypeError(f"{cls.__name__}.{f.name}: {tp!r} has no column form")
    default = f.default if f.default is not dataclasses.MISSING else (
        f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
    return Column(f.name, kind, optional, target, default)
