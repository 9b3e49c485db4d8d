"""The counting wrappers that replace torch.distributed's functions: CL and WR at the call, WC when it is over.

A collective's wrapper is the hot path: arguments read by position, the group's slot from the wrapper's cache, the
writer's few stores. Where the native fast path loaded, the wrapper is its C callable, which takes a call's whole work
and hands the rest (first use of a group, a payload that is not one tensor, a synchronous CUDA call without the
plugin, a full Work ring) to the Python wrapper made here. Point-to-point calls and ``batch_isend_irecv`` take the
Python path only. Every internal error goes to ``disable``; the user's call always runs.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

from rankscope.ccl_plugin.call_args import OP_ALIAS, OPS, P2P_KINDS, WORK_KINDS, CallArgs, nbytes, on_cuda
from rankscope.ccl_plugin.completion import arm_poller, complete_all, complete_on_device, watch
from rankscope.ccl_plugin.counter_file import ensure_writer
from rankscope.ccl_plugin.group_slots import SLOT_CACHES, SlotCache, launch_one, slot_of
from rankscope.ccl_plugin.hook_state import STATE, disable
from rankscope.ccl_plugin.writer import Request


def _make_coll_wrapper(name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
    """The hot path: a collective. Arguments are read by position, the slot comes from a cache."""
    payload_param, _kind = OPS[name]
    op = OP_ALIAS.get(name, name)
    params = CallArgs(orig)
    gi = params.pos.get("group", 1 << 30)
    gdef = params.defaults.get("group")
    pi = params.pos.get(payload_param, 1 << 30) if payload_param else 1 << 30
    ai = params.pos.get("async_op", 1 << 30)
    adef = bool(params.defaults.get("async_op", False))
    state, tls = STATE, STATE.tls
    slots: SlotCache = {}
    SLOT_CACHES.append(slots)

    @functools.wraps(orig)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if state.disabled or tls.depth:
            return orig(*args, **kwargs)
        try:
            n = len(args)
            group = args[gi] if gi < n else gdef
            payload: Any = args[pi] if pi < n else None
            is_async = args[ai] if ai < n else adef
            if kwargs:
                group = kwargs.get("group", group)
                if payload_param:
                    payload = kwargs.get(payload_param, payload)
                is_async = kwargs.get("async_op", is_async)
            hit = slots.get(group)
            if hit is None:
                hit = slot_of(op, group, slots)
            try:  # a tensor: two attribute reads
                size, cuda = payload.nbytes, payload.is_cuda
            except AttributeError:  # a list of tensors, or nothing (barrier)
                size, cuda = nbytes(payload), on_cuda(payload)
            w = state.writer or ensure_writer()
            req = w.launch(hit[1], size)
        except Exception as exc:
            disable(name, exc)
            return orig(*args, **kwargs)
        tls.depth = True
        try:
            result = orig(*args, **kwargs)
        except BaseException:
            with contextlib.suppress(Exception):  # failed: nothing stays in flight
                w.complete(req)
            raise
        finally:
            tls.depth = False
        try:
            if cuda is True:
                if is_async and result is not None:
                    watch(result, [req], True)
                else:
                    complete_on_device([req])
            elif not is_async or result is None:
                w.complete(req)  # a blocking call on the host has finished when it returns
            else:
                watch(result, [req])
        except Exception as exc:
            disable(name, exc)
        return result

    wrapper.__rankscope_original__ = orig  # type: ignore[attr-defined]
    fast = state.fast
    if fast is None:
        return wrapper

    def post(result: Any, req: Request, cuda: bool, is_async: bool) -> None:
        """After the native wrapper's call: what an async Work or a CUDA payload needs (never raises)."""
        try:
            if cuda:
                if is_async and result is not None:
                    watch(result, [req], True)
                else:
                    complete_on_device([req])
            else:
                watch(result, [req])
        except Exception as exc:
            disable(name, exc)

    fast_wrapper: Callable[..., Any] = fast.Wrapper(
        orig, wrapper, slots, state, tls, post, group_index=gi, group_default=gdef, payload_index=pi,
        payload_name=payload_param, async_index=ai, async_default=adef, ring=state.ring, arm=arm_poller,
        plugin=state.plugin)
    functools.update_wrapper(fast_wrapper, orig)
    fast_wrapper.__rankscope_original__ = orig  # type: ignore[attr-defined]
    fast_wrapper.__rankscope_python__ = wrapper  # type: ignore[attr-defined]
    return fast_wrapper


def make_wrapper(name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
    """The counting wrapper of torch's function ``name`` (one of ``OPS``): a collective's hot path, or the Python one."""
    payload_param, kind = OPS[name]
    if kind == "coll":
        return _make_coll_wrapper(name, orig)
    op = OP_ALIAS.get(name, name)
    params = CallArgs(orig)
    tls = STATE.tls
    slots: SlotCache = {}
    batch_slots: dict[str, SlotCache] = {"send": {}, "recv": {}}
    SLOT_CACHES.extend((slots, *batch_slots.values()))

    @functools.wraps(orig)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if STATE.disabled or getattr(tls, "depth", False):
            return orig(*args, **kwargs)
        reqs: list[Request] | None = None
        is_async = False
        on_device = False
        try:
            if kind == "batch":
                reqs = []
                p2p_ops: Any = params.get(args, kwargs, "p2p_op_list") or ()
                on_device = bool(p2p_ops) and on_cuda(getattr(p2p_ops[0], "tensor", None))
                for p in p2p_ops:
                    direction = "isend" if getattr(p.op, "__name__", "") == "isend" else "irecv"
                    peer_args = {"dst" if direction == "isend" else "src": getattr(p, "peer", None)}
                    op_name = OP_ALIAS[direction]
                    reqs.append(launch_one(op_name, direction, p.group, p.tensor, peer_args.get,
                                            batch_slots[op_name]))
                is_async = True
            else:
                get = None
                if kind in P2P_KINDS:
                    def get(param: str) -> Any:
                        return params.get(args, kwargs, param)
                payload = params.get(args, kwargs, payload_param) if payload_param else None
                on_device = on_cuda(payload)
                reqs = [launch_one(op, kind, params.get(args, kwargs, "group"), payload, get, slots)]
                is_async = kind in WORK_KINDS or bool(params.get(args, kwargs, "async_op"))
        except Exception as exc:
            disable(name, exc)
            reqs = None
        tls.depth = True
        try:
            result = orig(*args, **kwargs)
        except BaseException:
            # the call failed before or while running: nothing stays in flight,
            # so the request is closed rather than left looking stuck (WC < WR)
            if reqs:
                with contextlib.suppress(Exception):
                    complete_all(reqs)
            raise
        finally:
            tls.depth = False
        if reqs:
            try:
                if not is_async or result is None:
                    if on_device:
                        complete_on_device(reqs)
                    else:
                        complete_all(reqs)  # a blocking call on the host has finished when it returns
                elif kind == "batch":
                    works = list(result)
                    if len(works) == len(reqs):
                        for wk, r in zip(works, reqs, strict=True):
                            watch(wk, [r], on_device)
                    elif works:  # coalesced: the batch completes as a whole with its last Work
                        watch(works[-1], reqs, on_device)
                    else:
                        complete_all(reqs)
                else:
                    watch(result, reqs, on_device)
            except Exception as exc:
                disable(name, exc)
        return result

    wrapper.__rankscope_original__ = orig  # type: ignore[attr-defined]
    return wrapper
