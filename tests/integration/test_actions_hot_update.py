"""Hot-update for real: a git repository made in the test, version trees, the atomic link switch, lazy rules, rollback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
from rankscope.actions.agent_protocol import Confirmation
from rankscope.actions.agent_service import ActionService
from rankscope.actions.audit import AuditLog
from rankscope.actions.config import (
    ActionsConfig,
    EvictionSettings,
    HotUpdateSettings,
    load_actions_config,
    local_standbys,
)
from rankscope.actions.history import HotUpdateHistory, UpdateKind, UpdateRecord, UpdateState, Version
from rankscope.actions.hot_update import (
    CodeVersions,
    HotUpdater,
    JobEvent,
    JobEventKind,
    lazy_update_due,
)
from rankscope.actions.model import (
    RESTART_REQUESTED,
    ActionKind,
    ActionRequest,
    ActionResult,
    ActionState,
    EvictArgs,
    HotUpdateArgs,
    RollbackArgs,
    Targets,
    UpdateMode,
    VersionSource,
)
from rankscope.actions.procedures.update import apply_pending
from rankscope.contract.errors import RankscopeError
from rankscope.contract.snapshot import RankInfo


def _git(repo: Path, *argv: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *argv], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """Two commits: tag A writes train.py 'version A', tag B 'version B'."""
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "config", "user.email", "t@example.com")
    _git(repo, "config", "user.name", "t")
    for name in ("A", "B"):
        (repo / "train.py").write_text(f"print('version {name}')\n")
        _git(repo, "add", "train.py")
        _git(repo, "commit", "-q", "-m", f"version {name}")
        _git(repo, "tag", name)
    return repo


class Clock:
    def __init__(self) -> None:
        self.t = 10_000.0

    def __call__(self) -> float:
        return self.t


def _updater(tmp_path: Path, repo: Path, clock: Clock | None = None) -> tuple[HotUpdater, list[tuple[str, str]]]:
    restarts: list[tuple[str, str]] = []
    versions = CodeVersions(current=tmp_path / "job" / "code", versions_dir=tmp_path / "versions", repo=repo)
    history = HotUpdateHistory(tmp_path / "state" / "history.db", clock=clock or Clock())
    return HotUpdater(versions, history, restart=lambda v, why: restarts.append((v.label, why)),
                      clock=clock or Clock()), restarts


def test_switch_to_b_then_roll_back_to_a(tmp_path: Path, repo: Path) -> None:
    up, restarts = _updater(tmp_path, repo)
    code = tmp_path / "job" / "code"
    a = up.update("u-a", "alice", HotUpdateArgs(VersionSource.GIT, "A"))
    assert (code / "train.py").read_text() == "print('version A')\n"
    b = up.update("u-b", "alice", HotUpdateArgs(VersionSource.GIT, "B"))
    assert code.is_symlink()
    assert Path(code.resolve()) == Path(b.to_version.path).resolve()
    assert (code / "train.py").read_text() == "print('version B')\n"
    assert Path(b.to_version.path).name == _git(repo, "rev-parse", "B")
    assert b.state == UpdateState.APPLIED and b.from_version == a.to_version and b.who == "alice"
    assert b.to_version.label.startswith("git:B (")
    assert restarts == [(a.to_version.label, "immediate"), (b.to_version.label, "immediate")]

    rb = up.rollback("r-1", "bob", RollbackArgs())
    assert rb.kind == UpdateKind.ROLLBACK and rb.state == UpdateState.APPLIED
    assert rb.to_version == a.to_version and rb.from_version == b.to_version
    assert (code / "train.py").read_text() == "print('version A')\n"
    history = HotUpdateHistory(tmp_path / "state" / "history.db")  # persisted
    assert [(e.action_id, e.who, e.state) for e in history.entries()] == [
        ("r-1", "bob", UpdateState.APPLIED), ("u-b", "alice", UpdateState.APPLIED),
        ("u-a", "alice", UpdateState.APPLIED)]


def test_a_version_is_checked_out_once_and_reused(tmp_path: Path, repo: Path) -> None:
    up, _ = _updater(tmp_path, repo)
    first = up.versions.checkout("A")
    (Path(first.path) / "marker").write_text("kept")
    again = up.versions.checkout(_git(repo, "rev-parse", "A"))
    assert again.path == first.path and (Path(again.path) / "marker").exists()
    shutil.rmtree(first.path)  # someone cleaned the versions directory by hand
    fresh = up.versions.checkout("A")
    assert fresh.path == first.path and (Path(fresh.path) / "train.py").read_text() == "print('version A')\n"


def test_lazy_update_waits_for_a_failure_then_applies_without_an_extra_restart(tmp_path: Path, repo: Path) -> None:
    clock = Clock()
    up, restarts = _updater(tmp_path, repo, clock)
    up.update("u-a", "alice", HotUpdateArgs(VersionSource.GIT, "A"))
    code = tmp_path / "job" / "code"
    pending = up.update("u-b", "alice", HotUpdateArgs(VersionSource.GIT, "B", UpdateMode.LAZY))
    assert pending.state == UpdateState.PENDING
    assert (code / "train.py").read_text() == "print('version A')\n"  # nothing switched yet
    clock.t += 3600
    assert up.tick() is None  # window not expired
    applied = up.on_event(JobEvent(JobEventKind.FAILURE, clock.t))
    assert applied is not None and applied.state == UpdateState.APPLIED and applied.trigger == "failure"
    assert (code / "train.py").read_text() == "print('version B')\n"
    assert len(restarts) == 1  # the failure path restarts the job itself; only the first, immediate update restarted
    assert up.history.pending() is None


def test_lazy_update_applies_when_its_window_expires(tmp_path: Path, repo: Path) -> None:
    clock = Clock()
    up, restarts = _updater(tmp_path, repo, clock)
    up.update("u-b", "alice", HotUpdateArgs(VersionSource.GIT, "B", UpdateMode.LAZY, window_s=7200))
    clock.t += 7199
    assert up.tick() is None
    clock.t += 1
    applied = up.tick()
    assert applied is not None and applied.trigger == "window"
    assert restarts == [(applied.to_version.label, "window")]


def test_a_bad_ref_fails_at_request_time_and_switches_nothing(tmp_path: Path, repo: Path) -> None:
    up, restarts = _updater(tmp_path, repo)
    up.update("u-a", "alice", HotUpdateArgs(VersionSource.GIT, "A"))
    with pytest.raises(RankscopeError, match="no git ref 'no-such-branch' in ") as err:
        up.update("u-x", "alice", HotUpdateArgs(VersionSource.GIT, "no-such-branch", UpdateMode.LAZY))
    assert "git -C" in err.value.fix
    assert up.history.pending() is None and len(restarts) == 1


def test_prepared_directory_and_failed_restart_is_recorded(tmp_path: Path, repo: Path) -> None:
    prepared = tmp_path / "exp7"
    prepared.mkdir()
    (prepared / "train.py").write_text("print('exp7')\n")
    versions = CodeVersions(tmp_path / "job" / "code", tmp_path / "versions", prepared_roots=(tmp_path,))

    def restart(version: Version, why: str) -> None:
        raise RankscopeError("rank 3 did not come back", "look at machine m1")

    up = HotUpdater(versions, HotUpdateHistory(tmp_path / "h.db"), restart=restart)
    with pytest.raises(RankscopeError, match="rank 3"):
        up.update("u-1", "alice", HotUpdateArgs(VersionSource.DIR, str(prepared)))
    record = up.history.entries()[0]
    assert record.state == UpdateState.FAILED and "restart failed: rank 3" in record.message
    assert (tmp_path / "job" / "code" / "train.py").read_text() == "print('exp7')\n"
    with pytest.raises(RankscopeError, match="no code repository"):
        up.update("u-2", "alice", HotUpdateArgs(VersionSource.GIT, "A"))
    with pytest.raises(RankscopeError, match="does not exist"):
        up.update("u-3", "alice", HotUpdateArgs(VersionSource.DIR, str(tmp_path / "missing")))


def test_a_real_code_directory_is_refused_with_the_fix(tmp_path: Path, repo: Path) -> None:
    (tmp_path / "job" / "code").mkdir(parents=True)
    up, _ = _updater(tmp_path, repo)
    with pytest.raises(RankscopeError, match="real directory") as err:
        up.update("u-a", "alice", HotUpdateArgs(VersionSource.GIT, "A"))
    assert "symbolic link" in err.value.fix


def test_nothing_to_roll_back_to(tmp_path: Path, repo: Path) -> None:
    up, _ = _updater(tmp_path, repo)
    with pytest.raises(RankscopeError, match="no earlier version"):
        up.rollback("r", "bob", RollbackArgs())


def _pending(mode: UpdateMode = UpdateMode.LAZY, at: float = 100.0, window: float = 50.0) -> UpdateRecord:
    return UpdateRecord(1, "u", "a", at, UpdateKind.UPDATE, mode, window, None, Version("x", "/x"),
                        UpdateState.PENDING)


def test_lazy_decision_is_a_pure_function_of_now_pending_and_events() -> None:
    p = _pending()
    assert not lazy_update_due(120.0, p, []).apply
    assert not lazy_update_due(120.0, p, [JobEvent(JobEventKind.RESTART, 99.0)]).apply  # before the request
    d = lazy_update_due(120.0, p, [JobEvent(JobEventKind.FAILURE, 110.0), JobEvent(JobEventKind.RESTART, 105.0)])
    assert (d.apply, d.trigger) == (True, "restart")  # the first event after the request
    d = lazy_update_due(150.0, p, [])
    assert (d.apply, d.trigger) == (True, "window")
    assert not lazy_update_due(150.0, None, []).apply
    assert lazy_update_due(0.0, _pending(UpdateMode.IMMEDIATE), []).trigger == "immediate"


# ---- the agent's side: the window, a failure, the launcher's restart, the eviction plan's standbys ----------


def _service(tmp_path: Path, repo: Path, clock: Clock, ranks: list[RankInfo],
             eviction: EvictionSettings | None = None) -> ActionService:
    """An agent's action service on machine m0 whose code link starts at tag A (no processes, no gRPC)."""
    config = ActionsConfig(tmp_path / "state", eviction=eviction or EvictionSettings(),
                           hot_update=HotUpdateSettings(tmp_path / "job" / "code", tmp_path / "versions", repo))
    versions = CodeVersions(tmp_path / "job" / "code", tmp_path / "versions", repo)
    versions.switch(versions.checkout("A"))
    return ActionService(config, "m0", lambda: tuple(ranks), clock=clock)


async def _run(service: ActionService, request: ActionRequest) -> ActionResult:
    events = [e async for e in service.run(request, Confirmation((service.machine,)))]
    result = events[-1]
    assert isinstance(result, ActionResult)
    return result


def _lazy(action_id: str, ref: str, window_s: float = 3600.0) -> ActionRequest:
    return ActionRequest(action_id, ActionKind.HOT_UPDATE, Targets(),
                         HotUpdateArgs(VersionSource.GIT, ref, UpdateMode.LAZY, window_s), "alice")


def _code(tmp_path: Path) -> str:
    return (tmp_path / "job" / "code" / "train.py").read_text()


async def test_the_agent_applies_a_lazy_update_when_its_window_expires_and_requests_a_restart(
        tmp_path: Path, repo: Path) -> None:
    clock = Clock()
    service = _service(tmp_path, repo, clock, [RankInfo(0, 0, 1, pid=111)])
    result = await _run(service, _lazy("hu-1", "B", window_s=3600))
    assert result.state == ActionState.SUCCEEDED and "pending on m0" in result.message
    assert await service.supervise_once() is None  # not due: nothing switched
    assert _code(tmp_path) == "print('version A')\n"
    clock.t += 3599
    assert await service.supervise_once() is None
    clock.t += 1
    applied = await service.supervise_once()
    assert applied is not None and applied.trigger == "window" and applied.state == UpdateState.APPLIED
    assert _code(tmp_path) == "print('version B')\n"
    # The audit stream says so under a derived id, with the restart request the drill's recovery acts on.
    (final,) = [r for r in service.audit.records() if r.action_id == "hu-1.window" and r.result == "succeeded"]
    assert final.kind == ActionKind.HOT_UPDATE and RESTART_REQUESTED in final.message and final.who.startswith("alice")
    assert await service.supervise_once() is None  # applied once


async def test_the_agent_applies_a_lazy_update_when_its_ranks_die_without_requesting_a_restart(
        tmp_path: Path, repo: Path) -> None:
    clock = Clock()
    ranks = [RankInfo(0, 0, 2, pid=111), RankInfo(1, 1, 2, pid=112)]
    service = _service(tmp_path, repo, clock, ranks)
    assert (await _run(service, _lazy("hu-2", "B"))).state == ActionState.SUCCEEDED
    assert await service.supervise_once() is None  # first look: the ranks are alive
    assert await service.supervise_once() is None  # still alive
    ranks.pop()  # rank 1 died
    applied = await service.supervise_once()
    assert applied is not None and applied.trigger == "failure"
    assert _code(tmp_path) == "print('version B')\n"
    (final,) = [r for r in service.audit.records() if r.action_id == "hu-2.failure" and r.result == "succeeded"]
    assert "ranks ended" in final.message and RESTART_REQUESTED not in final.message


async def test_the_launcher_restart_path_applies_the_pending_update_before_the_ranks_start(
        tmp_path: Path, repo: Path) -> None:
    clock = Clock()
    service = _service(tmp_path, repo, clock, [])
    assert (await _run(service, _lazy("hu-3", "B"))).state == ActionState.SUCCEEDED
    clock.t += 10
    applied = apply_pending(service.config, "m0", JobEvent(JobEventKind.RESTART, clock.t), clock)
    assert applied is not None and applied.trigger == "restart" and applied.who == "alice"
    assert _code(tmp_path) == "print('version B')\n"
    assert apply_pending(service.config, "m0", JobEvent(JobEventKind.RESTART, clock.t), clock) is None
    records = [(r.action_id, r.result) for r in AuditLog(service.config.audit_path).records()
               if r.action_id.startswith("hu-3")]
    assert records[-2:] == [("hu-3.restart", "started"), ("hu-3.restart", "succeeded")]
    history = HotUpdateHistory(service.config.history_path).entries()
    assert [(e.action_id, e.state, e.trigger) for e in history] == [("hu-3", UpdateState.APPLIED, "restart")]
    # A rollback requested lazily rides on the next restart the same way.
    back = ActionRequest("rb-1", ActionKind.ROLLBACK, Targets(), RollbackArgs(mode=UpdateMode.LAZY), "bob")
    assert (await _run(service, back)).state == ActionState.SUCCEEDED
    assert _code(tmp_path) == "print('version B')\n"
    clock.t += 10
    rolled = apply_pending(service.config, "m0", JobEvent(JobEventKind.RESTART, clock.t), clock)
    assert rolled is not None and rolled.kind == UpdateKind.ROLLBACK and rolled.trigger == "restart"
    assert _code(tmp_path) == "print('version A')\n"


async def test_a_local_eviction_plan_lists_the_warm_standbys_minus_blocked_ones(tmp_path: Path, repo: Path) -> None:
    eviction = EvictionSettings("local", options={"standbys": ("spare-0", "spare-1", "spare-2")})
    service = _service(tmp_path, repo, Clock(), [RankInfo(0, 0, 1, pid=os.getpid())], eviction)
    service.blocklist.block(("spare-1",), "failed its check last week", "carol", "old-evict")
    plan = await service.plan(ActionRequest("ev-1", ActionKind.EVICT, Targets(("m0",)), EvictArgs("hang"), "alice"))
    assert plan.standbys == ("spare-0", "spare-2")
    assert any("spare-0 spare-2" in step and "self-checks first" in step for step in plan.steps), plan.steps
    # Without standbys configured the plan says the restart is the launcher's, and lists none.
    bare = _service(tmp_path / "bare", repo, Clock(), [], EvictionSettings("local"))
    plan = await bare.plan(ActionRequest("ev-2", ActionKind.EVICT, Targets(("m0",)), EvictArgs("hang"), "alice"))
    assert plan.standbys == () and "left to the launcher" in plan.steps[-1]


def test_the_local_standbys_setting_is_checked_at_start_up(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    path.write_text(json.dumps({"eviction": {"backend": "local", "local": {"standbys": ["spare-0", "spare-1"]}}}))
    config = load_actions_config(path, tmp_path / "st")
    assert config is not None and local_standbys(config.eviction) == ("spare-0", "spare-1")
    # A list the launcher keeps current is read at each call; a broken one is an error naming the format.
    pool = tmp_path / "standbys.json"
    path.write_text(json.dumps({"eviction": {"backend": "local", "local": {"standbys_file": str(pool)}}}))
    config = load_actions_config(path, tmp_path / "st")
    assert config is not None and local_standbys(config.eviction) == ()  # not written yet: none on hand
    pool.write_text('["spare-3"]')
    assert local_standbys(config.eviction) == ("spare-3",)
    pool.write_text("spare-3")
    with pytest.raises(RankscopeError, match="cannot read the standby list"):
        local_standbys(config.eviction)
    for local, needle in (({"standbys": "spare-0"}, "must be a list of machine names"),
                          ({"standbys": ["-rf"]}, "bad machine name"),
                          ({"standbys_file": "standbys.json"}, "must be an absolute path"),
                          ({"spares": []}, r"unknown setting\(s\) spares")):
        path.write_text(json.dumps({"eviction": {"backend": "local", "local": local}}))
        with pytest.raises(RankscopeError, match=needle) as err:
            load_actions_config(path, tmp_path / "st")
        assert err.value.fix


async def test_the_plan_names_the_commit_and_refuses_a_ref_that_does_not_exist(tmp_path: Path, repo: Path) -> None:
    service = _service(tmp_path, repo, Clock(), [RankInfo(0, 0, 1, pid=os.getpid())])
    commit = CodeVersions(tmp_path / "job" / "code", tmp_path / "versions", repo).commit_of("B")
    plan = await service.plan(ActionRequest("hu-1", ActionKind.HOT_UPDATE, Targets(),
                                            HotUpdateArgs(VersionSource.GIT, "B"), "alice"))
    assert any(f"git ref B (commit {commit[:12]})" in step for step in plan.steps), plan.steps
    # A typo is refused in the plan, before anyone confirms, and nothing is recorded or switched.
    with pytest.raises(RankscopeError, match="no git ref 'Bx' in ") as err:
        await service.plan(ActionRequest("hu-2", ActionKind.HOT_UPDATE, Targets(),
                                         HotUpdateArgs(VersionSource.GIT, "Bx"), "alice"))
    assert f"git -C {repo} tag" in err.value.fix
    assert _code(tmp_path) == "print('version A')\n" and service.history.entries() == ()


def test_machines_sharing_one_repository_check_out_at_once_without_losing_one(tmp_path: Path, repo: Path) -> None:
    """The drill's machines share one code repository: a hot-update checks a version out on all of them at once.

    Checkouts were git worktrees: run side by side, one agent's prune removed the registration another was
    writing ("fatal: could not open '.git/worktrees/...'"), and without the prune concurrent adds still broke
    each other's; a machine stayed on the old code. Now each checkout only reads the repository.
    """
    machines = 8

    def checkout_everywhere(ref: str, versions_root: Path) -> dict[int, str]:
        """Every machine checks ``ref`` out at once; machine -> its train.py, or the error it got."""
        start = threading.Barrier(machines)
        got: dict[int, str] = {}

        def checkout(m: int) -> None:
            versions = CodeVersions(current=tmp_path / f"m{m}" / "code", versions_dir=versions_root / f"m{m}",
                                    repo=repo)
            start.wait(timeout=60)
            try:
                got[m] = (Path(versions.checkout(ref).path) / "train.py").read_text()
            except RankscopeError as exc:
                got[m] = str(exc)

        threads = [threading.Thread(target=checkout, args=(m,)) for m in range(machines)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return got

    for round_no, ref in enumerate(("A", "B", "A")):  # the race hit 3 runs in 5 within these three rounds
        got = checkout_everywhere(ref, tmp_path / f"round{round_no}")
        assert got == {m: f"print('version {ref}')\n" for m in range(machines)}, got


def _repository_state(repo: Path) -> dict[str, tuple[int, int]]:
    """Every file and directory under the repository's .git: (size, modification time in ns)."""
    return {str(p.relative_to(repo)): (p.stat().st_size, p.stat().st_mtime_ns) for p in (repo / ".git").rglob("*")}


def test_a_checkout_only_reads_the_shared_repository(tmp_path: Path, repo: Path) -> None:
    """Every machine of a job checks the version out at once from one repository: a checkout that wrote into it
    (a worktree's registration) had to take turns with the others under a lock (0.25 s of a four-machine
    hot-update), and concurrent registrations broke each other's."""
    before = _repository_state(repo)
    trees = [Path(CodeVersions(current=tmp_path / f"m{m}" / "code", versions_dir=tmp_path / f"m{m}" / "versions",
                               repo=repo).checkout(ref).path) for m, ref in ((1, "A"), (2, "B"), (3, "B"))]
    assert _repository_state(repo) == before
    assert [(t / "train.py").read_text() for t in trees] == [f"print('version {r}')\n" for r in "ABB"]
    assert [t.name for t in trees] == [_git(repo, "rev-parse", r) for r in "ABB"]
    assert all(sorted(p.name for p in t.parent.iterdir()) == [t.name] for t in trees)  # nothing partial left


def test_a_failed_checkout_leaves_no_version_behind(tmp_path: Path, repo: Path) -> None:
    """A version's tree appears under its commit's name complete or not at all: a checkout that fails half way
    (here git writes a file, then fails) leaves nothing a later update would take for the version."""
    git = tmp_path / "flaky-git"
    git.write_text("#!/bin/sh\n"
                   'case "$*" in *read-tree*) for a; do case "$a" in --work-tree=*) '
                   'echo half > "${a#--work-tree=}/train.py";; esac; done; echo "fatal: disk full" >&2; exit 128;; '
                   'esac\nexec git "$@"\n')
    git.chmod(0o755)
    versions = CodeVersions(current=tmp_path / "code", versions_dir=tmp_path / "versions", repo=repo, git=str(git))
    with pytest.raises(RankscopeError, match=r"git could not check out .*: fatal: disk full"):
        versions.checkout("B")
    assert list((tmp_path / "versions").iterdir()) == []
    good = CodeVersions(current=tmp_path / "code", versions_dir=tmp_path / "versions", repo=repo)
    assert (Path(good.checkout("B").path) / "train.py").read_text() == "print('version B')\n"
