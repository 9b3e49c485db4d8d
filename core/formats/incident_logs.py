"""The logs engineers paste into an incident, read as evidence: which kind a file holds, and what each line says.

A file is told by its content, never its name: NCCL RAS text or JSON
(``formats.nccl_ras``), NCCL Inspector JSON lines or Prometheus text
(``formats.nccl_inspector``), or a job's log holding any mix of

- ProcessGroupNCCL watchdog lines: ``Watchdog caught collective operation
  timeout: WorkNCCL(SeqNum=S, OpType=OP, ...)``, ``failure detected by
  watchdog at work sequence id: S PG status: last enqueued work: E, last
  completed work: C`` (older: ``... at work: S, last enqueued NCCL work: E,
  last completed NCCL work: C``, ``Timeout at NCCL work: ...``), ``Received
  a dump signal due to a collective timeout from rank X ... Last enqueued
  NCCL work: E, last completed NCCL work: C``, the blocking-wait form;
- ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` fingerprint mismatches (``Detected
  mismatch between collectives on ranks. Rank A is running collective:
  CollectiveFingerPrint(...), but Rank B is running collective: ...``, and
  the older one-rank form);
- PyTorch fr_trace's text report (``Not all ranks joining collective``,
  ``Collective sequence number: N has errors``, then ``key: value`` lines).

Ranks: a ``[rankN]:`` prefix (torchrun's, possibly after a launcher's own
prefix) is the global rank; else a ``rank<N>`` file name; else the rank of
the default process group (``PG ID 0``/``default_pg``); a line with none of
these is read but not tied to a rank, and the verdict says so. Lines that
carry a marker of these formats but not their shape are quoted in the notes;
two ranks' lines interleaved on one line are read for both and flagged.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from rankscope.contract.log_records import (
    Fingerprint,
    FrCollective,
    InspectorRank,
    LogEvidence,
    MismatchReport,
    RasReport,
    WatchdogRecord,
)
from rankscope.formats.log_names import file_rank

_HEAD_BYTES = 64 * 1024
_MAX_NOTES_PER_FILE = 4

# A marker in the first bytes of a file that makes it a log this module reads (checked before py-spy's).
_LOG_MARKERS = ("WorkNCCL(SeqNum=", "Watchdog caught collective operation timeout", "ProcessGroupNCCL.cpp:",
                "last enqueued NCCL work", "last enqueued work:",
                "Detected mismatch between collectives", "Not all ranks joining collective",
                "Collective sequence number:", "has errors\ninternal record id", "errors\ninternal record id")

# A line is looked at only when it holds one of these (the shapes below all do).
_LINE_KEYS = ("WorkNCCL", "nqueued", "dump signal", "Detected mismatch", "ranks joining", "Collective ")
_PREFIX_RANK = re.compile(r"\[rank(\d+)\]:")
_PG = re.compile(r"\[(?:PG (?:ID )?(\d+)(?: PG GUID (\S+?)(?:\(([^)]*)\))?)? )?Rank (\d+)\]")
_WORK = re.compile(r"WorkNCCL\((?:SeqNum=(\d+),\s*)?OpType=(\w+)(?:,\s*NumelIn=(-?\d+),\s*NumelOut=(-?\d+))?"
                   r"(?:,\s*Timeout\(ms\)=(\d+))?")
_STATUS_NEW = re.compile(r"failure detected by watchdog at work sequence id: (\d+)\s*PG status: "
                         r"last enqueued work: (-?\d+), last completed work: (-?\d+)")
_STATUS_OLD = re.compile(r"(?:detected by watchdog at work|Timeout at NCCL work): (\d+), "
                         r"last enqueued NCCL work: (-?\d+), last completed NCCL work: (-?\d+)")
_DUMP = re.compile(r"(?:Received a dump signal (?:due to a collective timeout )?from\s+(?:this local rank|rank (\d+))"
                   r"|Observed flight recorder dump signal)")
_LAST = re.compile(r"[Ll]ast enqueued (?:NCCL )?work: (-?\d+), last completed (?:NCCL )?work: (-?\d+)")
_MISMATCH = re.compile(r"Detected mismatch between collectives on ranks\. Rank (\d+) is running "
                       r"(?:inconsistent )?collective: ")
_BUT = re.compile(r",?\s*but Rank (\d+) is running (?:inconsistent )?collective: ")
_SEQ_IS = re.compile(r"The sequence number is: (\d+)")
_ASPECTS = re.compile(r"Collectives differ in the following aspects:\s*(.*)$")
# One aspect of ProcessGroupWrapper's fingerprint diff: "Op type: ALLREDUCEvs BROADCAST", "Tensor Tensor shapes: 25vs 1"
# (its words glued to "vs" as PyTorch prints them).
_ASPECT = re.compile(r"(Sequence number|Op type|(?:Tensor )*Tensor (?:shapes|dtypes|devices)):\s*(.*?)\s*vs\s+(.*?)\s*"
                     r"(?=(?:Sequence number|Op type|(?:Tensor )*Tensor (?:shapes|dtypes|devices)):|$)")
_FR_START = re.compile(r"^(?:Not all ranks joining collective[:\s]*(?:sequence number:\s*)?(\d+)?"
                       r"|Collective (?:sequence number:\s*)?(\d+)(?: at entry \d+)? (?:has )?errors)")
_FR_FIELD = re.compile(r"^(internal record id|group info|collective|missing ranks|input sizes|output sizes|"
                       r"world size|expected ranks|collective state|error msg|collective stack trace):\s*(.*)$")
_CULPRIT = re.compile(r"Culprit rank (\d+); Error type: (\w+)(?:, Expected state: '(\w+)' does not match found "
                      r"state: '(\w+)')?")


@dataclass(slots=True)
class _Acc:
    watchdog: list[WatchdogRecord] = field(default_factory=list)
    ras: list[RasReport] = field(default_factory=list)
    fr: list[FrCollective] = field(default_factory=list)
    mismatches: list[MismatchReport] = field(default_factory=list)
    inspector: list[InspectorRank] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def log_kind(head: str) -> str | None:
    """What a file's first bytes say it is: "ras", "ras-json", "inspector", "log", "crash", or None (not a log)."""
    from rankscope.formats.nccl_inspector import looks_like_inspector
    from rankscope.formats.nccl_ras import json_start, looks_like_ras_json, looks_like_ras_text

    # JSON where a line opens an object (a status word, a prompt or an echo may come first).
    if looks_like_ras_json(head):
        return "ras-json"
    if looks_like_inspector(head) and json_start(head) >= 0:
        return "inspector"
    if "nccl_collective_exec_time_microseconds{" in head:
        return "inspector"
    if any(m in head for m in _LOG_MARKERS):
        return "log"  # a log with a RAS report pasted in it is read for both
    if looks_like_ras_text(head):
        return "ras"
    from rankscope.formats.crash_logs import looks_like_crash

    if looks_like_crash(head):
        return "crash"  # NCCL WARN, DistBackendError, torchelastic's summary, kernel Xid lines: formats.crash_logs
    return None


def _head(path: Path) -> str:
    return _read_head(path)[0]


def _read_head(path: Path) -> tuple[str, bool]:
    """The first and the last bytes of a file (a rank's log holds the watchdog's lines at its end), and whether
    that is the whole file."""
    whole = True
    try:
        with path.open("rb") as f:
            raw = f.read(_HEAD_BYTES)
            if len(raw) == _HEAD_BYTES:
                f.seek(0, 2)
                size = f.tell()
                if size > _HEAD_BYTES:
                    whole = False
                    f.seek(max(_HEAD_BYTES, size - _HEAD_BYTES))
                    raw += b"\n" + f.read(_HEAD_BYTES)
    except OSError:
        return "", False
    if b"\0" in raw[:4096]:
        return "", False
    return raw.decode("utf-8", errors="replace"), whole


def is_log_file(path: Path) -> bool:
    return path.is_file() and log_kind(_head(path)) is not None


@dataclass(frozen=True, slots=True)
class Scanned:
    """What one file of a folder holds, read once: a log kind (None: no log), py-spy output or not, and its whole
    text when it was small enough to be read whole (else None: the reader reads it again)."""

    path: Path
    kind: str | None
    pyspy: bool
    text: str | None = None


def _files_of(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        return []
    with os.scandir(path) as it:  # the entries' types come with the listing: no stat per file
        names = sorted(e.name for e in it if not e.name.startswith(".") and e.is_file())
    return [path / n for n in names]


def scan(path: Path) -> list[Scanned]:
    """Every file of ``path`` (a file, or a folder not recursively), each read once at its ends."""
    out = []
    for p in _files_of(path):
        head, whole = _read_head(p)
        # Markdown beside the logs is someone's description of them (a README, a ticket), not output to judge.
        kind = None if p.suffix.lower() == ".md" and p != path else log_kind(head)
        out.append(Scanned(p, kind, holds_pyspy(head), head if whole and kind is not None else None))
    return out


def any_log_file(path: Path) -> bool:
    """Whether a folder holds at least one log (stops at the first)."""
    with os.scandir(path) as it:
        return any(not e.name.startswith(".") and not e.name.lower().endswith(".md") and e.is_file()
                   and log_kind(_head(Path(e.path))) is not None for e in it)


def holds_pyspy(head: str) -> bool:
    """Whether a log also holds py-spy output (then the dump reader reads it too)."""
    return re.search(r"(?m)^\s*(?:\.\.\.\s*)?Process \d+:", head) is not None or "\nThread 0x" in head


def log_files(path: Path) -> list[Path]:
    """The files of ``path`` (a file or a folder, not recursive) that hold logs this module reads."""
    return [s.path for s in scan(path) if s.kind is not None]


def read_logs(paths: Iterable[Path | Scanned]) -> LogEvidence:
    """Every log file given → one LogEvidence (what each line said, where, and what could not be read)."""
    acc = _Acc()
    for item in paths:
        path = item.path if isinstance(item, Scanned) else item
        text = item.text if isinstance(item, Scanned) else None
        if text is None:
            try:
                text = path.read_bytes().decode("utf-8", errors="replace")
            except OSError as exc:
                acc.notes.append(f"{path.name}: not readable ({exc.strerror or exc})")
                continue
        read_text(text, path.name, acc, item.kind if isinstance(item, Scanned) else None)
    return LogEvidence(tuple(acc.watchdog), tuple(acc.ras), tuple(acc.fr), tuple(acc.mismatches),
                       tuple(acc.inspector), tuple(acc.notes))


def read_log_text(text: str, name: str = "log") -> LogEvidence:
    """One pasted text (any of the kinds above) → LogEvidence."""
    acc = _Acc()
    read_text(text, name, acc)
    return LogEvidence(tuple(acc.watchdog), tuple(acc.ras), tuple(acc.fr), tuple(acc.mismatches),
                       tuple(acc.inspector), tuple(acc.notes))


def read_text(text: str, name: str, acc: _Acc, kind: str | None = None) -> None:
    """One file's text into ``acc``; ``kind`` when the caller has told it already (``scan``)."""
    from rankscope.formats.nccl_inspector import parse_inspector
    from rankscope.formats.nccl_ras import looks_like_ras_text, parse_ras_json, parse_ras_text

    kind = kind or log_kind(text[:_HEAD_BYTES] + text[-_HEAD_BYTES:])
    if kind == "ras-json":
        try:
            report, notes = parse_ras_json(text, name)
        except (ValueError, RecursionError) as exc:
            acc.notes.append(f"{name}: looks like `ncclras -f json` output but is not readable JSON ({exc}); "
                             "save the whole output of `ncclras -f json`")
            return
        acc.ras.append(report)
        acc.notes.extend(notes[:_MAX_NOTES_PER_FILE])
        return
    if kind == "inspector":
        ranks, notes = parse_inspector(text, name)
        acc.inspector.extend(ranks)
        acc.notes.extend(notes[:_MAX_NOTES_PER_FILE])
        return
    # A pasted log may hold a RAS report (or only one block of it) and a job's lines together: read both.
    if kind == "ras" or looks_like_ras_text(text):
        report, notes = parse_ras_text(text, name)
        if report.rows or report.comms or report.missing_process_count or report.dead_process_count:
            acc.ras.append(report)
            acc.notes.extend(notes[:_MAX_NOTES_PER_FILE])
    _read_lines(text, name, acc)


def _read_lines(text: str, name: str, acc: _Acc) -> None:
    of_file = file_rank(name)
    quoted = 0
    interleaved = 0
    fr: dict[str, object] | None = None
    lines = text.split("\n")
    cut = bool(text) and not text.endswith("\n")
    start_wd = len(acc.watchdog)

    def quote(no: int, line: str, why: str) -> None:
        nonlocal quoted
        quoted += 1
        if quoted <= _MAX_NOTES_PER_FILE:
            acc.notes.append(f"{name}:{no}: {why}, quoted and skipped: {line.strip()[:200]!r}")

    def close_fr() -> None:
        nonlocal fr
        if fr is not None:
            acc.fr.append(_fr_record(fr))
        fr = None

    for no, line in enumerate(lines, 1):
        if not line:
            continue
        if fr is None and not any(k in line for k in _LINE_KEYS):
            continue  # most of a rank's log: training output
        where = f"{name}:{no}"
        # fr_trace records: a start line, then `key: value` lines; anything else ends the record.
        stripped = line.strip()
        if (m := _FR_START.match(stripped)) is not None:
            close_fr()
            seq = m.group(1) or m.group(2)
            fr = {"where": where, "seq": int(seq) if seq else None, "missing_header": stripped.startswith("Not all")}
            continue
        if fr is not None:
            if (f := _FR_FIELD.match(stripped)) is not None:
                fr[f.group(1)] = f.group(2)
                continue
            if fr.get("collective stack trace") is not None and " at " in stripped:
                continue  # a frame of the collective's stack
            close_fr()
        prefixes = _PREFIX_RANK.findall(line)
        if len(prefixes) > 1 and len(set(prefixes)) > 1:
            interleaved += 1
            # Two ranks' lines on one: read each piece with its own prefix.
            pieces = re.split(r"(?=\[rank\d+\]:)", line)
            for piece in pieces:
                if piece.strip():
                    _read_line(piece, where, of_file, acc, quote, no)
            continue
        _read_line(line, where, of_file, acc, quote, no)
    close_fr()
    if quoted > _MAX_NOTES_PER_FILE:
        acc.notes.append(f"{name}: {quoted - _MAX_NOTES_PER_FILE} more line(s) not in a known shape")
    if interleaved:
        acc.notes.append(f"{name}: {interleaved} line(s) hold two ranks' output interleaved; each piece was read "
                         "for what it holds")
    last = lines[-1] if lines else ""
    if cut and (any(m in last for m in _LOG_MARKERS) or "ProcessGroupNCCL" in last or "WorkNCCL" in last):
        read = len(acc.watchdog) > start_wd and acc.watchdog[-1].where == f"{name}:{len(lines)}"
        acc.notes.append(f"{name}: the log ends mid-line (cut off) at line {len(lines)}: "
                         + ("read for what it holds" if read else f"too short to read: {last.strip()[-120:]!r}"))
    _tie_pgs(acc.watchdog, start_wd)


def _tie_pgs(records: list[WatchdogRecord], start: int) -> None:
    """A timeout line names no group; the same rank's status line for the same work does: take its group."""
    if all(r.pg for r in records[start:]):
        return
    pg_of: dict[tuple[int | None, int | None], str] = {}
    for r in records[start:]:
        if r.pg:
            pg_of.setdefault((r.rank, r.seq), r.pg)
    by_seq: dict[int | None, set[str]] = {}
    for (_, seq), pg in pg_of.items():
        by_seq.setdefault(seq, set()).add(pg)
    for i in range(start, len(records)):
        r = records[i]
        if not r.pg:
            # Else the one group whose other ranks fail at the same work, when there is one.
            only = by_seq.get(r.seq, set())
            pg = pg_of.get((r.rank, r.seq)) or (next(iter(only)) if len(only) == 1 and r.seq is not None else "")
            records[i] = WatchdogRecord(r.where, r.kind, r.rank, r.rank_how, pg or "its group",
                                        r.pg_rank, r.seq, r.op, r.enqueued, r.completed, r.timeout_ms, r.signalled_by,
                                        r.group_size)


def _read_line(line: str, where: str, file_rank: int | None, acc: _Acc, quote: object, no: int) -> None:
    has_work = "WorkNCCL(" in line
    has_last = "ast enqueued" in line
    has_dump = "Received a dump signal" in line or "dump signal from another rank" in line
    has_mm = "Detected mismatch between collectives" in line
    if not (has_work or has_last or has_dump or has_mm):
        return
    if has_mm:
        rep = _mismatch(line, where)
        if rep is None:
            quote(no, line, "a DETAIL mismatch line not in the known shape")  # type: ignore[operator]
        else:
            acc.mismatches.append(rep)
        return
    pm = _PREFIX_RANK.search(line)
    g = _PG.search(line)
    pg = ""
    pg_rank = None
    if g is not None:
        pg_rank = int(g.group(4))
        if g.group(1) is not None:
            pg = f"PG {g.group(1)}" + (f" ({g.group(3)})" if g.group(3) else "")
    rank: int | None
    if pm is not None:
        rank, how = int(pm.group(1)), "[rankN]: prefix"
    elif file_rank is not None:
        rank, how = file_rank, "file name"
    elif g is not None and (g.group(1) == "0" or g.group(3) == "default_pg"):
        rank, how = pg_rank, "default group rank"
    else:
        rank, how = None, "not given"
    seq = op = enq = comp = tmo = by = size = None
    kind = ""
    if has_work and (w := _WORK.search(line)) is not None and ("timeout" in line or "timed out" in line):
        seq, op = int(w.group(1)) if w.group(1) else None, w.group(2)
        tmo = int(w.group(5)) if w.group(5) else None
        size = _group_size(op, w.group(3), w.group(4))
        kind = "blocking-wait" if "blocking wait" in line.lower() else "timeout"
    if (s := _STATUS_NEW.search(line) or _STATUS_OLD.search(line)) is not None:
        seq, enq, comp = int(s.group(1)), int(s.group(2)), int(s.group(3))
        kind = "status"
    elif has_dump:
        d = _DUMP.search(line)
        last = _LAST.search(line)
        by = int(d.group(1)) if d is not None and d.group(1) else None
        if last is not None:
            enq, comp = int(last.group(1)), int(last.group(2))
        kind = "dump-signal"
    elif has_last and not kind:
        last = _LAST.search(line)
        if last is not None:
            enq, comp = int(last.group(1)), int(last.group(2))
            kind = "status"
    if not kind:
        if has_work and ("timeout" in line or "timed out" in line):
            quote(no, line, "a watchdog line not in the known shape")  # type: ignore[operator]
        return
    acc.watchdog.append(WatchdogRecord(where, kind, rank, how, pg, pg_rank, seq, op, enq, comp, tmo, by, size))


def _group_size(op: str, numel_in: str | None, numel_out: str | None) -> int | None:
    """An all-gather's output is its input times the group's size (a reduce-scatter's the other way round)."""
    if numel_in is None or numel_out is None:
        return None
    a, b = int(numel_in), int(numel_out)
    if "ALLGATHER" in op and a > 0 and b % a == 0 and b // a > 1:
        return b // a
    if "REDUCE_SCATTER" in op and b > 0 and a % b == 0 and a // b > 1:
        return a // b
    return None


def _fingerprint(rank: int, text: str) -> Fingerprint:
    seq = re.search(r"SequenceNumber=(\d+)", text)
    op = re.search(r"OpType=(\w+)", text)
    shape = re.search(r"TensorShape=\[([^\]]*)\]", text)
    dtype = re.search(r"TensorDtypes=(\w+)", text)
    bare = re.match(r"\s*([A-Z_]+)\b", text) if op is None else None
    return Fingerprint(rank, int(seq.group(1)) if seq else None,
                       op.group(1) if op else (bare.group(1) if bare else None),
                       shape.group(1) if shape else None, dtype.group(1) if dtype else None)


def readable_aspects(raw: str) -> str:
    """PyTorch's "Collectives differ in the following aspects" as a person reads it: ``op type ALLREDUCE vs
    BROADCAST, shapes [25] vs [1], dtypes Float vs Long``. Text in no known shape is kept, spaces normalised."""
    flat = re.sub(r"\s+", " ", raw).strip()
    parts = []
    for m in _ASPECT.finditer(flat):
        what = m.group(1).split()[-1] if m.group(1).startswith("Tensor") else m.group(1).lower()
        a, b = m.group(2).strip(" ,"), m.group(3).strip(" ,")
        if what == "shapes":
            a, b = (v if v.startswith("[") else f"[{v}]" for v in (a, b))
        parts.append(f"{what} {a} vs {b}")
    return ", ".join(parts) if parts else flat


def _mismatch(line: str, where: str) -> MismatchReport | None:
    m = _MISMATCH.search(line)
    if m is None:
        return None
    rest = line[m.end():]
    aspects = ""
    a = _ASPECTS.search(rest)
    if a is not None:
        aspects = readable_aspects(a.group(1))
        rest = rest[:a.start()]
    but = _BUT.search(rest)
    sides = [_fingerprint(int(m.group(1)), rest[:but.start()] if but else rest)]
    if but is not None:
        sides.append(_fingerprint(int(but.group(1)), rest[but.end():]))
    seq_is = _SEQ_IS.search(line)
    if seq_is is not None:
        sides = [Fingerprint(s.rank, s.seq if s.seq is not None else int(seq_is.group(1)), s.op, s.shape, s.dtype)
                 for s in sides]
    pm = _PREFIX_RANK.search(line[:m.start()])
    return MismatchReport(where, tuple(sides), aspects, int(pm.group(1)) if pm else None)


def _int_set(text: object) -> tuple[int, ...]:
    return tuple(sorted({int(x) for x in re.findall(r"-?\d+", str(text or ""))}))


def _fr_record(fr: dict[str, object]) -> FrCollective:
    err = str(fr.get("error msg") or "")
    c = _CULPRIT.search(err)
    seq = fr.get("seq")
    missing = _int_set(fr.get("missing ranks")) if fr.get("missing ranks") is not None else ()
    return FrCollective(
        where=str(fr["where"]), seq=seq if isinstance(seq, int) else None,
        pg=str(fr["group info"]) if fr.get("group info") else None,
        op=str(fr["collective"]) if fr.get("collective") else None,
        missing_ranks=missing, expected_ranks=_int_set(fr.get("expected ranks")),
        culprit=int(c.group(1)) if c else None, error_type=c.group(2) if c else None,
        expected_state=c.group(3) if c else None, found_state=c.group(4) if c else None, error=err[:300])
