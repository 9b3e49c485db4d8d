"""The one way the agent's persistent state (audit log, blocklist, hot-update history) opens SQLite."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rankscope.contract.errors import RankscopeError


class SqliteStore:
    """A state file with its schema created on open; a connection per call, so threads never share one.

    ``what`` names the store in the error a person sees when the file cannot be opened.
    """

    what = "state file"
    schema = ""
    wal = False  # write-ahead logging, for a store that is read while it is appended to

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self._clock = clock
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._connect() as db:
                db.executescript(self.schema)
        except (OSError, sqlite3.Error) as exc:
            raise RankscopeError(f"cannot open the {self.what} {self.path}: {exc}",
                                 "give the agent a writable --state-dir") from exc

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        try:
            if self.wal:
                db.execute("PRAGMA journal_mode=WAL")
            yield db
        finally:
            db.close()
