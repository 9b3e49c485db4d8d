"""The data of the action protocol: requests, plans, progress, results, audit records.

A client never sends shell text. It names an action kind and typed
arguments (machines, ranks, a version, a reason); the agent carries out the
procedure it was configured with. Everything here is a frozen dataclass that
converts to and from plain JSON (``to_json``/``from_json``), so the agent's
RPCs, the audit log and the TUI all speak the same shape.

Confirmation is part of the data: every plan carries the exact phrase a
person must type (for eviction) or the targets a yes/no prompt must name,
and :class:`ConfirmationRule` is the one place that decides.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from rankscope.contract.errors import RankscopeError


class ActionKind(StrEnum):
    EVICT = "evict"
    HOT_UPDATE = "hot_update"
    BACKUP = "backup"
    ROLLBACK = "rollback"


class ActionState(StrEnum):
    """Where an action stands; the last four are final."""

    PLANNED = "planned"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    REFUSED = "refused"

    @property
    def final(self) -> bool:
        return self in (ActionState.SUCCEEDED, ActionState.FAILED, ActionState.CANCELLED, ActionState.REFUSED)


class UpdateMode(StrEnum):
    IMMEDIATE = "immediate"  # stop the training processes now and restart them on the new code
    LAZY = "lazy"  # apply at the next restart or failure, or when the window expires


class VersionSource(StrEnum):
    GIT = "git"  # a ref (branch, tag, commit) in the agent's configured repository
    DIR = "dir"  # a directory prepared on every machine beforehand


# Ids, machine names and git refs travel as arguments and end up as argv
# elements; none may start with '-' (it would read as an option) and none may
# hold whitespace or control characters.
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
_MACHINE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,252}$")
_GIT_REF_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._/@{}^~+-]{0,254}$")
_MAX_TEXT = 500
DEFAULT_LAZY_WINDOW_S = 24 * 3600.0  # ByteRobust §6.1: a pending non-critical update is applied within a day


def check_text(value: str, what: str) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > _MAX_TEXT \
            or any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
        raise RankscopeError(f"{what} must be one line of 1-{_MAX_TEXT} printable characters, got {value!r}",
                             f"give a short {what} without newlines or control characters")
    return value


def check_action_id(action_id: str) -> str:
    if not isinstance(action_id, str) or not _ID_RE.match(action_id):
        raise RankscopeError(f"bad action id {action_id!r}",
                             "use letters, digits and . _ : - (up to 128), starting with a letter or digit")
    return action_id


def check_machine(name: str) -> str:
    if not isinstance(name, str) or not _MACHINE_RE.match(name):
        raise RankscopeError(f"bad machine name {name!r}",
                             "use the host names the agents report (letters, digits, . _ : -)")
    return name


def check_git_ref(ref: str) -> str:
    if not isinstance(ref, str) or not _GIT_REF_RE.match(ref) or ".." in ref or ref.endswith((".lock", "/")):
        raise RankscopeError(f"bad git ref {ref!r}", "name a branch, tag or commit of the configured repository")
    return ref


@dataclass(frozen=True, slots=True)
class Targets:
    """What an action is aimed at: machines by name and/or ranks by number."""

    machines: tuple[str, ...] = ()
    ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for m in self.machines:
            check_machine(m)
        for r in self.ranks:
            if isinstance(r, bool) or not isinstance(r, int) or r < 0:
                raise RankscopeError(f"bad rank {r!r} in targets", "ranks are non-negative integers")

    def describe(self) -> str:
        parts = []
        if self.machines:
            parts.append("machines " + " ".join(self.machines))
        if self.ranks:
            parts.append("ranks " + " ".join(str(r) for r in self.ranks))
        return "; ".join(parts) or "the whole job"


@dataclass(frozen=True, slots=True)
class EvictArgs:
    reason: str
    # The machines this one is evicted together with in the same action (filled in by the client for each
    # agent's part): a backend that restarts the whole job (a Slurm requeue) must take them out in the same
    # step, since its restart ends the other agents before they act.
    together: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_text(self.reason, "eviction reason")
        for m in self.together:
            check_machine(m)


@dataclass(frozen=True, slots=True)
class HotUpdateArgs:
    source: VersionSource
    version: str  # git ref for GIT; for DIR, the prepared directory's path on every machine
    mode: UpdateMode = UpdateMode.IMMEDIATE
    window_s: float = DEFAULT_LAZY_WINDOW_S
    note: str = ""

    def __post_init__(self) -> None:
        if self.source == VersionSource.GIT:
            check_git_ref(self.version)
        else:
            check_text(self.version, "prepared directory")
            if not self.version.startswith("/"):
                raise RankscopeError(f"prepared directory {self.version!r} is not absolute",
                                     "give the absolute path the directory has on every machine")
        if not (isinstance(self.window_s, int | float) and 0 < self.window_s <= 30 * 24 * 3600):
            raise RankscopeError(f"lazy window must be between 0 and 30 days, got {self.window_s!r} s",
                                 "use the default 24 h or a few hours")
        if self.note:
            check_text(self.note, "note")


@dataclass(frozen=True, slots=True)
class BackupArgs:
    """Snapshot every rank at its next step boundary and copy each shard to its backup peer."""

    tag: str = ""

    def __post_init__(self) -> None:
        if self.tag:
            check_action_id(self.tag)


@dataclass(frozen=True, slots=True)
class RollbackArgs:
    """Return the code to the version before the current one (or to ``to_version`` if given)."""

    to_version: str = ""
    mode: UpdateMode = UpdateMode.IMMEDIATE

    def __post_init__(self) -> None:
        if self.to_version:
            check_text(self.to_version, "version")


ActionArgs = EvictArgs | HotUpdateArgs | BackupArgs | RollbackArgs
_ARGS_OF: dict[ActionKind, type[Any]] = {
    ActionKind.EVICT: EvictArgs,
    ActionKind.HOT_UPDATE: HotUpdateArgs,
    ActionKind.BACKUP: BackupArgs,
    ActionKind.ROLLBACK: RollbackArgs,
}


@dataclass(frozen=True, slots=True)
class ActionRequest:
    """A client's request. ``action_id`` makes it idempotent: the same id is carried out at most once."""

    action_id: str
    kind: ActionKind
    targets: Targets
    args: ActionArgs
    requested_by: str  # the person (or tool) acting, as the client names it; the audit log records it
    job_id: str | None = None
    # The token the agent saw on the call (its role and fingerprint, never the secret), set by the agent: the
    # audit log's "who" must not be only what the client claims. Not part of the request's identity.
    caller: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        check_action_id(self.action_id)
        want = _ARGS_OF[ActionKind(self.kind)]
        if not isinstance(self.args, want):
            raise RankscopeError(f"{self.kind} takes {want.__name__}, got {type(self.args).__name__}",
                                 "build the request with the argument type of its kind")
        check_text(self.requested_by, "requester")
        if self.kind == ActionKind.EVICT and not self.targets.machines:
            raise RankscopeError("an eviction needs at least one machine", "name the suspect group's machines")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = _to_json(self)
        return out

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> ActionRequest:
        try:
            kind = ActionKind(data["kind"])
            args = _args_from_json(kind, data.get("args") or {})
            targets = data.get("targets") or {}
            return ActionRequest(
                action_id=str(data["action_id"]),
                kind=kind,
                targets=Targets(tuple(targets.get("machines", ())), tuple(targets.get("ranks", ()))),
                args=args,
                requested_by=str(data["requested_by"]),
                job_id=data.get("job_id"),
            )
        except (KeyError, ValueError, TypeError) as exc:
            raise RankscopeError(f"malformed action request: {exc}",
                                 "send action_id, kind, targets, args and requested_by") from exc


def _args_from_json(kind: ActionKind, data: Mapping[str, Any]) -> ActionArgs:
    if kind == ActionKind.EVICT:
        return EvictArgs(reason=str(data["reason"]))
    if kind == ActionKind.HOT_UPDATE:
        return HotUpdateArgs(source=VersionSource(data["source"]), version=str(data["version"]),
                             mode=UpdateMode(data.get("mode", UpdateMode.IMMEDIATE)),
                             window_s=float(data.get("window_s", DEFAULT_LAZY_WINDOW_S)),
                             note=str(data.get("note", "")))
    if kind == ActionKind.BACKUP:
        return BackupArgs(tag=str(data.get("tag", "")))
    return RollbackArgs(to_version=str(data.get("to_version", "")),
                        mode=UpdateMode(data.get("mode", UpdateMode.IMMEDIATE)))


@dataclass(frozen=True, slots=True)
class ProcessRef:
    """One training process an action stops or restarts."""

    machine: str
    pid: int
    rank: int | None = None


@dataclass(frozen=True, slots=True)
class ActionPlan:
    """What an action will do, exactly, shown before anyone confirms.

    ``commands`` are the argv lists a backend will run (never a shell
    string), so the plan a person approves is the plan that runs.
    ``confirm_phrase`` is what must be typed for the most destructive kinds
    (eviction); for the others the prompt names ``machines`` and a yes/no
    with Cancel as default is enough.
    """

    action_id: str
    kind: ActionKind
    summary: str
    machines: tuple[str, ...] = ()
    processes: tuple[ProcessRef, ...] = ()
    standbys: tuple[str, ...] = ()
    backup_peers: tuple[tuple[int, int], ...] = ()  # (rank, peer)
    commands: tuple[tuple[str, ...], ...] = ()
    steps: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    typed_confirmation: bool = False
    confirm_phrase: str = ""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = _to_json(self)
        return out


class ConfirmedTargets(Protocol):
    """What a person confirmed (``rankscope.actions.agent_protocol.Confirmation``): machines, ranks, the phrase."""

    @property
    def machines(self) -> tuple[str, ...]: ...
    @property
    def ranks(self) -> tuple[int, ...]: ...
    @property
    def typed(self) -> str: ...


@dataclass(frozen=True, slots=True)
class ConfirmationRule:
    """The tool's main safety rule, in one place: a destructive action is confirmed by naming its exact targets.

    ``plans``: one agent's plan, or every agent's plan of one action. An eviction (or any plan asking for it)
    needs the typed phrase naming every planned machine, white space aside; anything else an explicit yes;
    anything unclear is Cancel. The TUI asks for what it requires (``phrase``, ``accepts``); the client checks a
    confirmation against all the plans before it sends anything, and each agent against the plan it makes at
    that moment, so a confirmation of a stale plan never acts (``problem``).
    """

    plans: tuple[ActionPlan, ...]
    kind: ActionKind | None = None  # the request's kind (None: the plans'), so a request nobody planned still has one

    @classmethod
    def of(cls, plans: ActionPlan | Iterable[ActionPlan], kind: ActionKind | None = None) -> ConfirmationRule:
        return cls((plans,) if isinstance(plans, ActionPlan) else tuple(plans), kind)

    @staticmethod
    def typed_for(kind: ActionKind) -> bool:
        """Eviction takes machines out of the job: the person types the phrase, not just 'y'."""
        return kind == ActionKind.EVICT

    @staticmethod
    def phrase_for(kind: ActionKind, machines: Sequence[str]) -> str:
        """The phrase to type: the verb and every target, so nobody evicts a machine they did not read."""
        return f"{kind.value} {' '.join(machines)}".strip()

    @property
    def machines(self) -> tuple[str, ...]:
        """Every planned machine once, in the plans' order."""
        return tuple(dict.fromkeys(m for p in self.plans for m in p.machines))

    @property
    def phrase(self) -> str | None:
        """The phrase to type, or None when an explicit yes is enough."""
        kind = self.kind or (self.plans[0].kind if self.plans else None)
        if kind is None:
            return None
        if not (self.typed_for(kind) or any(p.typed_confirmation for p in self.plans)):
            return None
        if len(self.plans) == 1 and self.plans[0].confirm_phrase:
            return self.plans[0].confirm_phrase
        return self.phrase_for(kind, self.machines)

    def accepts(self, answer: str | bool | None) -> bool:
        """Whether a person's answer confirms the plans; else Cancel."""
        if not self.plans:
            return False
        phrase = self.phrase
        if phrase is not None:
            return isinstance(answer, str) and " ".join(answer.split()) == phrase
        return answer is True

    def problem(self, confirmation: ConfirmedTargets, ranks: Iterable[int]) -> str | None:
        """Why ``confirmation`` does not confirm these plans, whose request targets ``ranks`` (None when it does).

        It must name exactly the planned machines (each once) and the requested ranks, and carry the phrase
        when one is needed. Anything unclear refuses.
        """
        planned = self.machines
        if sorted(set(confirmation.machines)) != sorted(planned) or \
                len(confirmation.machines) != len(set(confirmation.machines)):
            return (f"the confirmation names machines [{' '.join(confirmation.machines) or 'none'}] but the "
                    f"plan{'s' if len(self.plans) > 1 else ''} target{'' if len(self.plans) > 1 else 's'} "
                    f"[{' '.join(planned) or 'none'}]")
        wanted = tuple(sorted(set(ranks)))
        if tuple(sorted(set(confirmation.ranks))) != wanted:
            return f"the confirmation names ranks {list(confirmation.ranks)} but the request targets {list(wanted)}"
        # A confirmation that reached the agent is the person's yes; a typed one must also carry the phrase.
        if not self.accepts(confirmation.typed if self.phrase is not None else True):
            return f"the typed confirmation {confirmation.typed!r} is not {self.phrase!r}"
        return None


@dataclass(frozen=True, slots=True)
class ActionProgress:
    """A step of a running action, broadcast to every attached TUI."""

    action_id: str
    at: float  # wall clock, seconds
    step: int
    total: int
    message: str


@dataclass(frozen=True, slots=True)
class ActionResult:
    action_id: str
    kind: ActionKind
    state: ActionState
    message: str
    started: float | None = None
    finished: float | None = None
    details: tuple[str, ...] = ()
    replayed: bool = False  # True when a repeated id returned the recorded result without acting again

    @property
    def ok(self) -> bool:
        return self.state == ActionState.SUCCEEDED

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = _to_json(self)
        return out

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> ActionResult:
        return ActionResult(
            action_id=str(data["action_id"]), kind=ActionKind(data["kind"]), state=ActionState(data["state"]),
            message=str(data["message"]), started=data.get("started"), finished=data.get("finished"),
            details=tuple(data.get("details", ())), replayed=bool(data.get("replayed", False)),
        )


# In a hot-update's audit records: the code link was switched and the launcher is to restart the ranks on it
# (the agent never stops them itself); a launcher's recovery watches the audit stream for it.
RESTART_REQUESTED = "restart requested"


@dataclass(frozen=True, slots=True)
class AuditRecord:
    """One line of the audit log: who did what, when, and how it ended (or 'started')."""

    seq: int
    action_id: str
    who: str
    when: float  # wall clock, seconds
    kind: ActionKind
    what: str  # the plan's summary: verb and exact targets
    result: str  # "requested", "started", or a final ActionState value
    message: str = ""
    machines: tuple[str, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = _to_json(self)
        return out


def _to_json(value: Any) -> Any:
    if isinstance(value, StrEnum):
        return value.value
    if hasattr(value, "__dataclass_fields__"):
        out = {name: _to_json(getattr(value, name)) for name in value.__dataclass_fields__}
        if isinstance(value, ActionRequest):
            out["args"] = _to_json(value.args)
            del out["caller"]  # the agent's note, not the client's request (the idempotency key compares these)
        return out
    if isinstance(value, tuple | list):
        return [_to_json(v) for v in value]
    return value
