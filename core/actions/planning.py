"""Turn a request into the plan a person confirms: exact machines, processes, standbys, backup peers.

Each function takes what the agent already knows (its processes, its
eviction backend, the backup pairing, the current code version) and returns
an :class:`~rankscope.actions.model.ActionPlan`; nothing runs. The plan for an
eviction lists the exact argv its backend will run and the phrase to type.
"""

from __future__ import annotations

from collections.abc import Sequence

from rankscope.actions.evict_backends import EvictionBackend
from rankscope.actions.history import Version
from rankscope.actions.model import (
    ActionKind,
    ActionPlan,
    ActionRequest,
    EvictArgs,
    HotUpdateArgs,
    ProcessRef,
    RollbackArgs,
    UpdateMode,
    VersionSource,
    confirm_phrase_for,
    needs_typed_confirmation,
)
from rankscope.analyzers.backup_plan import BackupPlan
from rankscope.errors import RankscopeError


def _expect(request: ActionRequest, kind: ActionKind) -> None:
    if request.kind != kind:
        raise RankscopeError(f"a {request.kind} request cannot be planned as {kind}", "plan it with its own kind")


def _on(processes: Sequence[ProcessRef], machines: Sequence[str]) -> tuple[ProcessRef, ...]:
    wanted = set(machines)
    return tuple(sorted((p for p in processes if p.machine in wanted), key=lambda p: (p.machine, p.rank or -1, p.pid)))


def plan_eviction(request: ActionRequest, backend: EvictionBackend, processes: Sequence[ProcessRef],
                  standby_target: int | None = None) -> ActionPlan:
    """Over-evict ``request.targets.machines``: stop their ranks, block them, restart with standbys.

    ``standby_target`` is the pool size from the P99 sizing; a pool that
    would fall below it after this eviction is flagged, so the replenishment
    can start now.
    """
    _expect(request, ActionKind.EVICT)
    assert isinstance(request.args, EvictArgs)
    machines = request.targets.machines
    ev = backend.plan(machines, request.args.reason)
    stopped = _on(processes, ev.machines)
    warnings = list(ev.warnings)
    if standby_target is not None and ev.standbys and backend.name == "local":
        left = max(0, standby_target - len(ev.standbys))
        if left:
            warnings.append(f"the warm standby pool drops below its P99 size ({standby_target}) by {left}: "
                            "replenish it")
    steps = (f"record {' '.join(ev.machines)} in the blocklist: {request.args.reason}", *ev.steps)
    return ActionPlan(
        action_id=request.action_id,
        kind=ActionKind.EVICT,
        summary=f"evict {len(ev.machines)} machine(s) via {backend.name}: {' '.join(ev.machines)}",
        machines=ev.machines,
        processes=stopped,
        standbys=ev.standbys,
        commands=ev.commands,
        steps=steps,
        warnings=tuple(warnings),
        typed_confirmation=needs_typed_confirmation(ActionKind.EVICT),
        confirm_phrase=confirm_phrase_for(ActionKind.EVICT, ev.machines),
    )


def plan_hot_update(request: ActionRequest, machines: Sequence[str], processes: Sequence[ProcessRef],
                    current: Version | None) -> ActionPlan:
    """Switch the code on every machine of the job and restart its processes where they are."""
    _expect(request, ActionKind.HOT_UPDATE)
    assert isinstance(request.args, HotUpdateArgs)
    args = request.args
    target = f"{'git ref' if args.source == VersionSource.GIT else 'directory'} {args.version}"
    frm = current.label if current else "(no recorded version)"
    steps: tuple[str, ...]
    if args.mode == UpdateMode.IMMEDIATE:
        steps = (f"on {len(machines)} machine(s): prepare {target}", "switch the code link atomically",
                 f"restart {len(processes)} training process(es) in place; they resume from the latest checkpoint")
    else:
        steps = (f"on {len(machines)} machine(s): prepare {target} now (a bad ref fails now)",
                 f"apply at the next restart or failure, at the latest after {args.window_s / 3600:g} h")
    return ActionPlan(
        action_id=request.action_id,
        kind=ActionKind.HOT_UPDATE,
        summary=f"hot-update ({args.mode.value}) {frm} -> {target}",
        machines=tuple(machines),
        processes=_on(processes, machines) if args.mode == UpdateMode.IMMEDIATE else (),
        steps=steps,
        confirm_phrase=confirm_phrase_for(ActionKind.HOT_UPDATE, tuple(machines)),
    )


def plan_rollback(request: ActionRequest, machines: Sequence[str], processes: Sequence[ProcessRef],
                  current: Version | None, target: Version) -> ActionPlan:
    _expect(request, ActionKind.ROLLBACK)
    assert isinstance(request.args, RollbackArgs)
    frm = current.label if current else "(no recorded version)"
    immediate = request.args.mode == UpdateMode.IMMEDIATE
    return ActionPlan(
        action_id=request.action_id,
        kind=ActionKind.ROLLBACK,
        summary=f"roll back {frm} -> {target.label}",
        machines=tuple(machines),
        processes=_on(processes, machines) if immediate else (),
        steps=(f"switch the code link to {target.path}",
               "restart the training processes in place" if immediate else "apply at the next restart or failure"),
        confirm_phrase=confirm_phrase_for(ActionKind.ROLLBACK, tuple(machines)),
    )


def plan_backup(request: ActionRequest, pairing: BackupPlan, processes: Sequence[ProcessRef]) -> ActionPlan:
    """Snapshot each rank at its next step boundary; keep the shard locally and on its peer's machine."""
    _expect(request, ActionKind.BACKUP)
    ranks = set(request.targets.ranks) or {p.rank for p in pairing.pairs}
    pairs = tuple((p.rank, p.peer) for p in pairing.pairs if p.rank in ranks)
    machines = tuple(dict.fromkeys(m for p in pairing.pairs if p.rank in ranks for m in (p.machine, p.peer_machine)))
    warnings = tuple(pairing.notes) if not pairing.safe else ()
    return ActionPlan(
        action_id=request.action_id,
        kind=ActionKind.BACKUP,
        summary=f"back up {len(pairs)} rank(s) to peers outside their parallel groups",
        machines=machines,
        processes=tuple(p for p in processes if p.rank is not None and p.rank in ranks),
        backup_peers=pairs,
        steps=("snapshot parameters and optimizer state at the next step boundary into CPU memory",
               "write each shard with its checksum to local disk and send it to the peer's agent"),
        warnings=warnings,
        confirm_phrase=confirm_phrase_for(ActionKind.BACKUP, machines),
    )
