"""Counting torch.distributed's collectives and p2p calls into the counter file.

Why wrapping functions (and not a backend): it works for every backend (gloo,
NCCL, ...) without user changes. ``install()`` replaces each function both in
``torch.distributed.distributed_c10d`` (so torch's own internal calls and
later ``from ... import`` bindings see it) and in ``torch.distributed`` (so
Megatron's import-time ``from torch.distributed import all_gather_into_tensor``
gets it when the autoload patches before user code runs).

Per call: CL += 1 and one WR per request issued (a p2p call issues one;
``batch_isend_irecv`` counts each op it carries). WC when the request
completes, learned without adding a wait:

- CPU tensors (gloo): a synchronous call has completed when it returns; an
  async Work is kept (the native fast path keeps it in a C ring, the Python
  path in a table) and the background thread's poll asks ``is_completed()``.
  Nothing runs on the user's thread after the call: not a wrapped
  ``Work.wait`` (it cost every wait, the user's and torch's own), not the
  Work's future (its callback runs on the backend's thread and has to take
  the GIL from the user's thread). The poll learns that the Work is over, not
  when: such a completion is WC without TD or N (synchronous calls and the
  NCCL plugin time them).
- CUDA tensors with the NCCL profiler plugin loaded (``NCCL_PROFILER_PLUGIN``
  naming ours): the plugin sees the device's own start and end of every
  collective in its file, so the shim only counts the launch and names the
  group; WC at return, without TD or N (no CUDA event, no Work polling).
- CUDA tensors without the plugin: every call returns once its kernel is enqueued, and
  even ``Work.wait()`` only orders the current stream after it; the Work's
  future is marked complete at enqueue too (its callbacks run at once on
  CUDA-aware futures). So a synchronous call records a CUDA event on the
  current stream right after it returns (torch has ordered that stream after
  the collective, or ran the collective on it) and an async Work is kept as on
  the host; the background thread polls ``event.query()`` /
  ``work.is_completed()`` (both are cudaEventQuery: no host synchronisation,
  never on the user's thread). Under CUDA graph capture nothing runs at call
  time: such calls complete at return.

TD is launch to completion; N (bytes/TD) goes into the ring of the last five.

The per-call path is a handful of attribute and integer operations: each
wrapper caches its (group -> op slot) resolution at first use, arguments are
read by position, and the writer stores only the fields a call changes. Where
the native fast path builds (``native``: a C extension compiled at first use),
a collective's wrapper is a C callable that does a call's whole work (flags,
arguments, cached slot, launch and completion stores, an async Work into the
ring, a CUDA call settled where the plugin times it) and hands everything else
(first use of a group, a payload that is not one tensor, a synchronous CUDA
call without the plugin, a full ring) to the Python code below; otherwise that
Python code is the wrapper. The
background thread polls only while something is open (and a second after),
and a call wakes it only when it sleeps.

Where torch offers ``ProcessGroup.register_pre_hook`` / ``register_post_hook``
(2.14+), those are used as well, since they also see collectives issued from
C++ (DDP's reducer); in 2.13 they do not exist and the path is skipped.

Every hook body is guarded: the first internal error disables the hooks with
one line on stderr, and the user's call proceeds as if we were not there.
torch is imported only inside functions (the plugin must import stdlib only).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from rankscope.ccl_plugin import native
from rankscope.ccl_plugin.writer import CounterWriter, OpSlot, Request
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

ENV_KEEP = "RANKSCOPE_CCL_KEEP"  # "1": leave the file behind at exit (marked clean), for post-mortems
POLL_INTERVAL_S = 0.005
POLL_LINGER_S = 1.0  # the poller keeps its fast pace this long after the last open request, so calls need not wake it
EVENT_POOL_MAX = 256  # completed CUDA events kept for reuse (creating one costs more than recording it)
HEARTBEAT_INTERVAL_S = 1.0


class _ThreadFlags(threading.local):
    """Per thread: inside a wrapped call (its inner calls and the ProcessGroup hooks count nothing)."""

    depth = False


class _State:
    """Everything the hooks share, in one place so tests can reset it."""

    def __init__(self) -> None:
        self.writer: CounterWriter | None = None
        self.directory: Path | None = None
        self.job_id = "job"
        self.disabled = False
        self.installed = False
        self.tls: Any = _ThreadFlags()  # or the fast path's ThreadFlags (use_fast)
        self.groups: dict[int, tuple[Any, int, tuple[int, ...]]] = {}  # id(pg) -> (pg, comm index, members)
        # id(work) -> (work, requests): async Works (host or device) not yet seen complete. Only single
        # dict operations touch it (atomic under the GIL), so settling needs no lock.
        self.pending: dict[int, tuple[Any, list[Request]]] = {}
        self.wake = threading.Event()
        self.polling = False  # the background thread polls at its fast pace (no wake needed)
        self.plugin = False  # NCCL's profiler plugin is ours: it times device work, the shim only counts
        self.thread: threading.Thread | None = None
        self.dist: Any = None
        self.pg_hooks = False  # torch offers ProcessGroup.register_pre_hook / register_post_hook
        self.c10d: Any = None
        # Device completion (CUDA tensors): events recorded after synchronous calls, in launch order
        # (one stream completes in order, so the poller looks at the oldest first). Async Works (host or
        # device) wait in ``pending`` (or the fast path's ring) for ``is_completed()``.
        self.device_events: collections.deque[tuple[Any, list[Request]]] = collections.deque()
        self.event_pool: list[Any] = []
        self.cuda: Any = None  # torch.cuda, once the first CUDA payload is seen
        self.fast: ModuleType | None = None  # the native fast path, when it loaded (chosen at install)
        self.ring: Any = None  # the fast path's WorkRing: async Works its wrappers keep for the poll


STATE = _State()


def use_fast(fast: ModuleType | None) -> None:
    """Count through the native fast path (``fast``) or in Python (None), before any wrapper is made.

    With the fast path the per-thread "inside a wrapped call" flag is its C thread-local, which the Python
    code reads and sets through the same attribute, so both paths see one flag.
    """
    STATE.fast = fast
    STATE.tls = fast.ThreadFlags() if fast is not None else _ThreadFlags()
    STATE.ring = fast.WorkRing() if fast is not None else None


def _disable(where: str, exc: BaseException) -> None:
    """First internal failure: stop counting, say so once, never raise."""
    if not STATE.disabled:
        STATE.disabled = True
        with contextlib.suppress(Exception):
            print(f"rankscope: CCL counters disabled after an internal error in {where}: "
                  f"{type(exc).__name__}: {exc}", file=sys.stderr)


def _nbytes(obj: Any) -> int:
    if obj is None:
        return 0
    try:
        return int(obj.nbytes)  # a tensor: one attribute read
    except AttributeError:
        pass
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    try:
        return int(obj.numel()) * int(obj.element_size())
    except Exception:
        return 0


def _group_entry(group: Any) -> tuple[Any, int, tuple[int, ...]]:
    """(group, communicator index in the file, member global ranks) of ``group`` (None = world)."""
    c10d = STATE.c10d
    if group is None:
        group = c10d.GroupMember.WORLD
        if group is None:
            group = c10d._get_default_group()  # raises the user-facing "not initialized" error
    hit = STATE.groups.get(id(group))
    if hit is not None and hit[0] is group:
        return hit
    members = tuple(int(r) for r in c10d.get_process_group_ranks(group))
    name = str(getattr(group, "group_name", "") or id(group))
    desc = str(getattr(group, "group_desc", "") or "")
    try:
        backend = str(c10d.get_backend(group))
    except Exception:
        backend = "unknown"
    writer = _ensure_writer()
    entry = (group, writer.comm(name, backend, desc, members), members)
    STATE.groups[id(group)] = entry
    if STATE.pg_hooks:
        _hook_group(group, entry[1], on_device="nccl" in backend)
    return entry


def _ensure_writer() -> CounterWriter:
    w = STATE.writer
    if w is None:
        c10d = STATE.c10d
        directory = STATE.directory or Path("/dev/shm/rankscope")
        w = CounterWriter(directory, rank=int(c10d.get_rank()), world_size=int(c10d.get_world_size()),
                          job_id=STATE.job_id, fast=STATE.fast)
        STATE.writer = w
        _start_thread()
        try:
            _install_step_hook()
        except Exception as exc:  # counters still work without step counts
            print(f"rankscope: optimizer step counting off: {type(exc).__name__}: {exc}", file=sys.stderr)
    return w


# ---- completion ----------------------------------------------------------


def _complete_all(reqs: list[Request]) -> None:
    w = STATE.writer
    if w is None:
        return
    for r in reqs:
        w.complete(r)


def _settle_all(reqs: list[Request]) -> None:
    """WC for device work the NCCL profiler plugin times: over for the shim, TD and N are the plugin's."""
    w = STATE.writer
    if w is None:
        return
    for r in reqs:
        w.settle(r)


def _on_cuda(payload: Any) -> bool:
    """Whether a call's payload (a tensor or a list of them) lives on a CUDA device: one attribute read."""
    if type(payload) in (list, tuple):
        payload = payload[0] if payload else None
    return getattr(payload, "is_cuda", False) is True


def _arm_poller() -> None:
    """Something is open that only the background thread may see finish: make sure it polls."""
    if not STATE.polling:
        STATE.polling = True
        STATE.wake.set()  # it may be in its one-second heartbeat sleep


def _complete_on_device(reqs: list[Request]) -> None:
    """A synchronous call on CUDA tensors returned with its work only enqueued: WC when the device is done.

    An event recorded now on the current stream completes after the
    collective (torch ordered this stream after it before returning). The
    background thread polls it; nothing here waits. With the profiler plugin
    loaded the plugin times the device work and the request is settled now.
    """
    if STATE.plugin:
        _settle_all(reqs)
        return
    cuda = STATE.cuda
    if cuda is None:
        cuda = STATE.cuda = sys.modules["torch"].cuda
    if cuda.is_current_stream_capturing():
        _complete_all(reqs)  # captured into a CUDA graph: nothing was launched now
        return
    pool = STATE.event_pool
    ev = pool.pop() if pool else cuda.Event()
    ev.record()
    STATE.device_events.append((ev, reqs))
    _arm_poller()


def _poll_device() -> bool:
    """WC for the synchronous CUDA calls the device has finished (background thread): event queries, no waits.

    Returns whether device work is still open.
    """
    q = STATE.device_events
    pool = STATE.event_pool
    while q:
        ev, reqs = q[0]
        try:
            done = bool(ev.query())
        except Exception:  # a failed device (sticky error, aborted communicator) runs nothing any more
            done = True
        if not done:
            break
        q.popleft()
        _complete_all(reqs)
        if len(pool) < EVENT_POOL_MAX:
            pool.append(ev)
    return bool(q)


def _watch(work: Any, reqs: list[Request], on_device: bool = False) -> None:
    """Arrange for WC when ``work`` completes, without waiting on it: the background poll asks it.

    ``on_device``: a Work on CUDA tensors, whose ``wait()`` returns before the device is done; its
    ``is_completed()`` asks the device. With our NCCL plugin loaded the plugin times it: settled now.
    """
    if on_device and STATE.plugin:
        _settle_all(reqs)
        return
    STATE.pending[id(work)] = (work, reqs)
    if not STATE.polling:
        _arm_poller()


def _poll_pending() -> bool:
    """WC (no TD or N: the poll sees that, not when) for async Works now complete; whether any is still open."""
    pending = STATE.pending
    for key, (work, _reqs) in list(pending.items()):
        try:
            done = bool(work.is_completed())
        except Exception:
            done = True  # a failed Work is no longer in flight either way
        if done:
            entry = pending.pop(key, None)
            if entry is not None:
                _settle_all(entry[1])
    return bool(pending)


def open_works() -> int:
    """Async Works the poll still waits on (both paths' keeping places)."""
    return len(STATE.pending) + (len(STATE.ring) if STATE.ring is not None else 0)


def _poll() -> bool:
    """One pass over everything open; whether anything still is."""
    ring = STATE.ring
    native = ring.poll() > 0 if ring is not None and len(ring) else False
    works = _poll_pending() if STATE.pending else False
    device = _poll_device() if STATE.device_events else False
    return native or works or device


def _background() -> None:
    """Heartbeat every second; poll open Works and device work while any are open, and a while after.

    The lingering keeps a job that issues async work step after step from waking this thread on every
    call (a wake costs the caller a lock and this thread the GIL).
    """
    linger = max(1, int(POLL_LINGER_S / POLL_INTERVAL_S))
    quiet = 0
    next_beat = time.monotonic() + HEARTBEAT_INTERVAL_S
    while True:
        try:
            if STATE.polling:
                STATE.wake.wait(POLL_INTERVAL_S)
                STATE.wake.clear()
                if _poll():
                    quiet = 0
                else:
                    quiet += 1
                    if quiet >= linger:
                        STATE.polling = False
                        quiet = 0
            else:
                STATE.wake.wait(max(0.0, next_beat - time.monotonic()))
                STATE.wake.clear()
                if _poll():  # opened while this thread was going to sleep: no wake came
                    STATE.polling = True
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + HEARTBEAT_INTERVAL_S
                w = STATE.writer
                if w is not None:
                    w.heartbeat()
        except Exception as exc:
            _disable("heartbeat thread", exc)
            return


def _start_thread() -> None:
    if STATE.thread is None:
        STATE.thread = threading.Thread(target=_background, name="rankscope-ccl", daemon=True)
        STATE.thread.start()


# ---- wrappers ----------------------------------------------------------------


_MISSING = object()


class _Args:
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


def _peer(get: Callable[[str], Any], kind: str, members: tuple[int, ...]) -> int | None:
    key = "dst" if is_send(kind) else "src"
    peer = get(key)
    if peer is not None:
        return int(peer)
    gpeer = get("group_" + key)
    if gpeer is not None and 0 <= int(gpeer) < len(members):
        return members[int(gpeer)]
    return None


_P2P_KINDS = frozenset(kind for _, kind in OPS.values() if is_point_to_point(kind))  # "batch" is no op name


# Per wrapper: group -> (group, op slot, member global ranks), keyed by the group object itself (groups
# hash by identity; the entry keeps it alive anyway), None for the default group. Cleared when the world
# changes: None then means another group.
SlotCache = dict[Any, tuple[Any, OpSlot, tuple[int, ...]]]
_SLOT_CACHES: list[SlotCache] = []


def _forget_groups() -> None:
    """init/destroy_process_group: the default group is about to be another object."""
    for cache in _SLOT_CACHES:
        cache.clear()


def _slot_of(op: str, group: Any, cache: SlotCache) -> tuple[Any, OpSlot, tuple[int, ...]]:
    """First use of ``op`` on ``group`` by one wrapper: register both, remember the slot."""
    w = STATE.writer or _ensure_writer()
    _pg, idx, members = _group_entry(group)
    hit = (group, w.slot(idx, op), members)
    cache[group] = hit
    return hit


def _launch_one(op: str, kind: str, group: Any, payload: Any, get: Callable[[str], Any] | None,
                cache: SlotCache) -> Request:
    w = STATE.writer or _ensure_writer()
    hit = cache.get(group)
    if hit is None:
        hit = _slot_of(op, group, cache)
    peer = _peer(get, kind, hit[2]) if get is not None and kind in _P2P_KINDS else None
    return w.launch(hit[1], _nbytes(payload), peer=peer)


def _make_coll_wrapper(name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
    """The hot path: a collective. Arguments are read by position, the slot comes from a cache."""
    payload_param, _kind = OPS[name]
    op = OP_ALIAS.get(name, name)
    params = _Args(orig)
    gi = params.pos.get("group", 1 << 30)
    gdef = params.defaults.get("group")
    pi = params.pos.get(payload_param, 1 << 30) if payload_param else 1 << 30
    ai = params.pos.get("async_op", 1 << 30)
    adef = bool(params.defaults.get("async_op", False))
    state, tls = STATE, STATE.tls
    slots: SlotCache = {}
    _SLOT_CACHES.append(slots)

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
                hit = _slot_of(op, group, slots)
            try:  # a tensor: two attribute reads
                nbytes, on_cuda = payload.nbytes, payload.is_cuda
            except AttributeError:  # a list of tensors, or nothing (barrier)
                nbytes, on_cuda = _nbytes(payload), _on_cuda(payload)
            w = state.writer or _ensure_writer()
            req = w.launch(hit[1], nbytes)
        except Exception as exc:
            _disable(name, exc)
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
            if on_cuda is True:
                if is_async and result is not None:
                    _watch(result, [req], True)
                else:
                    _complete_on_device([req])
            elif not is_async or result is None:
                w.complete(req)  # a blocking call on the host has finished when it returns
            else:
                _watch(result, [req])
        except Exception as exc:
            _disable(name, exc)
        return result

    wrapper.__rankscope_original__ = orig  # type: ignore[attr-defined]
    fast = state.fast
    if fast is None:
        return wrapper

    def post(result: Any, req: Request, on_cuda: bool, is_async: bool) -> None:
        """After the native wrapper's call: what an async Work or a CUDA payload needs (never raises)."""
        try:
            if on_cuda:
                if is_async and result is not None:
                    _watch(result, [req], True)
                else:
                    _complete_on_device([req])
            else:
                _watch(result, [req])
        except Exception as exc:
            _disable(name, exc)

    fast_wrapper: Callable[..., Any] = fast.Wrapper(
        orig, wrapper, slots, state, tls, post, group_index=gi, group_default=gdef, payload_index=pi,
        payload_name=payload_param, async_index=ai, async_default=adef, ring=state.ring, arm=_arm_poller,
        plugin=state.plugin)
    functools.update_wrapper(fast_wrapper, orig)
    fast_wrapper.__rankscope_original__ = orig  # type: ignore[attr-defined]
    fast_wrapper.__rankscope_python__ = wrapper  # type: ignore[attr-defined]
    return fast_wrapper


def _make_wrapper(name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
    payload_param, kind = OPS[name]
    if kind == "coll":
        return _make_coll_wrapper(name, orig)
    op = OP_ALIAS.get(name, name)
    params = _Args(orig)
    tls = STATE.tls
    slots: SlotCache = {}
    batch_slots: dict[str, SlotCache] = {"send": {}, "recv": {}}
    _SLOT_CACHES.extend((slots, *batch_slots.values()))

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
                on_device = bool(p2p_ops) and _on_cuda(getattr(p2p_ops[0], "tensor", None))
                for p in p2p_ops:
                    direction = "isend" if getattr(p.op, "__name__", "") == "isend" else "irecv"
                    peer_args = {"dst" if direction == "isend" else "src": getattr(p, "peer", None)}
                    op_name = OP_ALIAS[direction]
                    reqs.append(_launch_one(op_name, direction, p.group, p.tensor, peer_args.get,
                                            batch_slots[op_name]))
                is_async = True
            else:
                get = None
                if kind in _P2P_KINDS:
                    def get(param: str) -> Any:
                        return params.get(args, kwargs, param)
                payload = params.get(args, kwargs, payload_param) if payload_param else None
                on_device = _on_cuda(payload)
                reqs = [_launch_one(op, kind, params.get(args, kwargs, "group"), payload, get, slots)]
                is_async = kind in ("isend", "irecv") or bool(params.get(args, kwargs, "async_op"))
        except Exception as exc:
            _disable(name, exc)
            reqs = None
        tls.depth = True
        try:
            result = orig(*args, **kwargs)
        except BaseException:
            # the call failed before or while running: nothing stays in flight,
            # so the request is closed rather than left looking stuck (WC < WR)
            if reqs:
                with contextlib.suppress(Exception):
                    _complete_all(reqs)
            raise
        finally:
            tls.depth = False
        if reqs:
            try:
                if not is_async or result is None:
                    if on_device:
                        _complete_on_device(reqs)
                    else:
                        _complete_all(reqs)  # a blocking call on the host has finished when it returns
                elif kind == "batch":
                    works = list(result)
                    if len(works) == len(reqs):
                        for wk, r in zip(works, reqs, strict=True):
                            _watch(wk, [r], on_device)
                    elif works:  # coalesced: the batch completes as a whole with its last Work
                        _watch(works[-1], reqs, on_device)
                    else:
                        _complete_all(reqs)
                else:
                    _watch(result, reqs, on_device)
            except Exception as exc:
                _disable(name, exc)
        return result

    wrapper.__rankscope_original__ = orig  # type: ignore[attr-defined]
    return wrapper


def _wrap_new_group(c10d: Any, dist: Any) -> None:
    """Record each process group's members and description when it is created."""
    orig = c10d.new_group

    @functools.wraps(orig)
    def new_group(*args: Any, **kwargs: Any) -> Any:
        pg = orig(*args, **kwargs)
        if not STATE.disabled:
            try:
                if pg is not None and pg is not c10d.GroupMember.NON_GROUP_MEMBER:
                    _group_entry(pg)
            except Exception as exc:
                _disable("new_group", exc)
        return pg

    _replace(c10d, dist, "new_group", new_group)


def _wrap_init(c10d: Any, dist: Any) -> None:
    """Open the counter file once the rank is known; steps from the optimizer hook."""
    orig = c10d.init_process_group

    @functools.wraps(orig)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        _forget_groups()
        result = orig(*args, **kwargs)
        if not STATE.disabled:
            try:
                _group_entry(None)
            except Exception as exc:
                _disable("init_process_group", exc)
        return result

    _replace(c10d, dist, "init_process_group", init_process_group)

    orig_destroy = c10d.destroy_process_group

    @functools.wraps(orig_destroy)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        _forget_groups()
        return orig_destroy(*args, **kwargs)

    _replace(c10d, dist, "destroy_process_group", destroy_process_group)


def _replace(c10d: Any, dist: Any, attr: str, new: Any) -> None:
    old = getattr(c10d, attr)
    setattr(c10d, attr, new)
    if getattr(dist, attr, None) is old:
        setattr(dist, attr, new)


def _install_step_hook() -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def on_step(_opt: Any, _args: Any, _kwargs: Any) -> None:
        if STATE.disabled or STATE.writer is None:
            return
        try:
            STATE.writer.step()
        except Exception as exc:
            _disable("optimizer step hook", exc)

    register_optimizer_step_post_hook(on_step)


def _install_pg_hooks(dist: Any) -> bool:
    """torch 2.14+: ProcessGroup pre/post hooks also see C++-issued collectives (DDP's reducer)."""
    pg_cls = getattr(dist, "ProcessGroup", None)
    STATE.pg_hooks = bool(pg_cls is not None and hasattr(pg_cls, "register_pre_hook")
                          and hasattr(pg_cls, "register_post_hook"))
    return STATE.pg_hooks


def _hook_group(pg: Any, idx: int, on_device: bool = False) -> None:
    """Count what ``pg`` runs outside our Python wrappers, through its own hooks.

    Not exercised here: torch 2.13 has no such hooks. The hook arguments are
    read by duck typing (an op ``name`` and an ``op_id`` pairing pre and post),
    and any surprise disables the counters with one line on stderr.
    ``on_device``: the group runs NCCL, whose Works' futures complete at
    enqueue, so completion is polled through ``is_completed()``.
    """
    open_reqs: dict[Any, Request] = {}
    tls = STATE.tls

    def pre(args: Any) -> None:
        if STATE.disabled or getattr(tls, "depth", False):
            return  # issued through a wrapped Python call: already counted
        try:
            w = STATE.writer or _ensure_writer()
            op = str(getattr(args, "name", "unknown")).lower()
            open_reqs[getattr(args, "op_id", None)] = w.launch(w.slot(idx, op), 0)
        except Exception as exc:
            _disable("ProcessGroup pre-hook", exc)

    def post(args: Any) -> None:
        if STATE.disabled:
            return
        try:
            req = open_reqs.pop(getattr(args, "op_id", None), None)
            if req is None:
                return
            work = getattr(args, "work", None)
            if work is not None:
                _watch(work, [req], on_device)
            else:
                _complete_all([req])
        except Exception as exc:
            _disable("ProcessGroup post-hook", exc)

    pg.register_pre_hook(pre)
    pg.register_post_hook(post)


def plugin_loaded(environ: Mapping[str, str] | None = None) -> bool:
    """Whether NCCL loads rankscope's profiler plugin in this process (read once, at install)."""
    from rankscope.ccl_plugin.build import LIB_NAME

    return LIB_NAME in Path((os.environ if environ is None else environ).get("NCCL_PROFILER_PLUGIN", "")).name


def install(directory: Path, job_id: str) -> bool:
    """Patch torch.distributed (imports torch). Returns False and says why when it cannot."""
    if STATE.installed:
        return True
    STATE.directory = directory
    STATE.job_id = job_id
    try:
        # Through sys.modules: this may run inside torch's own first import,
        # when `torch.distributed` is not yet an attribute of `torch`.
        dist = sys.modules["torch.distributed"]
        if not dist.is_available():
            print("rankscope: torch.distributed is not available; CCL counters off", file=sys.stderr)
            return False
        c10d = sys.modules["torch.distributed.distributed_c10d"]
        missing = [n for n in ("get_process_group_ranks", "_get_default_group") if not hasattr(c10d, n)]
        if missing:
            print(f"rankscope: this torch is too old for CCL counters (no {', '.join(missing)})", file=sys.stderr)
            return False
        STATE.dist, STATE.c10d = dist, c10d
        STATE.plugin = plugin_loaded()
        use_fast(native.load())
        for name in OPS:
            orig = getattr(c10d, name, None)
            if orig is None or hasattr(orig, "__rankscope_original__"):
                continue
            _replace(c10d, dist, name, _make_wrapper(name, orig))
        _wrap_new_group(c10d, dist)
        _wrap_init(c10d, dist)
        # the optimizer step hook waits for the writer: torch.optim cannot be
        # imported while torch itself is still initialising (we run inside it)
        # ProcessGroup hooks (2.14+): added per group as groups are first seen;
        # they count only calls that did not come through a wrapper.
        _install_pg_hooks(dist)
        STATE.installed = True
        return True
    except Exception as exc:
        _disable("install", exc)
        return False


def shutdown() -> None:
    """Clean exit: remove this rank's file (atexit)."""
    w = STATE.writer
    if w is not None and w.pid == os.getpid():  # a forked child leaves its parent's file alone
        with contextlib.suppress(Exception):
            _poll()
        with contextlib.suppress(Exception):
            w.close(remove=os.environ.get(ENV_KEEP) != "1")

