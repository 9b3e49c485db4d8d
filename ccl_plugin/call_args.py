"""Which torch.distributed functions are counted, and how one call's arguments are read: payload, bytes, device, peer.

Reading is cheap on purpose (it runs on every call): parameters by position where possible, one attribute read for a
tensor's size and device, the whole signature never bound.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from rankscope.contract.vocabulary import canonical_op, is_point_to_point, is_send

# op name -> (parameter holding the payload, kind). kind: "coll" (async when
# async_op=True), "send"/"recv" (blocking p2p), "isend"/"irecv" (return a Work),
# "batch" (batch_isend_irecv: one request per P2POp).
OPS: dict[str, tuple[str | None, str]] = {
    "all_reduce": ("tensor", "coll"),
    "all_gather": ("tensor", "coll"),
    "all_gather_into_tensor": ("input_tensor", "coll"),
    "_all_gather_base": ("input_tensor", "coll"),
    "all_gather_single": ("input_tensor", "coll"),
    "reduce_scatter": ("input_list", "coll"),
    "reduce_scatter_tensor": ("input", "coll"),
    "_reduce_scatter_base": ("input", "coll"),
    "reduce_scatter_single": ("input", "coll"),
    "broadcast": ("tensor", "coll"),
    "reduce": ("tensor", "coll"),
    "all_to_all": ("input_tensor_list", "coll"),
    "all_to_all_single": ("input", "coll"),
    "barrier": (None, "coll"),
    "gather": ("tensor", "coll"),
    "scatter": ("tensor", "coll"),
    "send": ("tensor", "send"),
    "recv": ("tensor", "recv"),
    "isend": ("tensor", "isend"),
    "irecv": ("tensor", "irecv"),
    "batch_isend_irecv": (None, "batch"),
}
# The name the counters use: the private aliases count as their public op, and
# blocking and non-blocking p2p share a row per direction.
# (the contract's vocabulary says which; built once, so a call costs one dict lookup)
OP_ALIAS = {name: canonical_op(name) for name, (_, kind) in OPS.items() if kind != "batch" and canonical_op(name) != name}

P2P_KINDS = frozenset(kind for _, kind in OPS.values() if is_point_to_point(kind))  # "batch" is no op name
WORK_KINDS = frozenset(("isend", "irecv"))  # the point-to-point kinds that always return a Work


def nbytes(obj: Any) -> int:
    """The bytes a payload carries (a tensor, a list of them, or nothing)."""
    if obj is None:
        return 0
    try:
        return int(obj.nbytes)  # a tensor: one attribute read
    except AttributeError:
        pass
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(o) for o in obj)
    try:
        return int(obj.numel()) * int(obj.element_size())
    except Exception:
        return 0


def on_cuda(payload: Any) -> bool:
    """Whether a call's payload (a tensor or a list of them) lives on a CUDA device: one attribute read."""
    if type(payload) in (list, tuple):
        payload = payload[0] if payload else None
    return getattr(payload, "is_cuda", False) is True


_MISSING = object()


class CallArgs:
    """Reads a few named parameters of one call without binding the whole signature."""

    __slots__ = ("defaults", "pos")

    def __init__(self, fn: Callable[..., Any]) -> None:
        params = inspect.signature(fn).parameters
        self.pos = {n: i for i, n in enumerate(params)}
        self.defaults = {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}

    def get(self, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
        if kwargs:
            v = kwargs.get(name, _MISSING)
            if v is not _MISSING:
                return v
        i = self.pos.get(name)
        if i is not None and i < len(args):
            return args[i]
        return self.defaults.get(name)


def peer_of(get: Callable[[str], Any], kind: str, members: tuple[int, ...]) -> int | None:
    """A point-to-point call's peer as a global rank: ``dst``/``src``, or ``group_dst``/``group_src`` in ``members``."""
    key = "dst" if is_send(kind) else "src"
    peer = get(key)
    if peer is not None:
        return int(peer)
    gpeer = get("group_" + key)
    if gpeer is not None and 0 <= int(gpeer) < len(members):
        return members[int(gpeer)]
    return None
