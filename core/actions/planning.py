"""The one planner: a request and what the agent knows now -> the plan a person confirms, or a refusal.

An agent plans for its own machine. Its service
(:class:`~rankscope.actions.agent_service.ActionService`) gathers the facts
-- the ranks it sees, the blocklist and the launcher's standby pool, the
argv its eviction backend would run, where the code link points, the
hot-update history -- and hands them to these functions, which do no I/O
and run nothing. So the tests give them facts directly and check the exact
targets, processes, argv, standbys and refusals the agent shows, on the same
path production takes. A refusal is a :class:`~rankscope.contract.errors.RankscopeError`
whose message starts with "refused:" and whose fix says what to do instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rankscope.actions.evict_backends import EvictionPlan
from rankscope.actions.history import UpdateRecord, Version, find_version
from rankscope.actions.model import (
    DEFAULT_LAZY_WINDOW_S,
    ActionKind,
    ActionPlan,
    ActionRequest,
    BackupArgs,
    ConfirmationRule,
    EvictArgs,
    HotUpdateArgs,
    ProcessRef,
    RollbackArgs,
    UpdateMode,
    VersionSource,
)
from rankscope.contract.errors import RankscopeError
from rankscope.contract.snapshot import Layout, RankInfo


@dataclass(frozen=True, slots=True)
class Planned:
    """A plan and what its procedure needs to carry it out."""

    plan: ActionPlan
    ranks: tuple[RankInfo, ...]  # the ranks this machine ran when the plan was made
    total: int  # progress steps the procedure reports


@dataclass(frozen=True, slots=True)
class StandbyPool:
    """The launcher's warm standbys, as a ``local`` eviction's plan sees them."""

    configured: bool  # the config names standbys (a list or a file); else the launcher restarts as it can
    names: tuple[str, ...] = ()  # in the order the launcher takes them
    blocked: frozenset[str] = frozenset()  # machines in the blocklist: never a standby
    problem: str = ""  # why the list could not be read (the plan warns; names is then empty)


@dataclass(frozen=True, slots=True)
class CodeLink:
    """Where the job's code link points now, and where versions come from (the ``[hot_update]`` config)."""

    link: str  # the symbolic link the job runs its code from
    target: str | None  # where it points now; None before the first update
    versions_dir: str
    repo: str | None = None  # the git repository refs are checked out of


def _expect(request: ActionRequest, *kinds: ActionKind) -> None:
    if request.kind not in kinds:
        raise RankscopeError(f"a {request.kind} request cannot be planned as {' or '.join(kinds)}",
                             "plan it with its own kind")


def _rank_list(ranks: Sequence[RankInfo]) -> str:
    return " ".join(str(r.rank) for r in ranks) or "none"


def check_job(request: ActionRequest, machine: str, ranks: Sequence[RankInfo]) -> None:
    """An agent acts only on its own job: the machine it is and the ranks it sees; anything else is refused."""
    others = [m for m in request.targets.machines if m != machine]
    if others:
        raise RankscopeError(
            f"refused: {' '.join(others)} {'is' if len(others) == 1 else 'are'} not this agent's machine "
            f"({machine})",
            "send each machine's part of an action to that machine's agent (rankscope's client does this)")
    seen = {r.rank for r in ranks}
    unseen = sorted(set(request.targets.ranks) - seen)
    if unseen:
        raise RankscopeError(
            f"refused: rank(s) {' '.join(map(str, unseen))} do not run on {machine} "
            f"(its ranks: {' '.join(map(str, sorted(seen))) or 'none found'})",
            "target ranks this machine runs; take a fresh snapshot if the job was restarted")
    run_ids = {r.run_id for r in ranks if r.run_id}
    if request.job_id is not None and run_ids and request.job_id not in run_ids:
        raise RankscopeError(
            f"refused: job {request.job_id} does not run on {machine} (it runs {' '.join(sorted(run_ids))})",
            "attach to the agents of the job you mean")


def processes_of(machine: str, ranks: Sequence[RankInfo]) -> tuple[ProcessRef, ...]:
    """Every process of ``ranks`` on ``machine``: each rank and the worker subprocesses it started."""
    refs: list[ProcessRef] = []
    for r in ranks:
        refs.append(ProcessRef(machine, r.pid, r.rank))
        refs.extend(ProcessRef(machine, s.pid, r.rank) for s in r.subprocesses)
    return tuple(refs)


# ---- eviction -------------------------------------------------------------------------


def _eviction_warnings(request: ActionRequest, machine: str, ranks: Sequence[RankInfo]) -> list[str]:
    if request.targets.ranks:
        return [f"eviction takes the whole machine {machine}: all its ranks ({_rank_list(ranks)}) stop, "
                "not only the ones named"]
    return []


def _block_step(request: ActionRequest, machine: str) -> str:
    assert isinstance(request.args, EvictArgs)
    return f"block {machine} (reason: {request.args.reason}) so no restart brings it back"


def plan_local_eviction(request: ActionRequest, machine: str, ranks: Sequence[RankInfo], grace_s: float,
                        pool: StandbyPool) -> Planned:
    """Stop this machine's rank processes (SIGTERM, then SIGKILL after ``grace_s``) and block it.

    Restarting the job is the launcher's; when the config names its warm
    standbys the plan lists those that would join (minus blocked ones and
    this machine), in the launcher's order.
    """
    _expect(request, ActionKind.EVICT)
    ranks = tuple(ranks)
    machines = (machine,)
    processes = processes_of(machine, ranks)
    rank_list = _rank_list(ranks)
    warnings = _eviction_warnings(request, machine, ranks)
    if not ranks:
        warnings.append(f"no ranks found on {machine}: nothing to stop, the machine is only blocked")
    if pool.problem:
        warnings.append(f"standbys unknown: {pool.problem}")
    standbys = tuple(m for m in pool.names if m not in pool.blocked and m != machine)
    if not pool.configured:
        restart = "restarting the job without this machine is left to the launcher (torchrun, the drill)"
    elif standbys:
        restart = (f"the launcher restarts the job without this machine, with warm standby(s) "
                   f"{' '.join(standbys)} joining in this order, one per evicted machine; each standby "
                   "self-checks first and one that fails is skipped")
    else:
        restart = "the launcher has no unblocked warm standby: the job cannot restart at its size"
        warnings.append(f"no warm standby left to replace {machine} "
                        f"(blocked: {' '.join(sorted(pool.blocked & set(pool.names))) or 'none'})")
    steps = (f"SIGTERM {len(processes)} process(es) of ranks {rank_list} on {machine}",
             f"SIGKILL any still running after {grace_s:g} s",
             _block_step(request, machine),
             restart)
    plan = ActionPlan(
        action_id=request.action_id, kind=ActionKind.EVICT,
        summary=f"evict {machine}: stop ranks {rank_list} and block it",
        machines=machines, processes=processes, standbys=standbys, steps=steps, warnings=tuple(warnings),
        typed_confirmation=True, confirm_phrase=ConfirmationRule.phrase_for(ActionKind.EVICT, machines))
    return Planned(plan, ranks, 3)


def plan_backend_eviction(request: ActionRequest, machine: str, ranks: Sequence[RankInfo], backend: str,
                          evicted: EvictionPlan) -> Planned:
    """Evict through a scheduler backend: ``evicted`` is what the backend plans (its exact argv), then block.

    The backend may take more machines than this one (``EvictArgs.together``,
    or a whole Slurm node set); the confirmation must name all of them.
    """
    _expect(request, ActionKind.EVICT)
    ranks = tuple(ranks)
    plan = ActionPlan(
        action_id=request.action_id, kind=ActionKind.EVICT,
        summary=f"evict {machine} via {backend} (ranks {_rank_list(ranks)})",
        machines=evicted.machines, processes=processes_of(machine, ranks), standbys=evicted.standbys,
        commands=evicted.commands, steps=(*evicted.steps, _block_step(request, machine)),
        warnings=(*_eviction_warnings(request, machine, ranks), *evicted.warnings),
        typed_confirmation=True, confirm_phrase=ConfirmationRule.phrase_for(ActionKind.EVICT, evicted.machines))
    return Planned(plan, ranks, 2)


# ---- hot-update and rollback ----------------------------------------------------------


def _no_hot_update(machine: str) -> RankscopeError:
    return RankscopeError(f"refused: the agent on {machine} has no hot-update configured",
                          "add a [hot_update] section (current, versions_dir, repo) to its --actions-config")


def plan_hot_update(request: ActionRequest, machine: str, ranks: Sequence[RankInfo], code: CodeLink | None,
                    commit: str = "") -> Planned:
    """Switch this machine's code link to a git ref (``commit``: what the ref resolves to now) or a prepared
    directory (checked to exist before this is called), now or lazily."""
    _expect(request, ActionKind.HOT_UPDATE)
    if code is None:
        raise _no_hot_update(machine)
    args = request.args
    assert isinstance(args, HotUpdateArgs)
    if args.source == VersionSource.GIT:
        if code.repo is None:
            raise RankscopeError(f"refused: the agent on {machine} has no code repository configured",
                                 "set [hot_update] repo in its --actions-config, or use a prepared directory")
        assert commit, "resolve the git ref before planning: a ref that does not exist is refused in the plan"
        source = (f"check out git ref {args.version} (commit {commit[:12]}) of {code.repo} "
                  f"under {code.versions_dir}")
    else:
        source = f"use the prepared directory {args.version}"
    return _plan_switch(request, machine, ranks, code, "hot-update", f"{args.source.value}:{args.version}",
                        args.mode, args.window_s, (source,))


def rollback_target(args: RollbackArgs, machine: str, history: Sequence[UpdateRecord],
                    previous: Version | None) -> Version:
    """The version a rollback returns to: ``args.to_version`` (a label or path in ``history``), else
    ``previous`` (the version before the newest update not rolled back yet)."""
    if args.to_version:
        found = find_version(history, args.to_version)
        if found is not None:
            return found
        raise RankscopeError(f"refused: no version {args.to_version!r} in the hot-update history of {machine}",
                             "pick a version listed in the update history")
    if previous is None:
        raise RankscopeError(f"refused: {machine} has no earlier version to roll back to",
                             "hot-update to the version you want instead")
    return previous


def plan_rollback(request: ActionRequest, machine: str, ranks: Sequence[RankInfo], code: CodeLink | None,
                  history: Sequence[UpdateRecord] = (), previous: Version | None = None) -> Planned:
    """Switch this machine's code link back to an earlier version (see :func:`rollback_target`)."""
    _expect(request, ActionKind.ROLLBACK)
    if code is None:
        raise _no_hot_update(machine)
    args = request.args
    assert isinstance(args, RollbackArgs)
    target = rollback_target(args, machine, history, previous)
    return _plan_switch(request, machine, ranks, code, "roll back", target.label, args.mode, DEFAULT_LAZY_WINDOW_S,
                        ())


def _plan_switch(request: ActionRequest, machine: str, ranks: Sequence[RankInfo], code: CodeLink, verb: str,
                 to: str, mode: UpdateMode, window_s: float, first: tuple[str, ...]) -> Planned:
    ranks = tuple(ranks)
    steps = [*first, f"point {code.link} (now {code.target or 'unset'}) at {to}"
             + (" now" if mode == UpdateMode.IMMEDIATE else " when the update is applied")]
    if mode == UpdateMode.IMMEDIATE:
        steps.append(f"request a restart of ranks {_rank_list(ranks)}: the launcher restarts them on the new code "
                     "(the agent does not stop them)")
    else:
        steps.append(f"record it as pending: applied at the next restart or failure, at the latest in "
                     f"{window_s / 3600:g} h")
    plan = ActionPlan(
        action_id=request.action_id, kind=request.kind,
        summary=f"{verb} {machine} to {to} ({mode.value})",
        machines=(machine,), processes=processes_of(machine, ranks), steps=tuple(steps))
    return Planned(plan, ranks, 2)


# ---- checkpoint backup ----------------------------------------------------------------


def plan_backup(request: ActionRequest, machine: str, ranks: Sequence[RankInfo], layout: Layout | None,
                request_file: str, wait_s: float) -> Planned:
    """Ask this machine's ranks for a backup through ``request_file``; name each rank's backup peer
    (ByteRobust Fig. 9) when the config gives the job's ``layout``."""
    _expect(request, ActionKind.BACKUP)
    assert isinstance(request.args, BackupArgs)
    # Here, not at the top: it pulls in numpy, which an agent that never plans a backup need not load.
    from rankscope.analyzers.backup_plan import backup_plan

    ranks = tuple(ranks)
    warnings: list[str] = []
    peers: tuple[tuple[int, int], ...] = ()
    mine = set(request.targets.ranks) or {r.rank for r in ranks}
    if not mine:
        warnings.append(f"no ranks found on {machine}: nothing to back up here")
    if layout is None:
        warnings.append("no [layout] in the agent's --actions-config: backup peers not shown (the ranks know "
                        "theirs from RANKSCOPE_BACKUP_TARGETS)")
    else:
        world = ranks[0].world_size if ranks else None
        try:
            pairs = backup_plan(layout, world_size=world).pairs
            peers = tuple((p.rank, p.peer) for p in pairs if p.rank in mine)
        except RankscopeError as exc:
            warnings.append(f"backup peers unknown: {exc.message}")
    plan = ActionPlan(
        action_id=request.action_id, kind=ActionKind.BACKUP,
        summary=f"back up the checkpoints of ranks {' '.join(map(str, sorted(mine))) or 'none'} to their peers",
        machines=(machine,), processes=processes_of(machine, ranks), backup_peers=peers,
        steps=(f"write the backup request {request_file}",
               "each rank snapshots parameters and optimizer state at its next step boundaries into CPU memory "
               "and writes the shard, with its SHA-256, to this agent's store and to its backup peer's",
               f"wait up to {wait_s:g} s for a new shard of every rank here and verify its checksum"),
        warnings=tuple(warnings))
    return Planned(plan, ranks, 3)
