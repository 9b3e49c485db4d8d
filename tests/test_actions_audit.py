"""Audit log, idempotency by action id, blocklist and hot-update history: persisted in SQLite across reopenings."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest
from rankscope.actions.audit import AuditLog
from rankscope.actions.blocklist import Blocklist
from rankscope.actions.history import HotUpdateHistory, UpdateKind, UpdateState, Version
from rankscope.actions.model import (
    ActionKind,
    ActionRequest,
    ActionResult,
    ActionState,
    EvictArgs,
    Targets,
    UpdateMode,
)
from rankscope.errors import RankscopeError


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def _evict(action_id: str = "a-1", reason: str = "PP group 3 hangs") -> ActionRequest:
    return ActionRequest(action_id, ActionKind.EVICT, Targets(("m12", "m13")), EvictArgs(reason), "alice")


def test_a_repeated_action_id_returns_the_recorded_result_without_acting_twice(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.db", clock=Clock())
    calls: list[str] = []

    def act() -> ActionResult:
        calls.append("acted")
        return ActionResult("a-1", ActionKind.EVICT, ActionState.SUCCEEDED, "evicted m12 m13")

    first = log.run_once(_evict(), "evict m12 m13", act, machines=("m12", "m13"))
    again = AuditLog(tmp_path / "audit.db").run_once(_evict(), "evict m12 m13", act)  # after an agent restart
    assert calls == ["acted"]
    assert first.ok and not first.replayed and first.started is not None and first.finished is not None
    assert again.replayed and again.state == ActionState.SUCCEEDED and again.message == "evicted m12 m13"
    records = log.records()
    assert [(r.seq, r.action_id, r.who, r.result) for r in records] == [(1, "a-1", "alice", "started"),
                                                                        (2, "a-1", "alice", "succeeded")]
    assert records[0].machines == ("m12", "m13") and records[0].what == "evict m12 m13"
    assert records[0].when < records[1].when
    assert log.records(after_seq=1) == records[1:]


def test_reusing_an_id_for_another_request_is_an_error(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.db")
    log.run_once(_evict(), "evict", lambda: ActionResult("a-1", ActionKind.EVICT, ActionState.SUCCEEDED, "ok"))
    with pytest.raises(RankscopeError, match="already used for a different request"):
        log.run_once(_evict(reason="something else"), "evict",
                     lambda: ActionResult("a-1", ActionKind.EVICT, ActionState.SUCCEEDED, "ok"))


def test_a_failing_action_is_recorded_and_its_error_raised(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.db")

    def act() -> ActionResult:
        raise RankscopeError("scontrol failed: Invalid node name", "check the node names")

    with pytest.raises(RankscopeError, match="Invalid node name"):
        log.run_once(_evict(), "evict m12 m13", act)
    recorded = log.result_of("a-1")
    assert recorded is not None and recorded.state == ActionState.FAILED
    assert "Invalid node name" in recorded.message
    assert [r.result for r in log.records()] == ["started", "failed"]
    assert log.interrupted() == ()


def test_concurrent_requests_with_one_id_act_once(tmp_path: Path) -> None:
    path = tmp_path / "audit.db"
    AuditLog(path)
    acted: list[int] = []
    gate = threading.Event()
    results: list[ActionResult] = []

    def worker(i: int) -> None:
        def act() -> ActionResult:
            acted.append(i)
            gate.wait(5.0)
            return ActionResult("a-1", ActionKind.EVICT, ActionState.SUCCEEDED, "ok")
        results.append(AuditLog(path).run_once(_evict(), "evict", act))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    deadline = threading.Event()
    for _ in range(500):  # poll the real condition: three of four saw the claim and returned
        if len(results) >= 3:
            break
        deadline.wait(0.01)
    gate.set()
    for t in threads:
        t.join(10.0)
    assert len(acted) == 1
    assert sorted(r.state for r in results).count(ActionState.RUNNING) == 3


def test_an_action_cut_off_midway_shows_as_interrupted(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.db")
    assert log.begin(_evict(), "evict") is None
    reopened = AuditLog(tmp_path / "audit.db")
    assert reopened.interrupted() == ("a-1",)
    seen = reopened.begin(_evict(), "evict")
    assert seen is not None and seen.state == ActionState.RUNNING and seen.replayed


def test_the_audit_log_is_append_only(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.db")
    log.refuse(_evict(), "evict m12 m13", "refused: this token is read-only")
    db = sqlite3.connect(tmp_path / "audit.db")
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        db.execute("UPDATE audit SET result = 'succeeded'")
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        db.execute("DELETE FROM audit")
    db.close()
    assert [(r.result, r.message) for r in log.records()] == [("refused", "refused: this token is read-only")]
    assert log.result_of("a-1") is None  # a refusal does not claim the id


def test_an_unwritable_state_dir_names_the_fix(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(RankscopeError, match="cannot open the audit log") as err:
        AuditLog(blocker / "audit.db")
    assert "--state-dir" in err.value.fix


def test_blocklist_persists_reasons_and_lifting_keeps_history(tmp_path: Path) -> None:
    path = tmp_path / "blocklist.db"
    bl = Blocklist(path, clock=Clock())
    added = bl.block(["m12", "m13"], "PP group 3 hung in irecv", "alice", action_id="a-1")
    assert [e.machine for e in added] == ["m12", "m13"]
    assert bl.block(["m13", "m14"], "again", "bob") == bl.blocked()[2:]  # m13 keeps its first entry
    reopened = Blocklist(path)
    assert [(e.machine, e.reason, e.who) for e in reopened.blocked()] == [
        ("m12", "PP group 3 hung in irecv", "alice"), ("m13", "PP group 3 hung in irecv", "alice"),
        ("m14", "again", "bob")]
    assert reopened.allowed(["m10", "m12", "m15", "m14"]) == ("m10", "m15")
    assert reopened.lift("m12", "carol") and not reopened.lift("m12", "carol")
    assert not reopened.is_blocked("m12") and reopened.is_blocked("m13")
    lifted = [e for e in reopened.entries() if e.machine == "m12"]
    assert len(lifted) == 1 and lifted[0].lifted_by == "carol" and not lifted[0].active
    with pytest.raises(RankscopeError):
        bl.block(["m1 --all"], "x", "y")


def test_history_records_updates_supersedes_pending_and_walks_rollbacks_back(tmp_path: Path) -> None:
    path = tmp_path / "history.db"
    h = HotUpdateHistory(path, clock=Clock())
    a, b, c = (Version(f"git:{n}", f"/v/{n}") for n in "abc")
    r1 = h.request("u1", "alice", UpdateKind.UPDATE, UpdateMode.IMMEDIATE, 86400.0, a, b)
    h.finish(r1.id, UpdateState.APPLIED, "immediate", "restarted")
    lazy = h.request("u2", "bob", UpdateKind.UPDATE, UpdateMode.LAZY, 86400.0, b, a)
    newer = h.request("u3", "bob", UpdateKind.UPDATE, UpdateMode.LAZY, 86400.0, b, c)
    assert h.get(lazy.id) is not None and h.get(lazy.id).state == UpdateState.SUPERSEDED  # type: ignore[union-attr]
    assert h.pending() == newer and newer.deadline == newer.requested_at + 86400.0
    h.finish(newer.id, UpdateState.APPLIED, "failure", from_version=b)
    reopened = HotUpdateHistory(path)
    assert reopened.current() == c
    assert reopened.rollback_target() == b
    rb = reopened.request("r1", "carol", UpdateKind.ROLLBACK, UpdateMode.IMMEDIATE, 86400.0, c, b)
    reopened.finish(rb.id, UpdateState.APPLIED, "immediate")
    assert reopened.rollback_target() == a  # the next rollback undoes the update before
    entries = reopened.entries()
    assert [e.action_id for e in entries] == ["r1", "u3", "u2", "u1"]
    assert entries[1].who == "bob" and entries[1].trigger == "failure" and entries[1].applied_at is not None
    assert entries[0].describe() == "rollback git:c -> git:b [immediate] applied"


def test_progress_notes_go_between_started_and_the_result(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.db")
    req = _evict()

    def act() -> ActionResult:
        log.note(req, "evict m12 m13", "stopped ranks on m12", ("m12",))
        return ActionResult("a-1", ActionKind.EVICT, ActionState.SUCCEEDED, "done")

    log.run_once(req, "evict m12 m13", act)
    assert [(r.result, r.message) for r in log.records()] == [
        ("started", ""), ("progress", "stopped ranks on m12"), ("succeeded", "done")]
