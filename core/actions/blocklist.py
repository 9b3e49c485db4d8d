"""Machines taken out of the job, with the reason, kept across agent restarts.

ByteRobust blocks evicted machines so a restart or a standby refill never
brings a suspect back (§4.2, §5). An entry records who blocked the machine,
when, why and by which action; lifting a block keeps the row (with who and
when it was lifted), so the history of a machine is never lost.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from rankscope.actions.model import check_machine, check_text
from rankscope.actions.sqlite_store import SqliteStore

_SCHEMA = """
CREATE TABLE IF NOT EXISTS blocklist (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    machine TEXT NOT NULL,
    reason TEXT NOT NULL,
    who TEXT NOT NULL,
    at REAL NOT NULL,
    action_id TEXT NOT NULL DEFAULT '',
    lifted_by TEXT,
    lifted_at REAL
);
CREATE INDEX IF NOT EXISTS blocklist_active ON blocklist (machine, lifted_at);
"""


@dataclass(frozen=True, slots=True)
class BlockEntry:
    machine: str
    reason: str
    who: str
    at: float
    action_id: str = ""
    lifted_by: str | None = None
    lifted_at: float | None = None

    @property
    def active(self) -> bool:
        return self.lifted_at is None


class Blocklist(SqliteStore):
    """A persistent blocklist in one SQLite file."""

    what = "blocklist"
    schema = _SCHEMA

    def block(self, machines: Iterable[str], reason: str, who: str, action_id: str = "") -> tuple[BlockEntry, ...]:
        """Block each machine (already-blocked ones keep their first entry). Returns the new entries."""
        check_text(reason, "block reason")
        check_text(who, "requester")
        now = self._clock()
        added: list[BlockEntry] = []
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                for machine in machines:
                    check_machine(machine)
                    if db.execute("SELECT 1 FROM blocklist WHERE machine = ? AND lifted_at IS NULL",
                                  (machine,)).fetchone():
                        continue
                    db.execute("INSERT INTO blocklist (machine, reason, who, at, action_id) VALUES (?, ?, ?, ?, ?)",
                               (machine, reason, who, now, action_id))
                    added.append(BlockEntry(machine, reason, who, now, action_id))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return tuple(added)

    def lift(self, machine: str, who: str) -> bool:
        """Let a repaired machine back in. False if it was not blocked."""
        check_machine(machine)
        check_text(who, "requester")
        with self._connect() as db:
            cur = db.execute("UPDATE blocklist SET lifted_by = ?, lifted_at = ? WHERE machine = ? AND lifted_at IS NULL",
                             (who, self._clock(), machine))
        return cur.rowcount > 0

    def blocked(self) -> tuple[BlockEntry, ...]:
        """Active entries, oldest first."""
        return tuple(e for e in self.entries() if e.active)

    def allowed(self, machines: Iterable[str]) -> tuple[str, ...]:
        """``machines`` without the blocked ones, order kept: what a restart or a standby refill may use."""
        blocked = {e.machine for e in self.blocked()}
        return tuple(m for m in machines if m not in blocked)

    def entries(self) -> tuple[BlockEntry, ...]:
        """Every entry ever written, lifted ones included, oldest first."""
        with self._connect() as db:
            rows = db.execute("SELECT machine, reason, who, at, action_id, lifted_by, lifted_at FROM blocklist "
                              "ORDER BY id").fetchall()
        return tuple(BlockEntry(*row) for row in rows)
