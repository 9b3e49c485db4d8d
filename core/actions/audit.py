"""The agent's persistent audit log, and what makes actions idempotent by id.

Two tables in one SQLite file:

- ``audit``: append-only lines (who, when, what, result). Triggers refuse
  UPDATE and DELETE, so a record, once written, stays as written. The agent
  tails it by ``seq`` to broadcast every line to every attached TUI.
- ``actions``: one row per action id with the request and its final result.
  A request whose id is already there is not carried out again: the caller
  gets the recorded result (or "still running") back. Claiming the id and
  writing the "started" line happen in one ``BEGIN IMMEDIATE`` transaction,
  so two clients racing with the same id cannot both act.

SQLite because it is in the standard library, survives an agent restart and
handles concurrent readers; one connection per call keeps it thread-safe.
"""

from __future__ import annotations

import json
import sqlite3

from rankscope.actions.model import (
    ActionKind,
    ActionRequest,
    ActionResult,
    ActionState,
    AuditRecord,
)
from rankscope.actions.sqlite_store import SqliteStore
from rankscope.contract.errors import RankscopeError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS audit (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    action_id TEXT NOT NULL,
    who TEXT NOT NULL,
    at REAL NOT NULL,
    kind TEXT NOT NULL,
    what TEXT NOT NULL,
    result TEXT NOT NULL,
    message TEXT NOT NULL DEFAULT '',
    machines TEXT NOT NULL DEFAULT '[]'
);
CREATE TRIGGER IF NOT EXISTS audit_no_update BEFORE UPDATE ON audit
    BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END;
CREATE TRIGGER IF NOT EXISTS audit_no_delete BEFORE DELETE ON audit
    BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END;
CREATE TABLE IF NOT EXISTS actions (
    action_id TEXT PRIMARY KEY,
    request TEXT NOT NULL,
    who TEXT NOT NULL,
    what TEXT NOT NULL,
    state TEXT NOT NULL,
    started REAL NOT NULL,
    result TEXT
);
"""


class AuditLog(SqliteStore):
    """Append-only audit records plus the action-id ledger, in one SQLite file."""

    what = "audit log"
    schema = _SCHEMA
    wal = True

    # ---- idempotent execution -------------------------------------------------------------

    def begin(self, request: ActionRequest, what: str, machines: tuple[str, ...] = ()) -> ActionResult | None:
        """Claim ``request.action_id``. None: go ahead and act. A result: the id was seen; do not act.

        A repeated id with a different request is an error, not a replay:
        the client reused an id by mistake and must not get someone else's result.
        """
        body = _canonical(request)
        now = self._clock()
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                row = db.execute("SELECT request, state, started, result FROM actions WHERE action_id = ?",
                                 (request.action_id,)).fetchone()
                if row is not None:
                    db.execute("COMMIT")  # read-only: nothing to keep, and the lock is released at once
                    return _replay(request, body, row)
                db.execute("INSERT INTO actions (action_id, request, who, what, state, started) "
                           "VALUES (?, ?, ?, ?, ?, ?)",
                           (request.action_id, body, _who(request), what, ActionState.RUNNING.value, now))
                _append(db, request.action_id, _who(request), now, request.kind, what, "started", "",
                        machines)
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
        return None

    def finish(self, request: ActionRequest, result: ActionResult, what: str,
               machines: tuple[str, ...] = ()) -> AuditRecord:
        """Record how an action begun with :meth:`begin` ended."""
        if not result.state.final:
            raise RankscopeError(f"cannot finish {request.action_id} in state {result.state}",
                                 "finish with succeeded, failed, cancelled or refused")
        now = self._clock()
        stored = ActionResult(result.action_id, result.kind, result.state, result.message,
                              result.started, result.finished if result.finished is not None else now,
                              result.details)
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute("UPDATE actions SET state = ?, result = ? WHERE action_id = ?",
                           (stored.state.value, json.dumps(stored.to_json()), request.action_id))
                seq = _append(db, request.action_id, _who(request), now, request.kind, what,
                              stored.state.value, stored.message, machines)
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
        return AuditRecord(seq, request.action_id, _who(request), now, request.kind, what,
                           stored.state.value, stored.message, machines)

    def note(self, request: ActionRequest, what: str, message: str, machines: tuple[str, ...] = (),
             result: str = "progress") -> AuditRecord:
        """Append an intermediate line (a step of a running action) so every watcher sees it."""
        now = self._clock()
        with self._connect() as db:
            seq = _append(db, request.action_id, _who(request), now, request.kind, what, result, message,
                          machines)
        return AuditRecord(seq, request.action_id, _who(request), now, request.kind, what, result, message,
                           machines)

    def refuse(self, request: ActionRequest, what: str, message: str) -> AuditRecord:
        """Record a refused request (bad token, target outside the job) without claiming its id."""
        now = self._clock()
        with self._connect() as db:
            seq = _append(db, request.action_id, _who(request), now, request.kind, what,
                          ActionState.REFUSED.value, message, request.targets.machines)
        return AuditRecord(seq, request.action_id, _who(request), now, request.kind, what,
                           ActionState.REFUSED.value, message, request.targets.machines)

    # ---- reading ------------------------------------------------------------------------

    def result_of(self, action_id: str) -> ActionResult | None:
        with self._connect() as db:
            row = db.execute("SELECT result FROM actions WHERE action_id = ?", (action_id,)).fetchone()
        if row is None or row[0] is None:
            return None
        return ActionResult.from_json(json.loads(row[0]))

    def records(self, after_seq: int = 0, limit: int | None = None) -> tuple[AuditRecord, ...]:
        """Audit lines with ``seq > after_seq``, oldest first: what a broadcaster tails."""
        sql = "SELECT seq, action_id, who, at, kind, what, result, message, machines FROM audit " \
              "WHERE seq > ? ORDER BY seq"
        params: tuple[int, ...] = (after_seq,)
        if limit is not None:
            sql += " LIMIT ?"
            params = (after_seq, limit)
        with self._connect() as db:
            rows = db.execute(sql, params).fetchall()
        return tuple(AuditRecord(seq, aid, who, at, ActionKind(kind), what, result, message,
                                 tuple(json.loads(machines)))
                     for seq, aid, who, at, kind, what, result, message, machines in rows)

    def interrupted(self) -> tuple[str, ...]:
        """Ids started but never finished: the agent died mid-action; a person must look."""
        with self._connect() as db:
            rows = db.execute("SELECT action_id FROM actions WHERE state = ? ORDER BY started",
                              (ActionState.RUNNING.value,)).fetchall()
        return tuple(r[0] for r in rows)


def _who(request: ActionRequest) -> str:
    """Who the client says acts, and the token the agent saw (``ActionRequest.caller``).

    The claimed name is the client's free text: its parentheses become brackets, so only the agent's own note
    stands in parentheses and a name such as "bob (act token deadbeef)" cannot pass for another token's record."""
    claimed = request.requested_by.translate(_NAME_PARENS)
    return f"{claimed} ({request.caller})" if request.caller else claimed


_NAME_PARENS = str.maketrans("()", "[]")


def _canonical(request: ActionRequest) -> str:
    return json.dumps(request.to_json(), sort_keys=True, separators=(",", ":"))


def _replay(request: ActionRequest, body: str, row: tuple[str, str, float, str | None]) -> ActionResult:
    stored_body, state, started, result = row
    if stored_body != body:
        raise RankscopeError(
            f"action id {request.action_id} was already used for a different request",
            "use a fresh action id for a new action (the client makes one per confirmation)",
        )
    if result is None:
        return ActionResult(request.action_id, request.kind, ActionState(state),
                            f"{request.action_id} is already running (started {started:.0f})", started,
                            replayed=True)
    old = ActionResult.from_json(json.loads(result))
    return ActionResult(old.action_id, old.kind, old.state, old.message, old.started, old.finished, old.details,
                        replayed=True)


def _append(db: sqlite3.Connection, action_id: str, who: str, at: float, kind: ActionKind, what: str, result: str,
            message: str, machines: tuple[str, ...]) -> int:
    cur = db.execute("INSERT INTO audit (action_id, who, at, kind, what, result, message, machines) "
                     "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                     (action_id, who, at, kind.value, what, result, message, json.dumps(list(machines))))
    return int(cur.lastrowid or 0)
