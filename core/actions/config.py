"""An agent's ``--actions-config``: which procedures it may carry out, and where it keeps its state.

Read once at start-up (:func:`load_actions_config`); a bad setting fails
there, with the fix, not at the first action. The eviction backend is built
from it (:func:`make_backend`); ``local`` eviction's warm standbys are read
per plan (:func:`local_standbys`), since the launcher's pool changes while the
agent runs.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rankscope.actions.evict_backends import (
    BACKENDS,
    EvictionBackend,
    KubernetesBackend,
    SiteCommandBackend,
    SlurmBackend,
)
from rankscope.actions.hot_update import CodeVersions
from rankscope.actions.model import check_machine
from rankscope.contract.errors import RankscopeError
from rankscope.contract.snapshot import DEFAULT_ORDER, SIZES_FIX, Layout

DEFAULT_GRACE_S = 10.0
BACKUP_WAIT_S = 60.0  # for every rank to reach a step boundary and write its shard
MAX_STANDBYS_FILE_BYTES = 4 * 1024 * 1024  # 16,384 names of 250 characters
CONFIG_FIX = "see `rankscope agent --help` for the --actions-config format"


@dataclass(frozen=True, slots=True)
class EvictionSettings:
    """Which backend evicts, and its settings (keyword arguments of the backend's class)."""

    backend: str = "local"
    grace_s: float = DEFAULT_GRACE_S  # local: SIGTERM, then SIGKILL after this long
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class HotUpdateSettings:
    current: Path  # the link the job runs its code from
    versions_dir: Path
    repo: Path | None = None
    git: str = "git"
    prepared_roots: tuple[Path, ...] = ()  # where prepared directories may lie; empty: versions_dir only

    def code_versions(self) -> CodeVersions:
        return CodeVersions(self.current, self.versions_dir, self.repo, self.git, self.prepared_roots)


@dataclass(frozen=True, slots=True)
class ActionsConfig:
    """The procedures an agent may carry out, and where it keeps its state."""

    state_dir: Path
    eviction: EvictionSettings = field(default_factory=EvictionSettings)
    hot_update: HotUpdateSettings | None = None
    layout: Layout | None = None  # for the backup plan
    backup_wait_s: float = BACKUP_WAIT_S  # how long a backup waits for the ranks' shards
    backup_align_steps: int = 1  # ranks snapshot at step multiples of this (> the steps between agents' requests)

    @property
    def audit_path(self) -> Path:
        return self.state_dir / "audit.sqlite"

    @property
    def blocklist_path(self) -> Path:
        return self.state_dir / "blocklist.sqlite"

    @property
    def history_path(self) -> Path:
        return self.state_dir / "hot_update_history.sqlite"


_BACKEND_KEYS: dict[str, frozenset[str]] = {
    "local": frozenset({"standbys", "standbys_file"}),
    "slurm": frozenset({"job_id", "restart", "step_id", "scontrol", "scancel", "sinfo", "standby_partition",
                        "standby_reservation", "timeout_s"}),
    "kubernetes": frozenset({"namespace", "selector", "kubectl", "context", "timeout_s"}),
    "command": frozenset({"script", "job_id", "timeout_s"}),
}


MAX_CONFIG_BYTES = 1024 * 1024  # an actions config is a few hundred bytes


def state_dir_for(template: Path, machine: str) -> Path:
    """``--state-dir`` with ``%n`` replaced by the machine name, made one plain path component: a name such as
    ``../../x`` (a hostname, a Slurm node, --machine-name) must not place the state outside the directory given."""
    part = re.sub(r"[^A-Za-z0-9_.-]", "_", machine) or "_"
    if part.startswith("."):
        part = "_" + part[1:]
    return Path(str(template).replace("%n", part))


def load_actions_config(path: Path | None, state_dir: Path | None) -> ActionsConfig | None:
    """``--actions-config`` (TOML, or JSON by suffix) and ``--state-dir`` -> the config; None: no actions.

    Format (every section optional)::

        state_dir = "/var/lib/rankscope"      # --state-dir wins
        [eviction]
        backend = "slurm"                     # local | slurm | kubernetes | command
        grace_s = 10                          # local: SIGTERM -> SIGKILL
        [eviction.slurm]                      # the chosen backend's settings
        job_id = "12345"
        restart = "requeue"
        # [eviction.local]                    # local: the launcher's warm standbys, in the order
        # standbys = ["spare-0", "spare-1"]   # it takes them (shown in the eviction plan), or
        # standbys_file = "/run/standbys.json"  # a JSON list the launcher keeps current (read per plan)
        [hot_update]
        current = "/srv/job/code"             # a symbolic link the job runs from
        versions_dir = "/srv/job/versions"
        repo = "/srv/job/repo"                # for git refs
        prepared_roots = ["/srv/job/prepared"]  # prepared directories only under these (default: versions_dir)
        [backup]
        wait_s = 60                           # for every rank's shard
        align_steps = 1                       # snapshot at step multiples of this; more than the steps
                                              # that pass between the agents' requests
        [layout]                              # for the backup plan
        tp = 2
        pp = 4
        dp = 2
        order = "tp-cp-ep-dp-pp"
        ranks_per_machine = 2
    """
    data: dict[str, Any] = {}
    if path is not None:
        data = _read_config(path)
    where = str(path) if path is not None else "--state-dir"
    folder = state_dir
    if folder is None and data.get("state_dir") is not None:
        folder = Path(_path_text(data["state_dir"], f"{where}: state_dir"))
    if folder is None:
        if path is None:
            return None
        raise RankscopeError(f"{where}: no state directory for the audit log, blocklist and history",
                             "pass --state-dir DIR or set state_dir in the file")
    known = {"state_dir", "eviction", "hot_update", "layout", "backup"}
    _no_unknown(data, known, where)
    backup = data.get("backup", {})
    if not isinstance(backup, dict) or set(backup) - {"wait_s", "align_steps"}:
        raise RankscopeError(f"{where} [backup]: only wait_s and align_steps are known", CONFIG_FIX)
    wait_s = backup.get("wait_s", BACKUP_WAIT_S)
    if isinstance(wait_s, bool) or not isinstance(wait_s, int | float) or not 0 < wait_s <= 24 * 3600:
        raise RankscopeError(f"{where} [backup]: wait_s must be 0-86400 seconds (more than 0), got {wait_s!r}",
                             f"use the default {BACKUP_WAIT_S:g}, or longer for ranks with slow steps")
    align = backup.get("align_steps", 1)
    if isinstance(align, bool) or not isinstance(align, int):
        raise RankscopeError(f"{where} [backup]: align_steps must be a whole number of steps, got {align!r}",
                             "use 1, or more than the steps that pass between the agents' requests")
    return ActionsConfig(
        state_dir=folder,
        eviction=_eviction(data.get("eviction", {}), where),
        hot_update=_hot_update(data.get("hot_update"), where),
        layout=_layout(data.get("layout"), where),
        backup_wait_s=float(wait_s),
        backup_align_steps=max(1, align),
    )


def _read_config(path: Path) -> dict[str, Any]:
    try:
        # read without blocking: a FIFO in its place would hold the agent's start for good
        text = _read_regular(path, MAX_CONFIG_BYTES).decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RankscopeError(f"cannot read --actions-config {path}: {exc}",
                             "give a regular TOML or JSON file (not a FIFO or device), readable by the agent") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise RankscopeError(f"{path} is not valid {'JSON' if path.suffix == '.json' else 'TOML'}: {exc}",
                             CONFIG_FIX) from None
    if not isinstance(data, dict):
        raise RankscopeError(f"{path} must hold a table of settings", CONFIG_FIX)
    return data


def _no_unknown(section: Mapping[str, Any], known: set[str] | frozenset[str], where: str) -> None:
    unknown = sorted(set(section) - set(known))
    if unknown:
        raise RankscopeError(f"{where}: unknown setting(s) {', '.join(unknown)}",
                             f"use only {', '.join(sorted(known)) or '(none)'}; {CONFIG_FIX}")


def _path_text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip() or "\0" in value:
        raise RankscopeError(f"{where} must be a path, got {value!r}", f'write it as a quoted path; {CONFIG_FIX}')
    return value


def _table(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise RankscopeError(f"{where} must be a table", CONFIG_FIX)
    return value


def _eviction(value: Any, where: str) -> EvictionSettings:
    section = _table(value, f"{where} [eviction]")
    backend = str(section.get("backend", "local"))
    if backend not in BACKENDS:
        raise RankscopeError(f"{where}: unknown eviction backend {backend!r}", f"use one of {', '.join(BACKENDS)}")
    _no_unknown(section, {"backend", "grace_s", *BACKENDS}, f"{where} [eviction]")
    grace = section.get("grace_s", DEFAULT_GRACE_S)
    if isinstance(grace, bool) or not isinstance(grace, int | float) or not 0 <= grace <= 600:
        raise RankscopeError(f"{where}: grace_s must be 0-600 seconds, got {grace!r}", "use the default 10")
    options = dict(_table(section.get(backend, {}), f"{where} [eviction.{backend}]"))
    _no_unknown(options, _BACKEND_KEYS[backend], f"{where} [eviction.{backend}]")
    if backend == "local" and "standbys" in options:
        options["standbys"] = _machine_list(options["standbys"], f"{where} [eviction.local] standbys")
    if backend == "local" and "standbys_file" in options:
        file = options["standbys_file"]
        if not isinstance(file, str) or not file.startswith("/"):
            raise RankscopeError(f"{where} [eviction.local] standbys_file must be an absolute path, got {file!r}",
                                 'write it as standbys_file = "/path/to/standbys.json"')
    settings = EvictionSettings(backend, float(grace), options)
    make_backend(settings)  # a bad setting fails at start-up, not at the first eviction
    return settings


def _machine_list(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise RankscopeError(f"{where} must be a list of machine names, got {value!r}",
                             'write it as standbys = ["spare-0", "spare-1"]')
    try:
        return tuple(dict.fromkeys(check_machine(v) for v in value))
    except RankscopeError as exc:
        raise RankscopeError(f"{where}: {exc.message}", exc.fix) from None


def local_standbys(settings: EvictionSettings) -> tuple[str, ...]:
    """The warm standbys the launcher takes, in order, when ``local`` eviction names them (else none).

    ``standbys_file`` is read at each call: the pool changes as standbys join
    and new ones are added, while an agent reads its config once.
    """
    if settings.backend != "local":
        return ()
    names = tuple(settings.options.get("standbys", ()))
    file = settings.options.get("standbys_file")
    if file is None:
        return names
    fix = "the launcher writes it as a JSON list of machine names"
    try:
        listed = json.loads(_read_regular(Path(file), MAX_STANDBYS_FILE_BYTES).decode("utf-8"))
    except FileNotFoundError:
        return names  # no pool written (yet): none on hand
    except RecursionError:
        raise RankscopeError(f"cannot read the standby list {file}: nested too deep for a list of names", fix) from None
    except (OSError, ValueError) as exc:
        raise RankscopeError(f"cannot read the standby list {file}: {exc}", fix) from None
    return tuple(dict.fromkeys((*names, *_machine_list(listed, f"standby list {file}"))))


def _read_regular(path: Path, limit: int) -> bytes:
    """A small regular file's bytes, read without blocking: the agent reads the standby list on every plan (a read
    token's call) and its config at start, and a FIFO in their place would hold a thread for good."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with open(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path} is not a regular file")
        if st.st_size > limit:
            raise OSError(f"{path} holds {st.st_size} bytes, more than this file ever needs ({limit})")
        return fh.read(limit + 1)


def _hot_update(value: Any, where: str) -> HotUpdateSettings | None:
    if value is None:
        return None
    section = _table(value, f"{where} [hot_update]")
    _no_unknown(section, {"current", "versions_dir", "repo", "git", "prepared_roots"}, f"{where} [hot_update]")
    missing = [k for k in ("current", "versions_dir") if k not in section]
    if missing:
        raise RankscopeError(f"{where} [hot_update] needs {' and '.join(missing)}", CONFIG_FIX)
    here = f"{where} [hot_update]"
    repo = section.get("repo")
    roots = section.get("prepared_roots", [])
    if not isinstance(roots, list) or not all(isinstance(r, str) and r.startswith("/") and ".." not in Path(r).parts
                                              for r in roots):
        raise RankscopeError(f"{here} prepared_roots must be a list of absolute paths without '..', got {roots!r}",
                             'write it as prepared_roots = ["/srv/job/prepared"]')
    return HotUpdateSettings(Path(_path_text(section["current"], f"{here} current")),
                             Path(_path_text(section["versions_dir"], f"{here} versions_dir")),
                             Path(_path_text(repo, f"{here} repo")) if repo else None,
                             _path_text(section.get("git", "git"), f"{here} git"),
                             tuple(Path(r) for r in roots))


def _layout(value: Any, where: str) -> Layout | None:
    if value is None:
        return None
    section = dict(_table(value, f"{where} [layout]"))
    _no_unknown(section, {*Layout.SIZES, "order", "ranks_per_machine"}, f"{where} [layout]")
    section = {k: v for k, v in section.items() if v is not None}  # JSON null: not given (the default)
    # The sizes' and the order's meaning is checked where the backup pairing is planned (a plan warning);
    # here only their types, so a wrong one fails at start-up rather than deep inside the first plan.
    layout = Layout(**section)
    problems = layout.size_problems(lambda k: f"{where} [layout] {k}")
    if problems:
        raise RankscopeError(problems, SIZES_FIX)
    if not isinstance(layout.order, str):
        raise RankscopeError(f"{where} [layout] order must be a string, got {layout.order!r}",
                             f'write it as order = "{DEFAULT_ORDER}" (fastest varying first)')
    return layout


def make_backend(settings: EvictionSettings) -> EvictionBackend | None:
    """The configured eviction backend; None for ``local`` (the agent stops its own ranks)."""
    if settings.backend == "local":
        return None
    options = dict(settings.options)
    try:
        if settings.backend == "slurm":
            return SlurmBackend(**options)
        if settings.backend == "kubernetes":
            return KubernetesBackend(**options)
        if settings.backend == "command":
            return SiteCommandBackend(**options)
    except TypeError as exc:
        raise RankscopeError(f"[eviction.{settings.backend}]: {exc}", CONFIG_FIX) from None
    return None
