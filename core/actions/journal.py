"""The incident journal: a short record of what happened to the job, kept by every agent beside its audit log.

A view attached late (the read-only pair, a second engineer) saw none of the hang's start, the verdicts or an
eviction whose agent is gone with its machine: its Events said only "evicted before this view attached". The
acting view writes each such moment (``KINDS``) to every agent of the job; each agent keeps the last
``MAX_ENTRIES`` in ``STATE_DIR/journal.jsonl``; a view that attaches reads them all and tells the same story.

On the wire it is a small gRPC service of its own (``SERVICE``) with JSON bodies, served by agents that have a
state directory (actions enabled): ``Append`` needs the ``act`` role (only a person who may act writes the
story), ``Read`` the ``read`` role. Every entry is checked here: a known kind, a finite time, printable text
of bounded length; anything else is refused whole, never half-written.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SERVICE = "rankscope.v1.Journal"
APPEND = f"/{SERVICE}/Append"
READ = f"/{SERVICE}/Read"
FILE_NAME = "journal.jsonl"
MAX_ENTRIES = 200
MAX_TEXT = 400
MAX_BY = 120
MAX_APPEND = 50  # entries in one Append
MAX_SLOW = 64  # machines one fail-slow reading names
# What a journal tells: the moments a late view must see.
KINDS = frozenset({"hung", "verdict", "evicted", "restarted", "resumed", "action"})


class JournalError(ValueError):
    """An entry or a request that is not a journal's (the agent answers INVALID_ARGUMENT with this text)."""


@dataclass(frozen=True, slots=True)
class JournalEntry:
    wall: float  # when it happened, the writer's wall clock (seconds)
    kind: str  # one of KINDS
    text: str
    by: str = ""  # who wrote it (user@host of the acting view)
    # A resumption a view saw in the ranks' progress, not the restarter's account of the step the job resumed from:
    # a view tells a restart just before the restarter's account, never before another view's sighting.
    observed: bool = False
    # A fail-slow reading (a verdict): the machines the detectors name, () when they name none now; None: not one.
    # Views of a pair read the slowdown at their own moments in their own words: one story by what it names.
    slow: tuple[str, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"wall": self.wall, "kind": self.kind, "text": self.text, "by": self.by}
        if self.observed:
            data["observed"] = True
        if self.slow is not None:
            data["slow"] = list(self.slow)
        return data


def _printable(text: str, limit: int) -> str:
    return "".join(c if c.isprintable() else " " for c in text)[:limit]


def entry_from_json(data: Any) -> JournalEntry:
    """One entry from its JSON form, checked (JournalError names what is wrong)."""
    if not isinstance(data, dict):
        raise JournalError("a journal entry is a JSON object")
    wall, kind, text, by = data.get("wall"), data.get("kind"), data.get("text"), data.get("by", "")
    observed, slow = data.get("observed", False), data.get("slow")
    if isinstance(wall, bool) or not isinstance(wall, (int, float)) or not math.isfinite(wall) or wall < 0:
        raise JournalError("a journal entry's wall is a finite time in seconds")
    if kind not in KINDS:
        raise JournalError(f"a journal entry's kind is one of {', '.join(sorted(KINDS))}")
    if not isinstance(text, str) or not text.strip() or not isinstance(by, str):
        raise JournalError("a journal entry has a text (and a 'by' string)")
    if not isinstance(observed, bool):
        raise JournalError("a journal entry's 'observed' is true or false")
    if slow is not None and (not isinstance(slow, list) or len(slow) > MAX_SLOW
                             or not all(isinstance(m, str) and m.strip() for m in slow)):
        raise JournalError(f"a journal entry's 'slow' is a list of at most {MAX_SLOW} machine names")
    return JournalEntry(float(wall), str(kind), _printable(text, MAX_TEXT), _printable(by, MAX_BY), observed,
                        None if slow is None else tuple(_printable(m, MAX_BY) for m in slow))


def entries_from_bytes(body: bytes) -> tuple[JournalEntry, ...]:
    """The entries of a request or reply body: ``{"entries": [...]}``."""
    try:
        data = json.loads(body.decode("utf-8")) if body else {}
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise JournalError(f"a journal body is JSON ({type(exc).__name__})") from None
    if not isinstance(data, dict) or not isinstance(data.get("entries", []), list):
        raise JournalError("a journal body is an object with a list 'entries'")
    return tuple(entry_from_json(e) for e in data.get("entries", []))


def entries_to_bytes(entries: Iterable[JournalEntry]) -> bytes:
    return json.dumps({"entries": [e.to_json() for e in entries]}).encode("utf-8")


def _key(e: JournalEntry) -> tuple[float, str, str]:
    return (round(e.wall, 3), e.kind, e.text)


def merge(*lists: Iterable[JournalEntry]) -> tuple[JournalEntry, ...]:
    """Entries of several agents as one story: each once, in time order."""
    seen: dict[tuple[float, str, str], JournalEntry] = {}
    for entries in lists:
        for e in entries:
            seen.setdefault(_key(e), e)
    return tuple(sorted(seen.values(), key=lambda e: e.wall))


class Journal:
    """One agent's journal file: the last ``MAX_ENTRIES`` entries, each once, in time order."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()

    def read(self) -> tuple[JournalEntry, ...]:
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return ()
        out: list[JournalEntry] = []
        for line in lines[-2 * MAX_ENTRIES:]:  # written bounded; a file grown by hand is read at its end
            try:
                out.append(entry_from_json(json.loads(line)))
            except (JournalError, json.JSONDecodeError, RecursionError):
                continue  # a line cut by a crash: the rest of the story stays readable
        return tuple(out[-MAX_ENTRIES:])

    def append(self, entries: Sequence[JournalEntry]) -> tuple[JournalEntry, ...]:
        """Add ``entries`` (those already kept are not repeated); returns the journal as it is now."""
        if len(entries) > MAX_APPEND:
            raise JournalError(f"at most {MAX_APPEND} journal entries per call")
        with self._lock:
            kept = merge(self.read(), entries)[-MAX_ENTRIES:]
            tmp = self.path.with_name(self.path.name + ".tmp")
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text("".join(json.dumps(e.to_json()) + "\n" for e in kept), encoding="utf-8")
            os.replace(tmp, self.path)
            return kept


def journal_service(state_dir: Path) -> Callable[[Any], None]:
    """A registrar for ``start_agent(extra_services=...)``: the journal in ``state_dir`` served as ``SERVICE``."""
    import asyncio

    import grpc

    journal = Journal(state_dir / FILE_NAME)

    async def append(body: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            entries = entries_from_bytes(body)
            kept = await asyncio.to_thread(journal.append, entries)
        except JournalError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return entries_to_bytes(kept)

    async def read(body: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return entries_to_bytes(await asyncio.to_thread(journal.read))

    def identity(b: bytes) -> bytes:
        return b

    handlers = {
        "Append": grpc.unary_unary_rpc_method_handler(append, request_deserializer=identity,
                                                      response_serializer=identity),
        "Read": grpc.unary_unary_rpc_method_handler(read, request_deserializer=identity,
                                                    response_serializer=identity),
    }

    def register(server: Any) -> None:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))

    return register
