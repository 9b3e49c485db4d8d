"""PyTorch flight recorder dumps as CCL counters: `rankscope analyze --flight-recorder DIR`.

Why: a job that was not started under `rankscope run` may still have torch's
flight recorder on (``TORCH_FR_BUFFER_SIZE``), and its per-rank dumps hold the
same facts the counters do. Each dump's entries become, per process group and
op, CL (entries recorded), WR (the same: one work item per entry) and WC
(entries retired or completed); ``pg_config`` gives members and descriptions;
``pg_status`` is kept as notes. The CCL analyzer then names the rank whose
launches lag (the one that never entered the collective the others wait in).

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
from pathlib import Path
from typing import Any

from rankscope.analyzers.ccl import analyze_counters
from rankscope.analyzers.findings import Verdict
from rankscope.errors import RankscopeError
from rankscope.snapshot import (
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


def load_dir(directory: Path) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """Every readable dump in ``directory`` by rank, and a note per file that was not."""
    if not directory.is_dir():
        raise RankscopeError(f"{directory} is not a directory",
                             "pass the folder the ranks dumped into (TORCH_FR_DUMP_TEMP_FILE's folder)")
    dumps: dict[int, dict[str, Any]] = {}
    notes: list[str] = []
    for path in sorted(p for p in directory.iterdir() if p.is_file()):
        rank = rank_of(path)
        if rank is None:
            continue
        try:
            data = load_dump(path)
        except (OSError, ValueError, pickle.UnpicklingError, EOFError, UnicodeDecodeError) as exc:
            notes.append(f"{path.name}: unreadable flight recorder dump ({type(exc).__name__}: {exc})")
            continue
        if rank in dumps:
            notes.append(f"{path.name}: a second dump for rank {rank}, ignored")
            continue
        dumps[rank] = data
    if not dumps:
        raise RankscopeError(f"no flight recorder dumps in {directory}" + (f" ({'; '.join(notes)})" if notes else ""),
                             "set TORCH_FR_BUFFER_SIZE=2000 in the job and dump with "
                             "torch._C._distributed_c10d._dump_fr_trace() or on timeout")
    return dumps, notes


def _op_name(entry: Mapping[str, Any]) -> str:
    name = str(entry.get("profiling_name") or "unknown")
    name = name.split(":", 1)[1] if ":" in name else name
    return name.split(" ", 1)[0]


def _nbytes(entry: Mapping[str, Any]) -> int:
    total = 0
    for shape, dtype in zip(entry.get("input_sizes") or [], entry.get("input_dtypes") or [], strict=False):
        n = 1
        for d in shape or []:
            n *= int(d)
        total += n * _DTYPE_BYTES.get(str(dtype), 4)
    return total


def _members(pg_config: Mapping[str, Any], name: str) -> tuple[int, ...] | None:
    cfg = pg_config.get(name)
    if not isinstance(cfg, Mapping):
        return None
    ranks = cfg.get("ranks")
    try:
        got = json.loads(ranks) if isinstance(ranks, str) else ranks
        members = tuple(int(r) for r in got or ())
    except (ValueError, TypeError):
        return None
    return members or None


def dumps_to_counters(dumps: Mapping[int, Mapping[str, Any]]) -> tuple[tuple[RankCounters, ...], list[str]]:
    """Each rank's dump as counters; notes say what had to be inferred."""
    notes: list[str] = []
    # which ranks recorded each group: members when pg_config does not say
    seen_in: dict[str, set[int]] = {}
    for rank, dump in dumps.items():
        for e in dump.get("entries") or []:
            pg = e.get("process_group") or ("?", "")
            seen_in.setdefault(str(pg[0]), set()).add(rank)
    all_ranks = tuple(sorted(dumps))
    out: list[RankCounters] = []
    for rank, dump in sorted(dumps.items()):
        pg_config = dump.get("pg_config") or {}
        comms: dict[str, Communicator] = {}
        rows: dict[tuple[str, str], dict[str, Any]] = {}
        last_wall = 0.0
        for e in dump.get("entries") or []:
            pg = e.get("process_group") or ("?", "")
            name, desc = str(pg[0]), str(pg[1] if len(pg) > 1 else "")
            if name not in comms:
                members = _members(pg_config, name)
                if members is None:
                    members = all_ranks if desc == "default_pg" else tuple(sorted(seen_in.get(name, {rank})))
                comms[name] = Communicator(name, "flight_recorder", desc, members)
            p2p = bool(e.get("is_p2p"))
            op = _op_name(e)
            seq = int(e.get("p2p_seq_id" if p2p else "collective_seq_id") or 0)
            done = bool(e.get("retired")) or e.get("state") == "completed"
            row = rows.setdefault((name, op), {"cl": 0, "wc": 0, "lls": 0, "lcs": 0, "bytes": 0, "td": None,
                                               "launch": None, "complete": None})
            row["cl"] += 1
            row["bytes"] += _nbytes(e)
            row["lls"] = max(row["lls"], seq)
            created = float(e.get("time_created_ns") or 0) / 1e9
            row["launch"] = created or row["launch"]
            last_wall = max(last_wall, created)
            if done:
                row["wc"] += 1
                row["lcs"] = max(row["lcs"], seq)
                finished = float(e.get("time_discovered_completed_ns") or 0) / 1e9
                if finished and created:
                    row["td"] = finished - created
                    row["complete"] = finished
        ops = tuple(OpCounters(comm_id=name, op=op, cl=r["cl"], wr=r["cl"], wc=r["wc"], last_launched_seq=r["lls"],
                               last_completed_seq=r["lcs"], bytes_total=r["bytes"], last_duration_s=r["td"],
                               last_launch_wall=r["launch"], last_complete_wall=r["complete"])
                    for (name, op), r in rows.items())
        first = (dump.get("entries") or [{}])[0]
        if int(first.get("record_id") or 0) > 0:
            notes.append(f"rank {rank}: the recorder's buffer wrapped (first record {first.get('record_id')}); "
                         "counts cover its last entries only")
        status = dump.get("pg_status") or {}
        for pg_id, st in sorted(status.items()) if isinstance(status, Mapping) else ():
            if isinstance(st, Mapping):
                notes.append(f"rank {rank}: pg {pg_id} last enqueued {st.get('last_enqueued_collective')}, "
                             f"completed {st.get('last_completed_collective')}")
        out.append(RankCounters(rank=rank, pid=None, world_size=len(all_ranks), job_id=None,
                                heartbeat_wall=last_wall or None, communicators=tuple(comms.values()), ops=ops))
    return tuple(out), notes


def analyze_flight_recorder_dir(path: Path, layout: Layout | None) -> tuple[JobSnapshot, Verdict]:
    """Read a folder of per-rank dumps; the snapshot carries their counters, the verdict names the suspects."""
    dumps, notes = load_dir(path)
    counters, more = dumps_to_counters(dumps)
    notes += more
    expected: set[int] = set()
    for c in counters:
        for comm in c.communicators:
            expected.update(comm.ranks)
    missing = sorted(expected - set(dumps))
    if missing:
        notes.append(f"no dump for rank(s) {', '.join(map(str, missing))}")
    now = Instant(time.time(), time.monotonic())
    ranks = tuple(RankInfo(rank=c.rank, local_rank=c.rank, world_size=len(dumps), pid=0) for c in counters)
    machine = MachineSnapshot(MACHINE, str(path), True, now, ranks=ranks, counters=counters)
    snapshot = JobSnapshot(now, (machine,), layout=layout, notes=tuple(notes))
    verdict = analyze_counters(snapshot, layout)
    return snapshot, Verdict(verdict.suspects, verdict.summary, tuple(sorted(set(verdict.missing_ranks) | set(missing))),
                             verdict.notes + tuple(notes))
