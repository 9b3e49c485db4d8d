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
from rankscope.contract.errors import RankscopeError


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def _evict(action_id: str = "a-1", reason: str = "PP group 3 hangs") -> ActionRequest:
    return ActionRequest(action_id, ActionKind.EVICT, Targets(("m12", "m13")), EvictArgs(reason), "alice")


def _finish(log: AuditLog, request: ActionRequest, state: ActionState, message: str,
            machines: tuple[str, ...] = ()) -> None:
    log.finish(request, ActionResult(request.action_id, request.kind, state, message, started=1.0), "evict m12 m13",
               machines)


def test_a_repeated_action_id_is_not_claimed_again_and_gets_the_recorded_result(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.db", clock=Clock())
    assert log.begin(_evict(), "evict m12 m13", ("m12", "m13")) is None  # claimed: the agent acts
    _finish(log, _evict(), ActionState.SUCCEEDED, "evicted m12 m13", ("m12", "m13"))
    again = AuditLog(tmp_path / "audit.db").begin(_evict(), "evict m12 m13")  # after an agent restart
    assert again is not None and again.replayed and again.state == ActionState.SUCCEEDED
    assert again.message == "evicted m12 m13" and again.started == 1.0 and again.finished is not None
    recorded = log.result_of("a-1")
    assert recorded is not None and recorded.ok and not recorded.replayed
    records = log.records()
    assert [(r.seq, r.action_id, r.who, r.result) for r in records] == [(1, "a-1", "alice", "started"),
                                                                        (2, "a-1", "alice", "succeeded")]
    assert records[0].machines == ("m12", "m13") and records[0].what == "evict m12 m13"
    assert records[0].when < records[1].when
    assert log.records(after_seq=1) == records[1:]


def test_reusing_an_id_for_another_request_is_an_error(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.db")
    assert log.begin(_evict(), "evict") is None
    _finish(log, _evict(), ActionState.SUCCEEDED, "ok")
    with pytest.raises(RankscopeError, match="already used for a different request"):
        log.begin(_evict(reason="something else"), "evict")


def test_a_failed_action_is_recorded_and_only_a_final_state_finishes_one(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.db")
    assert log.begin(_evict(), "evict m12 m13") is None
    with pytest.raises(RankscopeError, match="cannot finish a-1 in state running"):
        _finish(log, _evict(), ActionState.RUNNING, "half way")
    assert log.interrupted() == ("a-1",)
    _finish(log, _evict(), ActionState.FAILED, "scontrol failed: Invalid node name")
    recorded = log.result_of("a-1")
    assert recorded is not None and recorded.state == ActionState.FAILED
    assert recorded.message == "scontrol failed: Invalid node name"
    assert [r.result for r in log.records()] == ["started", "failed"]
    assert log.interrupted() == ()


def test_concurrent_requests_with_one_id_are_claimed_once(tmp_path: Path) -> None:
    path = tmp_path / "audit.db"
    AuditLog(path)
    start = threading.Barrier(4)
    claims: list[ActionResult | None] = []

    def worker() -> None:
        log = AuditLog(path)  # one log per thread, as agents' worker threads and a restarted agent would have
        start.wait(10.0)
        claims.append(log.begin(_evict(), "evict"))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10.0)
    assert len(claims) == 4 and claims.count(None) == 1
    assert [c.state for c in claims if c is not None] == [ActionState.RUNNING] * 3
    assert all(c.replayed and "already running" in c.message for c in claims if c is not None)


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
    assert [e.machine for e in reopened.blocked()] == ["m13", "m14"]
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


def test_a_pending_lazy_update_is_read_without_opening_the_history_for_writing(tmp_path: Path) -> None:
    """What a restart asks of every machine before it stops anything (HotUpdateHistory.has_pending)."""
    path = tmp_path / "history.db"
    assert not HotUpdateHistory.has_pending(path) and not path.exists()  # nothing created by asking
    h = HotUpdateHistory(path, clock=Clock())
    assert not HotUpdateHistory.has_pending(path)
    a, b = Version("git:a", "/v/a"), Version("git:b", "/v/b")
    now = h.request("u1", "alice", UpdateKind.UPDATE, UpdateMode.IMMEDIATE, 86400.0, a, b)
    assert HotUpdateHistory.has_pending(path) == (h.pending() is not None)  # an immediate one is pending too
    h.finish(now.id, UpdateState.APPLIED, "immediate")
    assert not HotUpdateHistory.has_pending(path)
    lazy = h.request("u2", "bob", UpdateKind.UPDATE, UpdateMode.LAZY, 86400.0, b, a)
    assert HotUpdateHistory.has_pending(path)
    h.finish(lazy.id, UpdateState.APPLIED, "restart")
    assert not HotUpdateHistory.has_pending(path)
    other = tmp_path / "other.db"  # a file that is no history (or not yet one) holds no pending update
    sqlite3.connect(other).close()
    assert not HotUpdateHistory.has_pending(other)
    (tmp_path / "garbage.db").write_bytes(b"not a database at all" * 100)
    assert not HotUpdateHistory.has_pending(tmp_path / "garbage.db")


def test_progress_notes_go_between_started_and_the_result(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.db")
    req = _evict()
    assert log.begin(req, "evict m12 m13") is None
    log.note(req, "evict m12 m13", "stopped ranks on m12", ("m12",))
    _finish(log, req, ActionState.SUCCEEDED, "done")
    assert [(r.result, r.message) for r in log.records()] == [
        ("started", ""), ("progress", "stopped ranks on m12"), ("succeeded", "done")]
