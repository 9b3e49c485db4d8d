"""PyTorch flight recorder dumps as CCL counters: `rankscope analyze --flight-recorder DIR`.

Why: a job that was not started under `rankscope run` may still have torch's
flight recorder on (``TORCH_FR_BUFFER_SIZE``), and its per-rank dumps hold the
same facts the counters do. Each dump's entries become, per process group and
op, CL (entries recorded), WR (the same: one work item per entry) and WC
(entries retired or completed); ``pg_config`` gives members and descriptions;
``pg_status`` is kept as notes. The CCL analyzer then names the rank whose
launches lag (the one that never entered the collective the others wait in).
Beside the counters, ``rankscope.analyzers.flight_recorder`` compares the
entries themselves across ranks (op types, sizes, dtypes, states, missing
ranks, the laggard wavefront, damaged dumps): its findings ride on the verdict.

Dumps are read as JSON (``_dump_fr_trace_json``) or pickle (the default
dump). The pickle reader accepts only plain containers and scalars, so a
crafted file cannot run code. A rank comes from the digits that end the file
name (``nccl_trace_rank_3``, ``rank3.json``), as torch's own loader does.
"""

from __future__ import annotations

import io
import json
import pickle
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rankscope.analyzers.ccl import analyze_counters
from rankscope.analyzers.findings import Verdict, VerdictStatus
from rankscope.analyzers.flight_recorder import SERIOUS, FrAnalysis, analyze_dumps
from rankscope.contract.errors import RankscopeError
from rankscope.contract.fr_records import parse_members, read_entry
from rankscope.contract.snapshot import (
    Communicator,
    Instant,
    JobSnapshot,
    Layout,
    MachineSnapshot,
    OpCounters,
    RankCounters,
    RankInfo,
)

MACHINE = "flight-recorder"
_RANK = re.compile(r"(\d+)$")
_DTYPE_BYTES = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2, "Char": 1,
                "Byte": 1, "Bool": 1, "ComplexFloat": 8, "ComplexDouble": 16}


# What decoding damaged bytes raises: pickle's decoder alone has a handful (found by fuzzing).
_UNREADABLE = (OSError, ValueError, pickle.UnpicklingError, EOFError, OverflowError, IndexError, KeyError,
               TypeError, AttributeError, RecursionError, MemoryError)


class _PlainUnpickler(pickle.Unpickler):
    """Flight recorder dumps are dicts, lists, tuples, strings and numbers: allow nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a dump")


def load_dump(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    data = json.loads(raw) if raw[:1] in (b"{", b"[") else _PlainUnpickler(io.BytesIO(raw)).load()
    if not isinstance(data, dict) or "entries" not in data:
        raise ValueError("not a flight recorder dump (no 'entries')")
    return data


def rank_of(path: Path) -> int | None:
    stem = path.name.split(".", 1)[0]
    m = _RANK.search(stem)
    return int(m.group(1)) if m else None


def looks_like_dump(path: Path) -> bool:
    """Whether a file starts as a flight recorder dump does: a pickle, or a JSON object with its keys.

    Only the first bytes are read: enough to tell a folder of these from
    saved py-spy dumps (text, or a JSON list) and from a rankscope bundle.
    """
    try:
        with path.open("rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    if head[:1] == b"\x80":  # pickle protocol 2 or later (PROTO and its number, then more): torch's default dump
        return len(head) > 2 and 2 <= head[1] <= pickle.HIGHEST_PROTOCOL
    return (head.lstrip()[:1] == b"{" and b'"rankscope.bundle"' not in head
            and any(key in head for key in (b'"entries"', b'"pg_config"', b'"pg_status"')))


def holds_dumps(directory: Path) -> bool:
    """A folder whose rank-named files (the first few) all look like flight recorder dumps."""
    try:
        named = [p for p in sorted(directory.iterdir()) if p.is_file() and rank_of(p) is not None][:8]
    except OSError:
        return False
    return bool(named) and all(looks_like_dump(p) for p in named)


def load_dir(directory: Path) -> tuple[dict[int, dict[str, Any]], list[str], dict[int, str]]:
    """Every readable dump in ``directory`` by rank, a note per file that was not, and why by rank."""
    if not directory.is_dir():
        raise RankscopeError(f"{directory} is not a directory",
                             "pass the folder the ranks dumped into (TORCH_FR_DUMP_TEMP_FILE's folder)")
    dumps: dict[int, dict[str, Any]] = {}
    notes: list[str] = []
    unreadable: dict[int, str] = {}
    for path in sorted(p for p in directory.iterdir() if p.is_file()):
        rank = rank_of(path)
        if rank is None:
            continue
        try:
            data = load_dump(path)
        except _UNREADABLE as exc:
            notes.append(f"{path.name}: unreadable flight recorder dump ({type(exc).__name__}: {exc})")
            unreadable[rank] = f"{path.name}: {type(exc).__name__}: {exc}"
            continue
        if rank in dumps:
            notes.append(f"{path.name}: a second dump for rank {rank}, ignored")
            continue
        dumps[rank] = data
    if not dumps:
        raise RankscopeError(f"no flight recorder dumps in {directory}" + (f" ({'; '.join(notes)})" if notes else ""),
                             "set TORCH_FR_BUFFER_SIZE=2000 in the job and dump with "
                             "torch._C._distributed_c10d._dump_fr_trace() or on timeout")
    return dumps, notes, {r: why for r, why in unreadable.items() if r not in dumps}


def _nbytes(entry: Mapping[str, Any]) -> int:
    op, _ = read_entry(entry, 0)
    if op is None or not op.input_sizes:
        return 0
    total = 0
    for shape, dtype in zip(op.input_sizes, op.input_dtypes or (), strict=False):
        n = 1
        for d in shape:
            n *= d
        total += n * _DTYPE_BYTES.get(dtype, 4)
    return total


def _members(pg_config: Any, name: str) -> tuple[int, ...] | None:
    cfg = pg_config.get(name) if isinstance(pg_config, Mapping) else None
    return parse_members(cfg.get("ranks")) if isinstance(cfg, Mapping) else None


def _seconds(value: Any) -> float:
    return float(value) / 1e9 if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def _entries(dump: Any) -> list[Any]:
    got = dump.get("entries") if isinstance(dump, Mapping) else None
    return list(got) if isinstance(got, list | tuple) else []


def dumps_to_counters(dumps: Mapping[int, Mapping[str, Any]]) -> tuple[tuple[RankCounters, ...], list[str]]:
    """Each rank's dump as counters; notes say what had to be inferred.

    Entries the analyzer cannot read (no process group, op name or sequence
    id) are left out here; its ``fr-malformed-entry`` finding reports them.
    """
    notes: list[str] = []
    parsed = {rank: [(e, op) for e in _entries(dump) for op in [read_entry(e, rank)[0]] if op is not None]
              for rank, dump in dumps.items()}
    # which ranks recorded each group: members when pg_config does not say
    seen_in: dict[str, set[int]] = {}
    for rank, pairs in parsed.items():
        for _, op in pairs:
            seen_in.setdefault(op.pg_name, set()).add(rank)
    all_ranks = tuple(sorted(dumps))
    out: list[RankCounters] = []
    for rank, dump in sorted(dumps.items()):
        pg_config = dump.get("pg_config") if isinstance(dump, Mapping) else None
        comms: dict[str, Communicator] = {}
        rows: dict[tuple[str, str], dict[str, Any]] = {}
        last_wall = 0.0
        for e, fr in parsed[rank]:
            name, desc = fr.pg_name, fr.pg_desc
            if name not in comms:
                members = _members(pg_config, name)
                if members is None:
                    members = all_ranks if desc == "default_pg" else tuple(sorted(seen_in.get(name, {rank})))
                comms[name] = Communicator(name, "flight_recorder", desc, members)
            done = e.get("retired") is True or fr.state == "completed"
            row = rows.setdefault((name, fr.op), {"cl": 0, "wc": 0, "lls": 0, "lcs": 0, "bytes": 0, "td": None,
                                                  "launch": None, "complete": None})
            row["cl"] += 1
            row["bytes"] += _nbytes(e)
            row["lls"] = max(row["lls"], fr.seq)
            created = _seconds(e.get("time_created_ns"))
            row["launch"] = created or row["launch"]
            last_wall = max(last_wall, created)
            if done:
                row["wc"] += 1
                row["lcs"] = max(row["lcs"], fr.seq)
                finished = _seconds(e.get("time_discovered_completed_ns"))
                if finished and created:
                    row["td"] = finished - created
                    row["complete"] = finished
        ops = tuple(OpCounters(comm_id=name, op=op, cl=r["cl"], wr=r["cl"], wc=r["wc"], last_launched_seq=r["lls"],
                               last_completed_seq=r["lcs"], bytes_total=r["bytes"], last_duration_s=r["td"],
                               last_launch_wall=r["launch"], last_complete_wall=r["complete"])
                    for (name, op), r in rows.items())
        status = dump.get("pg_status") if isinstance(dump, Mapping) else None
        for pg_id, st in sorted(status.items(), key=lambda kv: str(kv[0])) if isinstance(status, Mapping) else ():
            if isinstance(st, Mapping):
                notes.append(f"rank {rank}: pg {pg_id} last enqueued {st.get('last_enqueued_collective')}, "
                             f"completed {st.get('last_completed_collective')}")
        out.append(RankCounters(rank=rank, pid=None, world_size=len(all_ranks), job_id=None,
                                heartbeat_wall=last_wall or None, communicators=tuple(comms.values()), ops=ops))
    return tuple(out), notes


@dataclass(frozen=True, slots=True)
class FlightRecorderReport:
    """What a folder of dumps gave: counters as a snapshot, the verdict (with findings), the comparison."""

    snapshot: JobSnapshot
    verdict: Verdict
    analysis: FrAnalysis


def read_flight_recorder_dir(path: Path, layout: Layout | None) -> FlightRecorderReport:
    """Read a folder of per-rank dumps; the counters name lag suspects, the entries' comparison gives findings."""
    dumps, notes, unreadable = load_dir(path)
    analysis = analyze_dumps(dumps, unreadable)
    counters, more = dumps_to_counters(dumps)
    notes += more
    expected: set[int] = set()
    for c in counters:
        for comm in c.communicators:
            expected.update(comm.ranks)
    expected.update(unreadable)
    for w in analysis.wavefront:
        expected.update(w.members)
    missing = sorted(expected - set(dumps))
    if missing:
        notes.append(f"no dump for rank(s) {', '.join(map(str, missing))}")
    now = Instant(time.time(), time.monotonic())
    ranks = tuple(RankInfo(rank=c.rank, local_rank=c.rank, world_size=len(dumps), pid=0) for c in counters)
    machine = MachineSnapshot(MACHINE, str(path), True, now, ranks=ranks, counters=counters)
    snapshot = JobSnapshot(now, (machine,), layout=layout, notes=tuple(notes))
    verdict = analyze_counters(snapshot, layout)
    summary, status = verdict.summary, verdict.status
    serious = [f for f in analysis.findings if f.kind in SERIOUS]
    if serious and not verdict.suspects:  # counters agree, the entries do not: say so in the headline
        others = f" (+{len(serious) - 1} more finding(s))" if len(serious) > 1 else ""
        summary, status = f"flight recorder: {serious[0].summary}{others}", VerdictStatus.NAMED
    verdict = Verdict(verdict.suspects, summary, tuple(sorted(set(verdict.missing_ranks) | set(missing))),
                      verdict.notes + tuple(notes), findings=verdict.findings + analysis.findings, status=status)
    return FlightRecorderReport(snapshot, verdict, analysis)


def analyze_flight_recorder_dir(path: Path, layout: Layout | None) -> tuple[JobSnapshot, Verdict]:
    """Read a folder of per-rank dumps; the snapshot carries their counters, the verdict names the suspects."""
    report = read_flight_recorder_dir(path, layout)
    return report.snapshot, report.verdict
