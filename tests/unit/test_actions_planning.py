"""The one planner (rankscope.actions.planning), as the agent's service calls it: facts in, exact plan or refusal out.

The service gathers the facts (ranks, blocklist, standby pool, the backend's
argv, the code link, the history) and these functions decide; the service's
own gathering is tested through real agents in test_actions_agent.py and
test_actions_hot_update.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from rankscope.actions.evict_backends import SlurmBackend
from rankscope.actions.history import UpdateKind, UpdateRecord, UpdateState, Version
from rankscope.actions.model import (
    ActionKind,
    ActionRequest,
    BackupArgs,
    ConfirmationRule,
    EvictArgs,
    HotUpdateArgs,
    ProcessRef,
    RollbackArgs,
    Targets,
    UpdateMode,
    VersionSource,
)
from rankscope.actions.planning import (
    CodeLink,
    StandbyPool,
    check_job,
    plan_backend_eviction,
    plan_backup,
    plan_hot_update,
    plan_local_eviction,
    plan_rollback,
    processes_of,
)
from rankscope.contract.errors import RankscopeError
from rankscope.contract.snapshot import Layout, ProcessInfo, ProcessRole, RankInfo

# machine-4 of a 16-rank job (TP 2, PP 4, DP 2), two ranks per machine; rank 8 started a data-loader worker.
WORKER = ProcessInfo(pid=2008, ppid=1008, role=ProcessRole.DATALOADER, name="pt_data_worker")
RANKS = (RankInfo(8, 0, 16, pid=1008, run_id="job-1", subprocesses=(WORKER,)), RankInfo(9, 1, 16, pid=1009,
                                                                                          run_id="job-1"))
CODE = CodeLink("/srv/job/code", "/srv/job/versions/aaa", "/srv/job/versions", "/srv/job/repo")


def evict(targets: Targets | None = None) -> ActionRequest:
    return ActionRequest("ev-1", ActionKind.EVICT, targets or Targets(("machine-4",)),
                         EvictArgs("PP group 2 hung in irecv"), "alice")


def test_the_processes_are_every_rank_and_its_workers() -> None:
    assert processes_of("machine-4", RANKS) == (ProcessRef("machine-4", 1008, 8), ProcessRef("machine-4", 2008, 8),
                                                ProcessRef("machine-4", 1009, 9))


def test_the_agent_refuses_other_machines_unseen_ranks_and_other_jobs() -> None:
    check_job(evict(), "machine-4", RANKS)  # its own machine and ranks: no refusal
    with pytest.raises(RankscopeError, match=r"refused: machine-5 is not this agent's machine \(machine-4\)") as err:
        check_job(evict(Targets(("machine-4", "machine-5"))), "machine-4", RANKS)
    assert "that machine's agent" in err.value.fix
    backup = ActionRequest("b-1", ActionKind.BACKUP, Targets(ranks=(9, 10, 3)), BackupArgs(), "alice")
    with pytest.raises(RankscopeError, match=r"rank\(s\) 3 10 do not run on machine-4 \(its ranks: 8 9\)"):
        check_job(backup, "machine-4", RANKS)
    other_job = ActionRequest("b-2", ActionKind.BACKUP, Targets(), BackupArgs(), "alice", job_id="job-2")
    with pytest.raises(RankscopeError, match="job job-2 does not run on machine-4 \\(it runs job-1\\)"):
        check_job(other_job, "machine-4", RANKS)


def test_a_local_eviction_stops_every_process_names_the_phrase_and_the_unblocked_standbys_in_order() -> None:
    pool = StandbyPool(True, ("spare-0", "machine-4", "spare-1", "spare-2"), frozenset({"spare-1"}))
    planned = plan_local_eviction(evict(), "machine-4", RANKS, 10.0, pool)
    plan = planned.plan
    assert plan.machines == ("machine-4",) and [p.pid for p in plan.processes] == [1008, 2008, 1009]
    assert plan.standbys == ("spare-0", "spare-2")  # blocked spare-1 and the evicted machine itself are left out
    assert plan.typed_confirmation and plan.confirm_phrase == "evict machine-4"
    assert not ConfirmationRule.of(plan).accepts(True) and ConfirmationRule.of(plan).accepts(" evict  machine-4 ")
    assert plan.steps == ("SIGTERM 3 process(es) of ranks 8 9 on machine-4",
                          "SIGKILL any still running after 10 s",
                          "block machine-4 (reason: PP group 2 hung in irecv) so no restart brings it back",
                          "the launcher restarts the job without this machine, with warm standby(s) spare-0 spare-2 "
                          "joining in this order, one per evicted machine; each standby self-checks first and one "
                          "that fails is skipped")
    assert plan.warnings == () and planned.ranks == RANKS and planned.total == 3


def test_a_local_eviction_warns_when_it_takes_more_than_named_or_no_standby_is_left() -> None:
    named = evict(Targets(("machine-4",), (9,)))
    plan = plan_local_eviction(named, "machine-4", RANKS, 2.5,
                               StandbyPool(True, ("spare-0",), frozenset({"spare-0", "machine-7"}))).plan
    assert plan.standbys == ()
    assert plan.warnings == ("eviction takes the whole machine machine-4: all its ranks (8 9) stop, not only the "
                             "ones named", "no warm standby left to replace machine-4 (blocked: spare-0)")
    assert plan.steps[1] == "SIGKILL any still running after 2.5 s"
    assert plan.steps[3] == "the launcher has no unblocked warm standby: the job cannot restart at its size"
    unread = plan_local_eviction(evict(), "machine-4", (), 10.0,
                                 StandbyPool(True, problem="cannot read the standby list /run/s.json: bad JSON")).plan
    assert unread.processes == () and unread.summary == "evict machine-4: stop ranks none and block it"
    assert unread.warnings[:2] == ("no ranks found on machine-4: nothing to stop, the machine is only blocked",
                                   "standbys unknown: cannot read the standby list /run/s.json: bad JSON")
    bare = plan_local_eviction(evict(), "machine-4", RANKS, 10.0, StandbyPool(False)).plan
    assert bare.steps[3] == "restarting the job without this machine is left to the launcher (torchrun, the drill)"
    assert bare.warnings == ()


def test_a_backend_eviction_shows_the_backends_exact_argv_and_then_blocks_the_machine() -> None:
    backend = SlurmBackend(job_id="77", restart="step", step_id="0", scontrol="/usr/bin/scontrol",
                           scancel="/usr/bin/scancel")
    evicted = backend.plan(("machine-4",), "PP group 2 hung in irecv")
    planned = plan_backend_eviction(evict(Targets(("machine-4",), (8,))), "machine-4", RANKS, "slurm", evicted)
    plan = planned.plan
    assert plan.commands == (("/usr/bin/scontrol", "update", "nodename=machine-4", "state=drain",
                              "reason=PP group 2 hung in irecv"), ("/usr/bin/scancel", "77.0"))
    assert plan.machines == ("machine-4",) and plan.confirm_phrase == "evict machine-4" and plan.typed_confirmation
    assert plan.summary == "evict machine-4 via slurm (ranks 8 9)" and [p.rank for p in plan.processes] == [8, 8, 9]
    assert plan.steps == (*evicted.steps,
                          "block machine-4 (reason: PP group 2 hung in irecv) so no restart brings it back")
    assert plan.warnings[0].startswith("eviction takes the whole machine machine-4: all its ranks (8 9) stop")
    assert planned.total == 2
    # A backend that takes more machines than this one: the phrase and the confirmation must name them all.
    wider = replace(evicted, machines=("machine-4", "machine-5"))
    both = plan_backend_eviction(evict(), "machine-4", RANKS, "slurm", wider).plan
    assert both.machines == ("machine-4", "machine-5") and both.confirm_phrase == "evict machine-4 machine-5"
    assert not ConfirmationRule.of(both).accepts("evict machine-4")


def test_a_git_hot_update_names_the_commit_repo_and_link_and_requests_a_restart() -> None:
    request = ActionRequest("hu-1", ActionKind.HOT_UPDATE, Targets(),
                            HotUpdateArgs(VersionSource.GIT, "v2"), "alice")
    planned = plan_hot_update(request, "machine-4", RANKS, CODE, "3f2c1ab0d4e5f60718293a4b5c6d7e8f90a1b2c3")
    plan = planned.plan
    assert plan.summary == "hot-update machine-4 to git:v2 (immediate)" and plan.machines == ("machine-4",)
    assert plan.steps == (
        "check out git ref v2 (commit 3f2c1ab0d4e5) of /srv/job/repo under /srv/job/versions",
        "point /srv/job/code (now /srv/job/versions/aaa) at git:v2 now",
        "request a restart of ranks 8 9: the launcher restarts them on the new code (the agent does not stop them)")
    assert not plan.typed_confirmation and ConfirmationRule.of(plan).accepts(True) and not ConfirmationRule.of(plan).accepts("y")


def test_a_lazy_directory_update_waits_for_its_window() -> None:
    request = ActionRequest("hu-2", ActionKind.HOT_UPDATE, Targets(),
                            HotUpdateArgs(VersionSource.DIR, "/shared/exp-7", UpdateMode.LAZY, 6 * 3600.0), "alice")
    plan = plan_hot_update(request, "machine-4", RANKS, CodeLink("/srv/job/code", None, "/srv/job/versions")).plan
    assert plan.summary == "hot-update machine-4 to dir:/shared/exp-7 (lazy)"
    assert plan.steps == ("use the prepared directory /shared/exp-7",
                          "point /srv/job/code (now unset) at dir:/shared/exp-7 when the update is applied",
                          "record it as pending: applied at the next restart or failure, at the latest in 6 h")


def test_a_hot_update_is_refused_without_its_config_or_repository_and_as_another_kind() -> None:
    git = ActionRequest("hu-3", ActionKind.HOT_UPDATE, Targets(), HotUpdateArgs(VersionSource.GIT, "v2"), "alice")
    with pytest.raises(RankscopeError, match="refused: the agent on machine-4 has no hot-update configured") as err:
        plan_hot_update(git, "machine-4", RANKS, None)
    assert "[hot_update]" in err.value.fix
    no_repo = CodeLink("/srv/job/code", None, "/srv/job/versions", repo=None)
    with pytest.raises(RankscopeError, match="no code repository configured") as err:
        plan_hot_update(git, "machine-4", RANKS, no_repo, "3f2c1ab0d4e5")
    assert "prepared directory" in err.value.fix
    with pytest.raises(RankscopeError, match="cannot be planned as hot_update"):
        plan_hot_update(evict(), "machine-4", RANKS, CODE)


def _applied(n: int, frm: Version | None, to: Version, kind: UpdateKind = UpdateKind.UPDATE) -> UpdateRecord:
    return UpdateRecord(n, f"hu-{n}", "alice", float(n), kind, UpdateMode.IMMEDIATE, 3600.0, frm, to,
                        UpdateState.APPLIED)


def test_a_rollback_goes_to_the_named_version_or_the_previous_one_and_refuses_what_the_history_lacks() -> None:
    a, b = Version("git:v1 (aaa)", "/srv/job/versions/aaa"), Version("git:v2 (bbb)", "/srv/job/versions/bbb")
    history = (_applied(2, a, b), _applied(1, None, a))  # newest first, as HotUpdateHistory.entries gives them
    back = ActionRequest("rb-1", ActionKind.ROLLBACK, Targets(), RollbackArgs(), "alice")
    plan = plan_rollback(back, "machine-4", RANKS, CODE, history, previous=a).plan
    assert plan.summary == "roll back machine-4 to git:v1 (aaa) (immediate)" and plan.steps[0].endswith("(aaa) now")
    named = ActionRequest("rb-2", ActionKind.ROLLBACK, Targets(),
                          RollbackArgs(to_version="/srv/job/versions/bbb", mode=UpdateMode.LAZY), "alice")
    lazy = plan_rollback(named, "machine-4", RANKS, CODE, history, previous=a).plan
    assert lazy.summary == "roll back machine-4 to git:v2 (bbb) (lazy)" and lazy.steps[1].endswith("in 24 h")
    unknown = ActionRequest("rb-3", ActionKind.ROLLBACK, Targets(), RollbackArgs(to_version="v9"), "alice")
    with pytest.raises(RankscopeError, match="refused: no version 'v9' in the hot-update history of machine-4"):
        plan_rollback(unknown, "machine-4", RANKS, CODE, history, previous=a)
    with pytest.raises(RankscopeError, match="refused: machine-4 has no earlier version to roll back to"):
        plan_rollback(back, "machine-4", RANKS, CODE, (), previous=None)
    with pytest.raises(RankscopeError, match="no hot-update configured"):
        plan_rollback(back, "machine-4", RANKS, None)


def test_a_backup_plan_lists_the_fig9_peers_of_this_machines_ranks() -> None:
    layout = Layout(tp=2, pp=4, dp=2, ranks_per_machine=2)
    request = ActionRequest("b-1", ActionKind.BACKUP, Targets(), BackupArgs(), "alice")
    planned = plan_backup(request, "machine-4", RANKS, layout, "/var/lib/rankscope/backup.request", 60.0)
    plan = planned.plan
    assert plan.backup_peers == ((8, 2), (9, 3)) and plan.machines == ("machine-4",) and plan.warnings == ()
    assert plan.summary == "back up the checkpoints of ranks 8 9 to their peers"
    assert plan.steps[0] == "write the backup request /var/lib/rankscope/backup.request"
    assert plan.steps[2] == "wait up to 60 s for a new shard of every rank here and verify its checksum"
    one = ActionRequest("b-2", ActionKind.BACKUP, Targets(ranks=(9,)), BackupArgs(), "alice")
    assert plan_backup(one, "machine-4", RANKS, layout, "/r", 60.0).plan.backup_peers == ((9, 3),)


def test_a_backup_plan_without_a_layout_or_ranks_says_what_it_cannot_show() -> None:
    request = ActionRequest("b-3", ActionKind.BACKUP, Targets(), BackupArgs(), "alice")
    plan = plan_backup(request, "machine-4", (), None, "/r", 60.0).plan
    assert plan.backup_peers == () and plan.summary == "back up the checkpoints of ranks none to their peers"
    assert plan.warnings == ("no ranks found on machine-4: nothing to back up here",
                             "no [layout] in the agent's --actions-config: backup peers not shown (the ranks know "
                             "theirs from RANKSCOPE_BACKUP_TARGETS)")
    bad = plan_backup(request, "machine-4", RANKS, Layout(tp=3, pp=4, dp=2), "/r", 60.0).plan
    assert bad.backup_peers == () and bad.warnings[0].startswith("backup peers unknown: ")
