"""NCCL RAS reports (NCCL >= 2.24): the `ncclras` text status, and its JSON (`ncclras -f json`, NCCL >= 2.28.7).

Text: a job summary (nodes, processes, GPUs), a communicators table (group,
communicators in it, nodes, ranks, status RUNNING/ABORT/NOCOMM..., errors
OK/MISMATCH/INCOMPLETE...), then Errors/Warnings blocks: a job-level
INCOMPLETE ("Missing communicator data from N job process(es)", then
"Process P on node H managing GPU g" lines) and DEAD ("N job process(es)
... considered dead"), and per-communicator blocks ``#G-C (hash) ERRORS``
with "Missing communicator data from N rank(s)", "Communicator ranks have
different OP operation counts", "N ranks have launched up to operation V"
(the rank lines after it are that group's), "Rank R has launched up to
operation V -- GPU g managed by process P on node H" (a group of one).

JSON: ``communicators[]`` with ``size``, ``ranks[]`` (rank, host, pid,
cuda_dev, status, collective_counts per operation) and ``missing_ranks[]``
(unresponsive, considered_dead).

Both become ``analyzers.log_evidence.RasReport``; ranks are the communicator
ranks RAS prints (global ranks only when the communicator is the whole job,
which the rules decide). Lines of a block the reader does not know are
quoted in the notes; a report cut off is read for what it holds and flagged.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from rankscope.contract.log_records import RasComm, RasCount, RasRank, RasReport, RasRow

_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+([A-Z_]+)\s+([A-Z_,]+)\s*$")
_COMM = re.compile(r"^#(\d+-\d+)\s+\(([^()\s]*)\)\s+([A-Z_,]+)\s*$")  # (a hash a paste may shorten: "78db…")
_MISSING_PROCS = re.compile(r"Missing communicator data from (\d+) job process")
_MISSING_RANKS = re.compile(r"Missing communicator data from (\d+) rank")
_DEAD = re.compile(r"(\d+) job process(?:es)? (?:is|are) considered dead")
_PROC = re.compile(r"Process (\d+) on node (\S+) managing GPUs? (\S+)")
_DIFFERENT = re.compile(r"Communicator ranks have different (\S+) operation counts")
_GROUP = re.compile(r"(\d+) ranks have (?:launched up to operation (\d+)|not launched any operations)")
_RANK = re.compile(r"Rank (\d+)(?: has (?:status (\S+)|launched up to operation (\d+)|(not launched any operations)))?"
                   r"\s+--\s+(?:GPU (\S+) managed by process (\d+) on node (\S+)|\[process information not found\])")
_MAX_QUOTED = 5

HEADLINE_MARKERS = ("Communicators...", "Job summary\n===", "ranks have launched up to operation",
                    "Missing communicator data from", "has launched up to operation",
                    "Communicator ranks have different", "job process considered dead",
                    "job processes are considered dead")
# A communicator block's first line alone (a paste of the "Errors" or "Warnings" part of a report).
_COMM_LINE = re.compile(r"(?m)^\s*#\d+-\d+\s+\([^()\s]*\)\s+(?:MISMATCH|INCOMPLETE|ERROR)")


def looks_like_ras_text(head: str) -> bool:
    """RAS text anywhere in ``head``: the whole report, or only the block a person copied out of it."""
    return ("Job summary" in head and ("Communicators" in head or "Errors\n" in head)) \
        or any(m in head for m in HEADLINE_MARKERS[2:]) or ("#" in head and _COMM_LINE.search(head) is not None)


def json_start(text: str) -> int:
    """Where a JSON object starts in ``text``: at its first character, or at the first line that opens one (a status
    word, a prompt or a shell echo pasted above it). -1 when no line opens one."""
    if text.lstrip()[:1] == "{":
        return len(text) - len(text.lstrip())
    m = re.search(r"(?m)^[ \t]*\{", text)
    return m.end() - 1 if m is not None else -1


def looks_like_ras_json(head: str) -> bool:
    if '"communicators"' not in head:
        return False
    at = json_start(head)
    body = head[at:] if at >= 0 else ""
    return at >= 0 and '"communicators"' in body and (
        '"nccl_version"' in body or '"collective_counts"' in body or '"missing_ranks_count"' in body)


def _total_processes(lines: Sequence[str], start: int) -> int | None:
    """The job's process count from a job-summary table: the number under a "Processes" "(total)" header."""
    for i in range(start, min(start + 20, len(lines) - 2)):
        top, sub, row = lines[i], lines[i + 1], lines[i + 2]
        if "Processes" not in top or not row.strip() or not row.split()[0].isdigit():
            continue
        for m in re.finditer(r"Processes", top):
            end = m.end()
            if "total" not in sub[max(0, end - 9):end + 1]:
                continue
            for n in re.finditer(r"\d+", row):
                if abs(n.end() - end) <= 1:
                    return int(n.group())
    return None


def parse_ras_text(text: str, where: str) -> tuple[RasReport, list[str]]:
    """One `ncclras` text report → RasReport, and notes on what was not read."""
    lines = text.splitlines()
    notes: list[str] = []
    rows: list[RasRow] = []
    comms: list[RasComm] = []
    missing_procs: list[RasRank] = []
    dead_procs: list[RasRank] = []
    missing_proc_count = dead_count = 0
    processes: int | None = None
    block: str | None = None  # "INCOMPLETE", "DEAD", or a communicator label
    cur: dict[str, object] = {}
    op: str | None = None
    counts: list[RasCount] = []
    context = ""  # what the rank lines below belong to: "missing", "count", "status"

    def close() -> None:
        nonlocal cur, counts, op
        if cur:
            label = str(cur["label"])
            if label not in sizes and counts and not rows:
                # No table (an excerpt): RAS prints every count of an operation, so their sum and the missing ranks
                # are the communicator's size.
                first = counts[0].op
                sizes[label] = sum(c.count for c in counts if c.op == first) + int(cur["missing_count"])  # type: ignore[call-overload]
            comms.append(RasComm(
                label=str(cur["label"]), where=str(cur["where"]), errors=tuple(cur["errors"]),  # type: ignore[arg-type]
                counts=tuple(counts), missing=tuple(cur["missing"]),  # type: ignore[arg-type]
                missing_count=int(cur["missing_count"]),  # type: ignore[call-overload]
                statuses=tuple(cur["statuses"]),  # type: ignore[arg-type]
                size=sizes.get(str(cur["label"]))))
        cur, counts, op = {}, [], None

    sizes: dict[str, int] = {}
    row_sizes: dict[int, int] = {}
    quoted = 0
    for no, raw in enumerate(lines, 1):
        line = raw.rstrip()
        s = line.strip()
        at = f"{where}:{no}"
        if not s or set(s) <= {"="}:
            continue
        if s.startswith("Job summary"):
            processes = _total_processes(lines, no)
            continue
        if (m := _ROW.match(line)) is not None:
            row = RasRow(int(m.group(1)), int(m.group(2)), int(m.group(5)), m.group(7), tuple(m.group(8).split(",")))
            rows.append(row)
            row_sizes[row.group] = row.ranks_per_comm
            continue
        if s in ("Errors", "Warnings"):
            close()
            block = None
            continue
        if s in ("INCOMPLETE", "DEAD"):
            close()
            block = s
            continue
        if (m := _COMM.match(s)) is not None:
            close()
            label = f"#{m.group(1)} ({m.group(2)})"
            group = int(m.group(1).split("-")[0])
            if group in row_sizes:
                sizes[label] = row_sizes[group]
            block = label
            cur = {"label": label, "where": at, "errors": m.group(3).split(","), "missing": [], "missing_count": 0,
                   "statuses": []}
            continue
        if block is None:
            if _MISSING_PROCS.search(s) or _PROC.search(s):
                block = "INCOMPLETE"  # a job-level block pasted without its header
            elif _MISSING_RANKS.search(s) or _DIFFERENT.search(s) or _GROUP.search(s) or _RANK.search(s) \
                    or "have different status" in s:
                # A communicator block's lines pasted without its "#G-C (hash)" line: read as one communicator.
                block = "#? (its header line is not in the paste)"
                cur = {"label": block, "where": at, "errors": [], "missing": [], "missing_count": 0, "statuses": []}
                notes.append(f"{at}: a communicator block without its '#G-C (hash)' line: read as one communicator")
            else:
                continue
        if block in ("INCOMPLETE", "DEAD"):
            if (m := _MISSING_PROCS.search(s)) is not None:
                missing_proc_count = int(m.group(1))
            elif (m := _DEAD.search(s)) is not None:
                dead_count = int(m.group(1))
            elif (m := _PROC.search(s)) is not None:
                proc = RasRank(None, m.group(3), int(m.group(1)), m.group(2))
                (missing_procs if block == "INCOMPLETE" else dead_procs).append(proc)
            elif quoted < _MAX_QUOTED:
                quoted += 1
                notes.append(f"{at}: not a RAS line this reader knows, skipped: {s[:160]!r}")
            continue
        if (m := _MISSING_RANKS.search(s)) is not None:
            cur["missing_count"] = int(m.group(1))
            context = "missing"
        elif (m := _DIFFERENT.search(s)) is not None:
            op, context = m.group(1), "count"
        elif "have different status" in s:
            context = "status"
        elif (m := _GROUP.search(s)) is not None and not s.startswith("Rank"):
            counts.append(RasCount(op or "?", int(m.group(2)) if m.group(2) else None, int(m.group(1))))
        elif (m := _RANK.search(s)) is not None:
            rank = RasRank(int(m.group(1)), m.group(5), int(m.group(6)) if m.group(6) else None, m.group(7),
                           m.group(2))
            if context == "missing":
                cur["missing"].append(rank)  # type: ignore[attr-defined]
            elif context == "status" or m.group(2):
                cur["statuses"].append(rank)  # type: ignore[attr-defined]
            elif m.group(3) or m.group(4):  # a group of one, with its own value
                counts.append(RasCount(op or "?", int(m.group(3)) if m.group(3) else None, 1, (rank,)))
            elif counts:
                last = counts[-1]
                counts[-1] = RasCount(last.op, last.value, last.count, (*last.listed, rank))
        elif quoted < _MAX_QUOTED:
            quoted += 1
            notes.append(f"{at}: not a RAS line this reader knows, skipped: {s[:160]!r}")
    close()
    complete = bool(lines) and not text.endswith(("--", "-- ")) and bool(text.endswith("\n") or rows)
    # A communicator block that promises N missing ranks and lists fewer, or a table with a row whose block is
    # absent, is what a report cut off looks like.
    cut = any(c.missing_count > len(c.missing) and c is comms[-1] for c in comms)
    return RasReport(where, processes, tuple(rows), tuple(comms), tuple(missing_procs), missing_proc_count,
                     tuple(dead_procs), dead_count, complete and not cut), notes


def parse_ras_json(text: str, where: str) -> tuple[RasReport, list[str]]:
    """`ncclras -f json` → RasReport. Raises ValueError (with what is wrong) when it is not that JSON.

    Lines before the JSON object and text after it (a prompt, a status word) are skipped and said in the notes."""
    at = json_start(text)
    if at < 0:
        raise ValueError("no line opens a JSON object")
    doc, end = json.JSONDecoder().raw_decode(text, at)
    skipped = []
    if text[:at].strip():
        skipped.append(f"{where}: {text[:at].count(chr(10))} line(s) before the JSON skipped (not RAS output): "
                       f"{text[:at].strip()[:80]!r}")
    if text[end:].strip():
        skipped.append(f"{where}: text after the JSON skipped: {text[end:].strip()[:80]!r}")
    if not isinstance(doc, dict) or not isinstance(doc.get("communicators"), list):
        raise ValueError("a JSON object without a `communicators` list")
    notes: list[str] = skipped
    comms: list[RasComm] = []
    for i, c in enumerate(doc["communicators"]):
        if not isinstance(c, dict):
            notes.append(f"{where}: communicators[{i}] is not an object, skipped")
            continue
        label = f"#{i} ({c.get('hash', '?')})"
        values: dict[str, dict[int | None, list[RasRank]]] = {}
        statuses: list[RasRank] = []
        for r in _list(c.get("ranks")):
            if not isinstance(r, dict) or not isinstance(r.get("rank"), int):
                continue
            rank = _json_rank(r)
            st = r.get("status") if isinstance(r.get("status"), dict) else {}
            if isinstance(st, dict) and (st.get("abort_flag") is True or st.get("async_error") not in (None, 0)):
                statuses.append(RasRank(rank.comm_rank, rank.gpu, rank.pid, rank.host,
                                        "ABORTED" if st.get("abort_flag") else f"async error {st.get('async_error')}"))
            cc = r.get("collective_counts")
            if isinstance(cc, dict):
                for op, v in cc.items():
                    if isinstance(v, int) and not isinstance(v, bool):
                        values.setdefault(str(op), {}).setdefault(v or None, []).append(rank)
        counts = [RasCount(op, v, len(rs), tuple(rs)) for op, by_v in values.items() if len(by_v) > 1
                  for v, rs in by_v.items()]
        raw_missing = [m for m in _list(c.get("missing_ranks")) if isinstance(m, dict)]
        missing = [_json_rank(m) for m in raw_missing]
        dead = [m for m, raw in zip(missing, raw_missing, strict=True)
                if isinstance(raw.get("status"), dict) and raw["status"].get("considered_dead")]
        for d in dead:
            notes.append(f"{where}: {d.label()} of {label} is considered dead by RAS")
        size = c.get("size") if isinstance(c.get("size"), int) else None
        mc = c.get("missing_ranks_count")
        comms.append(RasComm(label, f"{where} communicators[{i}]",
                             ("MISMATCH",) if counts else ("INCOMPLETE",) if missing else ("OK",), size,
                             tuple(counts), tuple(missing), mc if isinstance(mc, int) else len(missing),
                             tuple(statuses)))
    # The JSON has no table: one row per communicator, ABORT where a rank aborted or has an async error.
    rows = tuple(RasRow(i, 1, c.size or 0, "ABORT" if c.statuses else "RUNNING", c.errors) for i, c in enumerate(comms))
    sizes = [c.size for c in comms if c.size]
    return RasReport(where, max(sizes) if sizes else None, rows, tuple(comms)), notes


def _list(x: object) -> list[object]:
    return x if isinstance(x, list) else []


def _json_rank(r: dict[str, object]) -> RasRank:
    rank = r.get("rank")
    pid = r.get("pid")
    dev = r.get("cuda_dev")
    host = r.get("host")
    return RasRank(rank if isinstance(rank, int) else None, str(dev) if isinstance(dev, int) else None,
                   pid if isinstance(pid, int) else None, host if isinstance(host, str) else None)
