"""In-place hot-update of a job's code (ByteRobust §6.1).

The job runs its code from one directory, ``current``, which is a symbolic
link into a versions directory. Changing the code is switching that link:

- a **git ref** of the configured repository is resolved to a commit and
  checked out once into ``<versions>/<commit>``: its files only (a version
  costs its checked-out files, the objects stay in the repository), written
  by ``git read-tree -u`` with an index of its own into a hidden directory
  that is then renamed into place, so a tree under a commit's name is
  complete, and the repository is only read (every machine of a job checks
  the version out at once: nothing of theirs is shared to wait for);
- a **prepared directory** (copied to every machine beforehand) is used as it is,
  when it lies under one of the configured roots (``prepared_roots``; the
  versions directory by default) -- checked on the path as written (absolute,
  no ``..``) before anything is looked up on disk, so a plan says nothing about
  other paths, and again once resolved, so a link cannot lead out -- and no
  other user can write it (the job runs whatever is there at its next start).

The switch is atomic: a new link is made beside ``current`` and renamed over
it, so a process starting at any moment sees either the old tree or the new
one, never a missing directory. The machines are not rescheduled; the agent
restarts the training processes where they are (the ``restart`` callback) and
they resume from the latest checkpoint.

Modes: *immediate* switches and restarts now. *Lazy* resolves the version at
once (a bad ref fails at request time, not at 3 a.m.) and waits: it is applied
at the next restart or failure the agent reports, or when its window (24 h by
default) expires -- :func:`lazy_update_due` decides, purely from (now, the
pending update, the events). Every request and its outcome goes into the
persistent history; rollback returns to the version before the newest update.

git runs as an argv list with ``shell=False``; refs are validated so none
can pass as an option, and ``--end-of-options`` makes sure of it.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from rankscope.actions.history import (
    HotUpdateHistory,
    UpdateKind,
    UpdateRecord,
    UpdateState,
    Version,
    find_version,
)
from rankscope.actions.model import HotUpdateArgs, RollbackArgs, UpdateMode, VersionSource, check_git_ref
from rankscope.contract.errors import RankscopeError

# The agent's part: restart the training processes on this machine where they are, on ``version``.
RestartCallback = Callable[[Version, str], None]

_GIT_TIMEOUT_S = 300.0


class JobEventKind(StrEnum):
    RESTART = "restart"
    FAILURE = "failure"


@dataclass(frozen=True, slots=True)
class JobEvent:
    kind: JobEventKind
    at: float  # wall clock, seconds


@dataclass(frozen=True, slots=True)
class LazyDecision:
    apply: bool
    trigger: str  # "restart", "failure", "window" or "" when not due
    reason: str


def lazy_update_due(now: float, pending: UpdateRecord | None, events: Sequence[JobEvent]) -> LazyDecision:
    """Whether a pending lazy update is to be applied now, and why.

    The first restart or failure at or after the request applies it (the
    job is stopping anyway, so the update costs nothing extra); otherwise it
    is applied once its window has expired. Pure: same inputs, same answer.
    """
    if pending is None or pending.state != UpdateState.PENDING:
        return LazyDecision(False, "", "no pending update")
    if pending.mode == UpdateMode.IMMEDIATE:
        return LazyDecision(True, "immediate", "an immediate update is applied at once")
    after = sorted((e for e in events if e.at >= pending.requested_at), key=lambda e: e.at)
    if after:
        first = after[0]
        return LazyDecision(True, first.kind.value, f"the job had a {first.kind.value} after the request")
    if now >= pending.deadline:
        return LazyDecision(True, "window", f"the {pending.window_s / 3600:g} h window expired")
    left_h = (pending.deadline - now) / 3600
    return LazyDecision(False, "", f"waits for the next restart or failure, at most {left_h:.1f} h more")


class CodeVersions:
    """The ``current`` link, the versions directory and (optionally) the git repository behind them."""

    def __init__(self, current: str | Path, versions_dir: str | Path, repo: str | Path | None = None,
                 git: str = "git", prepared_roots: tuple[str | Path, ...] = ()) -> None:
        self.current = Path(current)
        self.versions_dir = Path(versions_dir)
        self.repo = Path(repo) if repo is not None else None
        self.git = git
        # Where prepared directories may lie: the versions directory unless the config names others.
        self.prepared_roots = tuple(Path(r) for r in prepared_roots) or (self.versions_dir,)

    def resolve(self, source: VersionSource, version: str) -> Version:
        """Make ``version`` available on disk and name it; nothing is switched yet."""
        if source == VersionSource.GIT:
            return self.checkout(version)
        return self.prepared(version)

    def commit_of(self, ref: str) -> str:
        """The commit ``ref`` names in the repository; a ref that names none is refused with the fix."""
        if self.repo is None:
            raise RankscopeError("this agent has no code repository configured",
                                 "start the agent with --code-repo, or hot-update to a prepared directory")
        check_git_ref(ref)
        # `rev-parse --verify --quiet` exits 1 with no output when the ref names nothing; other failures speak.
        missing = RankscopeError(f"no git ref {ref!r} in {self.repo}",
                                 f"pick a tag, branch or commit that exists there (git -C {self.repo} tag; "
                                 f"git -C {self.repo} log --oneline)")
        return self._git("rev-parse", "--verify", "--quiet", "--end-of-options", f"{ref}^{{commit}}",
                         what=f"resolve {ref!r}", silent_failure=missing).strip()

    def checkout(self, ref: str) -> Version:
        commit = self.commit_of(ref)
        path = self.versions_dir / commit
        if not path.is_dir():
            self._export(commit, path)
        return Version(label=f"git:{ref} ({commit[:12]})", path=str(path))

    def _export(self, commit: str, path: Path) -> None:
        """Write ``commit``'s files to ``path``, which appears complete or not at all.

        A hot-update reaches every machine of a job at once, and machines may
        share the repository (a drill's do, as machines on a shared file
        system would). ``git worktree add`` registers each tree in the
        repository: concurrent adds and prunes broke each other's registrations
        ("failed to read .git/worktrees/<commit>/commondir") and a machine stayed
        on the old code, so they took turns under a lock on the repository
        (0.25 s of a four-machine update on a loaded host). Here each checkout
        has its own index and directory and the repository is only read.
        """
        self.versions_dir.mkdir(parents=True, exist_ok=True)
        partial = self.versions_dir / f".{commit}.{uuid.uuid4().hex[:12]}.partial"
        index = partial.with_name(partial.name + ".index")
        partial.mkdir()
        try:
            # git's own checkout (filters, modes, links), into this directory with this index: no HEAD, no lock.
            self._git(f"--work-tree={partial}", "read-tree", "--reset", "-u", commit,
                      what=f"check out {commit[:12]}", env={"GIT_INDEX_FILE": str(index)})
            try:
                partial.rename(path)
            except OSError as exc:
                if not path.is_dir():
                    raise RankscopeError(f"cannot put version {commit[:12]} at {path}: {exc.strerror}",
                                         f"check that the agent's user can write {self.versions_dir}") from exc
                # Another checkout of the same version (a machine sharing this directory) finished first.
        finally:
            shutil.rmtree(partial, ignore_errors=True)
            index.unlink(missing_ok=True)

    def prepared(self, directory: str) -> Version:
        """The prepared directory as a version; refused unless it lies under a prepared root (see the module doc)."""
        path = Path(directory)
        roots = ", ".join(str(r) for r in self.prepared_roots)
        outside = RankscopeError(
            f"prepared directory {directory} is not under this agent's prepared roots ({roots})",
            "copy the code to the same absolute path under one of them on every machine, or add its root to "
            "[hot_update] prepared_roots in the agent's --actions-config")
        # On the path as written first: nothing outside the roots is looked up, so a refusal tells nothing about it.
        if not path.is_absolute() or ".." in path.parts or not _strictly_under(path, self.prepared_roots):
            raise outside
        real = path.resolve()
        if not _strictly_under(real, tuple(r.resolve() for r in self.prepared_roots)):
            raise outside  # a link under a root that leads out of them
        try:
            st = os.stat(real)
        except OSError:
            st = None
        if st is None or not stat.S_ISDIR(st.st_mode):
            raise RankscopeError(f"prepared directory {directory} does not exist on this machine",
                                 "copy the code to the same absolute path on every machine first")
        if st.st_uid not in (os.geteuid(), 0):
            raise RankscopeError(
                f"prepared directory {directory} belongs to uid {st.st_uid}, not to this agent's user "
                f"(uid {os.geteuid()}) or root: its owner could change the code the job runs",
                f"copy the code into a directory of the agent's user (chown {os.geteuid()} {real})")
        if st.st_mode & 0o022:
            raise RankscopeError(
                f"prepared directory {directory} can be written by other users (mode {stat.S_IMODE(st.st_mode):o}): "
                "the job would run whatever they put there",
                f"chmod go-w {real} (and check what is in it)")
        return Version(label=f"dir:{real}", path=str(real))

    def target(self) -> Path | None:
        """Where ``current`` points now (None when it does not exist yet)."""
        if self.current.is_symlink():
            return Path(os.readlink(self.current))
        if self.current.exists():
            raise RankscopeError(
                f"the code directory {self.current} is a real directory, not a link, so it cannot be switched",
                f"move it into {self.versions_dir} and make {self.current} a symbolic link to it",
            )
        return None

    def switch(self, version: Version) -> Path | None:
        """Point ``current`` at ``version`` atomically; returns the previous target."""
        previous = self.target()
        self.current.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.current.with_name(f".{self.current.name}.switch-{os.getpid()}")
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        os.symlink(version.path, tmp, target_is_directory=True)
        os.replace(tmp, self.current)  # rename(2): atomic on POSIX
        return previous

    def _git(self, *argv: str, what: str, silent_failure: RankscopeError | None = None,
             env: dict[str, str] | None = None) -> str:
        """git's output; ``silent_failure`` is raised when git fails without saying why (a --quiet query).
        ``env``: variables added to the agent's environment for this run."""
        assert self.repo is not None
        try:
            proc = subprocess.run([self.git, "-C", str(self.repo), *argv], shell=False, capture_output=True,
                                  text=True, timeout=_GIT_TIMEOUT_S, check=False,
                                  env={**os.environ, **env} if env else None)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RankscopeError(f"git could not {what}: {exc}",
                                 "check that git is installed and the repository is reachable") from exc
        if proc.returncode != 0 and silent_failure is not None and not (proc.stderr.strip() or proc.stdout.strip()):
            raise silent_failure
        if proc.returncode != 0:
            detail = (proc.stderr.strip() or proc.stdout.strip() or f"exit status {proc.returncode}").splitlines()
            raise RankscopeError(f"git could not {what}: {detail[-1] if detail else ''}",
                                 f"check the ref exists in {self.repo} (git -C {self.repo} log --oneline)")
        return proc.stdout


def _strictly_under(path: Path, roots: tuple[Path, ...]) -> bool:
    return any(path != root and path.is_relative_to(root) for root in roots)


class HotUpdater:
    """Hot-update and rollback of one machine's job code, recorded in the history."""

    def __init__(self, versions: CodeVersions, history: HotUpdateHistory, restart: RestartCallback | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.versions = versions
        self.history = history
        self.restart = restart
        self._clock = clock

    def current_version(self) -> Version | None:
        target = self.versions.target()
        if target is None:
            return None
        recorded = self.history.current()
        if recorded is not None and Path(recorded.path) == target:
            return recorded
        return Version(label=f"dir:{target}", path=str(target))

    def update(self, action_id: str, who: str, args: HotUpdateArgs) -> UpdateRecord:
        """Request an update: applied now if immediate, else recorded as pending."""
        version = self.versions.resolve(args.source, args.version)
        record = self.history.request(action_id, who, UpdateKind.UPDATE, args.mode, args.window_s,
                                      self.current_version(), version)
        if args.mode == UpdateMode.IMMEDIATE:
            return self._apply(record, "immediate", restart=True)
        return record

    def rollback(self, action_id: str, who: str, args: RollbackArgs) -> UpdateRecord:
        """Return to the version before the newest update (or to ``args.to_version``, a path or label)."""
        target = self._rollback_target(args.to_version)
        record = self.history.request(action_id, who, UpdateKind.ROLLBACK, args.mode, 24 * 3600.0,
                                      self.current_version(), target)
        if args.mode == UpdateMode.IMMEDIATE:
            return self._apply(record, "immediate", restart=True)
        return record

    def on_event(self, event: JobEvent) -> UpdateRecord | None:
        """The job restarts or failed: apply a pending lazy update first, without an extra restart.

        The agent calls this in its restart path, before it starts the
        processes again, and then starts them on :meth:`current_version`.
        """
        pending = self.history.pending()
        decision = lazy_update_due(self._clock(), pending, [event])
        if pending is None or not decision.apply:
            return None
        return self._apply(pending, decision.trigger, restart=False)

    def tick(self) -> UpdateRecord | None:
        """Apply a pending update whose window expired (restarting the processes); the agent calls this periodically."""
        pending = self.history.pending()
        decision = lazy_update_due(self._clock(), pending, ())
        if pending is None or not decision.apply:
            return None
        return self._apply(pending, decision.trigger, restart=True)

    def _rollback_target(self, wanted: str) -> Version:
        if wanted:
            found = find_version(self.history.entries(), wanted)
            if found is not None:
                return found
            raise RankscopeError(f"no version {wanted!r} in the hot-update history",
                                 "pick a version listed in the TUI's update history")
        target = self.history.rollback_target()
        if target is None:
            raise RankscopeError("there is no earlier version to roll back to",
                                 "hot-update to the version you want instead")
        if not Path(target.path).is_dir():
            raise RankscopeError(f"the earlier version's tree {target.path} is gone",
                                 "hot-update to that ref again (it will be checked out anew)")
        return target

    def _apply(self, record: UpdateRecord, trigger: str, restart: bool) -> UpdateRecord:
        before = self.current_version()
        try:
            self.versions.switch(record.to_version)
        except (OSError, RankscopeError) as exc:
            message = exc.message if isinstance(exc, RankscopeError) else str(exc)
            self.history.finish(record.id, UpdateState.FAILED, trigger, f"switch failed: {message}")
            raise
        if restart and self.restart is not None:
            try:
                self.restart(record.to_version, trigger)
            except Exception as exc:
                # The code link stays on the new version: some processes may already run it. Rolling back is
                # one key away and recorded; doing it silently here would hide what happened.
                message = exc.message if isinstance(exc, RankscopeError) else f"{type(exc).__name__}: {exc}"
                self.history.finish(record.id, UpdateState.FAILED, trigger,
                                    f"code switched but restart failed: {message}", from_version=before)
                raise
        return self.history.finish(record.id, UpdateState.APPLIED, trigger,
                                   "restarted on the new code" if restart and self.restart else "code switched",
                                   from_version=before)
