"""Every hot-update and rollback, persisted (ByteRobust §6.1: traceable and reproducible).

One row per request: who asked, when, from which version to which, in which
mode, and how it ended. A lazy update stays ``pending`` until it is applied
at the next restart or failure or when its window expires; a newer request
supersedes an older pending one. Rollback walks the applied updates back one
at a time (A -> B -> C, rollback gives B, rollback again gives A).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from rankscope.actions.model import UpdateMode, check_text
from rankscope.actions.sqlite_store import SqliteStore
from rankscope.contract.errors import RankscopeError


class UpdateKind(StrEnum):
    UPDATE = "update"
    ROLLBACK = "rollback"


class UpdateState(StrEnum):
    PENDING = "pending"  # lazy, waiting for a restart, a failure or the window
    APPLIED = "applied"  # code directory switched (and processes restarted, if the agent was asked to)
    FAILED = "failed"
    SUPERSEDED = "superseded"  # a newer request replaced this pending one
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class Version:
    """A code version: ``label`` says what a person asked for, ``path`` is the tree on disk."""

    label: str  # e.g. "git:v2 (3f2c1ab0d4e5)" or "dir:/srv/code/exp-7"
    path: str


@dataclass(frozen=True, slots=True)
class UpdateRecord:
    id: int
    action_id: str
    who: str
    requested_at: float
    kind: UpdateKind
    mode: UpdateMode
    window_s: float
    from_version: Version | None
    to_version: Version
    state: UpdateState
    applied_at: float | None = None
    trigger: str = ""  # immediate, restart, failure, window
    message: str = ""

    @property
    def deadline(self) -> float:
        """When a pending lazy update is applied at the latest."""
        return self.requested_at + self.window_s

    def describe(self) -> str:
        frm = self.from_version.label if self.from_version else "(none)"
        return f"{self.kind.value} {frm} -> {self.to_version.label} [{self.mode.value}] {self.state.value}"


_SCHEMA = """
CREATE TABLE IF NOT EXISTS updates (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    action_id TEXT NOT NULL,
    who TEXT NOT NULL,
    requested_at REAL NOT NULL,
    kind TEXT NOT NULL,
    mode TEXT NOT NULL,
    window_s REAL NOT NULL,
    from_label TEXT,
    from_path TEXT,
    to_label TEXT NOT NULL,
    to_path TEXT NOT NULL,
    state TEXT NOT NULL,
    applied_at REAL,
    trigger TEXT NOT NULL DEFAULT '',
    message TEXT NOT NULL DEFAULT ''
);
"""
_COLUMNS = ("id, action_id, who, requested_at, kind, mode, window_s, from_label, from_path, to_label, to_path, "
            "state, applied_at, trigger, message")


class HotUpdateHistory(SqliteStore):
    """The hot-update history of one job, in one SQLite file."""

    what = "hot-update history"
    schema = _SCHEMA

    def request(self, action_id: str, who: str, kind: UpdateKind, mode: UpdateMode, window_s: float,
                from_version: Version | None, to_version: Version) -> UpdateRecord:
        """Record a new request as pending; older pending requests are superseded by it."""
        check_text(who, "requester")
        now = self._clock()
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute("UPDATE updates SET state = ?, message = ? WHERE state = ?",
                           (UpdateState.SUPERSEDED.value, f"superseded by {action_id}", UpdateState.PENDING.value))
                cur = db.execute(
                    "INSERT INTO updates (action_id, who, requested_at, kind, mode, window_s, from_label, from_path, "
                    "to_label, to_path, state) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (action_id, who, now, kind.value, mode.value, window_s,
                     from_version.label if from_version else None, from_version.path if from_version else None,
                     to_version.label, to_version.path, UpdateState.PENDING.value))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        record = self.get(int(cur.lastrowid or 0))
        assert record is not None
        return record

    def finish(self, record_id: int, state: UpdateState, trigger: str = "", message: str = "",
               from_version: Version | None = None) -> UpdateRecord:
        """Close a request: applied (with what triggered it), failed, cancelled.

        ``from_version`` is rewritten when applying a lazy update, because
        the code may have moved on between the request and its application.
        """
        now = self._clock()
        with self._connect() as db:
            if from_version is not None:
                db.execute("UPDATE updates SET from_label = ?, from_path = ? WHERE id = ?",
                           (from_version.label, from_version.path, record_id))
            db.execute("UPDATE updates SET state = ?, applied_at = ?, trigger = ?, message = ? WHERE id = ?",
                       (state.value, now if state == UpdateState.APPLIED else None, trigger, message, record_id))
        record = self.get(record_id)
        if record is None:
            raise RankscopeError(f"no hot-update record {record_id}", "finish a record that request() returned")
        return record

    def get(self, record_id: int) -> UpdateRecord | None:
        with self._connect() as db:
            row = db.execute(f"SELECT {_COLUMNS} FROM updates WHERE id = ?", (record_id,)).fetchone()
        return _record(row) if row else None

    def entries(self, limit: int | None = None) -> tuple[UpdateRecord, ...]:
        """Newest first, as the TUI lists them."""
        sql = f"SELECT {_COLUMNS} FROM updates ORDER BY id DESC"
        with self._connect() as db:
            rows = db.execute(sql + (" LIMIT ?" if limit is not None else ""),
                              (limit,) if limit is not None else ()).fetchall()
        return tuple(_record(r) for r in rows)

    @staticmethod
    def has_pending(path: Path) -> bool:
        """Whether the history file at ``path`` holds a pending lazy update, read without opening it as a store.

        Opening a store creates its schema, a write transaction (20-40 ms a
        file on a loaded host); a restart asks this of every machine before it
        stops anything. A missing file, or one without the table, holds none.
        """
        if not path.exists():
            return False
        try:
            db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=30.0)
            try:
                row = db.execute("SELECT 1 FROM updates WHERE state = ? LIMIT 1",
                                 (UpdateState.PENDING.value,)).fetchone()
            finally:
                db.close()
        except sqlite3.Error:
            return False
        return row is not None

    def pending(self) -> UpdateRecord | None:
        """The lazy update waiting to be applied, if any (at most one: newer requests supersede)."""
        for record in self.entries():
            if record.state == UpdateState.PENDING:
                return record
        return None

    def current(self) -> Version | None:
        """The version the last applied update or rollback switched to."""
        for record in self.entries():
            if record.state == UpdateState.APPLIED:
                return record.to_version
        return None

    def rollback_target(self) -> Version | None:
        """The version before the newest update that no rollback has undone yet."""
        undone = 0
        for record in self.entries():
            if record.state != UpdateState.APPLIED:
                continue
            if record.kind == UpdateKind.ROLLBACK:
                undone += 1
            elif undone:
                undone -= 1
            else:
                return record.from_version
        return None


def find_version(entries: Iterable[UpdateRecord], wanted: str) -> Version | None:
    """The version in ``entries`` (newest first) whose label or path is ``wanted``: what a rollback may name."""
    for record in entries:
        for v in (record.to_version, record.from_version):
            if v is not None and wanted in (v.label, v.path):
                return v
    return None


def _record(row: tuple[Any, ...]) -> UpdateRecord:
    (rid, action_id, who, requested_at, kind, mode, window_s, from_label, from_path, to_label, to_path, state,
     applied_at, trigger, message) = row
    return UpdateRecord(
        id=int(rid), action_id=str(action_id), who=str(who), requested_at=float(requested_at),
        kind=UpdateKind(kind), mode=UpdateMode(mode), window_s=float(window_s),
        from_version=Version(str(from_label), str(from_path)) if from_label is not None else None,
        to_version=Version(str(to_label), str(to_path)),
        state=UpdateState(state),
        applied_at=float(applied_at) if applied_at is not None else None,
        trigger=str(trigger), message=str(message),
    )
