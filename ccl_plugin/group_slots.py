"""A process group's place in the counter file, and each wrapper's cache of (group -> op slot).

The first call of an op on a group registers the group (its communicator row: name, backend, description, member
global ranks) and the op's slot; each wrapper remembers the slot, so later calls cost one dict lookup. When the world
changes (init/destroy_process_group) every cache is cleared: the default group is about to be another object.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rankscope.ccl_plugin.call_args import P2P_KINDS, nbytes, peer_of
from rankscope.ccl_plugin.counter_file import ensure_writer
from rankscope.ccl_plugin.group_hooks import hook_group
from rankscope.ccl_plugin.hook_state import STATE
from rankscope.ccl_plugin.writer import OpSlot, Request


def group_entry(group: Any) -> tuple[Any, int, tuple[int, ...]]:
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
    writer = ensure_writer()
    entry = (group, writer.comm(name, backend, desc, members), members)
    STATE.groups[id(group)] = entry
    if STATE.pg_hooks:
        hook_group(group, entry[1], on_device="nccl" in backend)
    return entry


# Per wrapper: group -> (group, op slot, member global ranks), keyed by the group object itself (groups
# hash by identity; the entry keeps it alive anyway), None for the default group. Cleared when the world
# changes: None then means another group.
SlotCache = dict[Any, tuple[Any, OpSlot, tuple[int, ...]]]
SLOT_CACHES: list[SlotCache] = []


def forget_groups() -> None:
    """init/destroy_process_group: the default group is about to be another object."""
    for cache in SLOT_CACHES:
        cache.clear()


def slot_of(op: str, group: Any, cache: SlotCache) -> tuple[Any, OpSlot, tuple[int, ...]]:
    """First use of ``op`` on ``group`` by one wrapper: register both, remember the slot."""
    w = STATE.writer or ensure_writer()
    _pg, idx, members = group_entry(group)
    hit = (group, w.slot(idx, op), members)
    cache[group] = hit
    return hit


def launch_one(op: str, kind: str, group: Any, payload: Any, get: Callable[[str], Any] | None,
               cache: SlotCache) -> Request:
    """One request launched (CL, WR) for a call the Python path counts; ``get`` reads a p2p call's peer."""
    w = STATE.writer or ensure_writer()
    hit = cache.get(group)
    if hit is None:
        hit = slot_of(op, group, cache)
    peer = peer_of(get, kind, hit[2]) if get is not None and kind in P2P_KINDS else None
    return w.launch(hit[1], nbytes(payload), peer=peer)
