"""Reading per-operation timing traces (``rankscope analyze --op-trace``) for ``analyzers.optrace``.

The trace is a parquet file in the schema of ByteDance-Seed/StragglerAnalysis
(one row per operation of a worker: ``dp_rank, stage, rank, step, optype,
start_ts, duration, …``), optionally with its job metadata (``meta-*.yaml``:
``dp_size``, ``pp_size``, ``tp_size``, ``world_size``, …). Reading parquet
needs pyarrow, an optional extra (``pip install 'rankscope[traces]'``); a CSV
with the same columns needs nothing.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from rankscope.contract.errors import RankscopeError

INSTALL_FIX = "install the optional extra: pip install 'rankscope[traces]' (or pip install pyarrow)"


def looks_like_op_trace(path: Path) -> bool:
    """A parquet file (its magic bytes), or a CSV whose header names the trace's columns: read as an op trace."""
    try:
        with path.open("rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    if head[:4] == b"PAR1":
        return True
    header = head.split(b"\n", 1)[0].lower()
    return path.suffix.lower() == ".csv" and b"optype" in header and b"duration" in header


def read_op_trace(path: Path) -> dict[str, Any]:
    """The trace's columns by name (numpy arrays from parquet, lists of strings from CSV)."""
    if not path.is_file():
        raise RankscopeError(f"--op-trace {path}: no such file", "pass the path of a trace-*.parquet (or .csv) file")
    if path.suffix.lower() == ".csv":
        try:
            with path.open(newline="", encoding="utf-8") as f:
                rows = list(csv.DictReader(f))
        except (OSError, UnicodeDecodeError, csv.Error) as exc:
            raise RankscopeError(f"--op-trace {path}: unreadable CSV: {exc}", "pass a CSV with a header row") from None
        names = list(rows[0]) if rows else []
        return {n: [r[n] for r in rows] for n in names}
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise RankscopeError(f"reading {path} needs pyarrow, which is not installed", INSTALL_FIX) from None
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises its own error types for every kind of bad file
        raise RankscopeError(f"--op-trace {path}: not a readable parquet file ({type(exc).__name__}: {exc})",
                             "pass a trace-*.parquet file as written by pandas/pyarrow") from None
    return {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}


def read_trace_meta(path: Path) -> dict[str, str]:
    """``key: value`` lines of a job metadata file (the flat YAML the traces come with)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RankscopeError(f"--trace-meta {path}: unreadable: {exc}", "pass the meta-*.yaml next to the trace") from None
    meta: dict[str, str] = {}
    for i, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        key, sep, value = line.partition(":")
        if not sep or not key.strip():
            raise RankscopeError(f"--trace-meta {path}: line {i} is not 'key: value': {line[:60]!r}",
                                 "pass the flat meta-*.yaml that came with the trace")
        meta[key.strip()] = value.strip()
    return meta
