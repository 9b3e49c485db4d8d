"""What a path given for an incident holds, told by its content: the argument needs no flag.

``rankscope analyze PATH`` reads whatever it is, and ``rankscope attach
--bundle PATH`` opens what the TUI can show and names the command for the
rest. Only first bytes are read (a few files of a folder), never a whole dump.
"""

from __future__ import annotations

import re
from pathlib import Path

from rankscope.contract.bundle import FORMAT
from rankscope.formats.crash_logs import any_crash_file
from rankscope.formats.flight_recorder import holds_dumps, looks_like_dump
from rankscope.formats.incident_logs import any_log_file, is_log_file
from rankscope.formats.optrace_io import looks_like_op_trace
from rankscope.formats.pyspy_dir import is_dumps, looks_like_pyspy

BUNDLE = "bundle"  # a JSON object, or a path that is not there (the bundle reader says so)
PYSPY = "py-spy dumps"  # a folder, or a file that is not a JSON object: saved `py-spy dump` output
FLIGHT_RECORDER = "flight recorder dumps"  # a folder of every rank's PyTorch flight recorder dump
FLIGHT_RECORDER_RANK = "one rank's flight recorder dump"
OP_TRACE = "op trace"  # a per-operation timing trace (parquet, or a CSV with its columns)
LOGS = "incident logs"  # NCCL RAS, watchdog lines, fr_trace, DETAIL checks, NCCL Inspector, a crash's error lines


def what_is(path: Path, *, stacks_only: bool = False) -> str:
    """One of the kinds above. ``stacks_only``: for a reader of stacks alone (the terminal UI), a folder of logs
    with py-spy dumps beside them is its dumps (``rankscope analyze`` reads both)."""
    if stacks_only and path.is_dir() and any_log_file(path) and \
            any(looks_like_pyspy(p) for p in path.iterdir() if p.is_file()):
        return PYSPY
    if path.is_file():
        if _is_bundle(path):  # a saved incident holds log-like words (its ground truth, its stacks): never a log
            return BUNDLE
        if looks_like_op_trace(path):
            return OP_TRACE
        if looks_like_dump(path):
            return FLIGHT_RECORDER_RANK
        if is_log_file(path):
            return LOGS
    elif path.is_dir() and any_log_file(path):
        return LOGS  # with or without py-spy dumps beside them: `rankscope analyze` reads both
    elif path.is_dir() and not holds_dumps(path) and any_crash_file(path):
        return LOGS  # a crashed job's logs in a folder per machine
    elif path.is_dir() and holds_dumps(path):
        return FLIGHT_RECORDER
    return PYSPY if is_dumps(path) else BUNDLE


def _is_bundle(path: Path) -> bool:
    """Whether a file opens as a rankscope bundle does: a JSON object whose first key names the bundle format."""
    try:
        with path.open("rb") as f:
            head = f.read(256)
    except OSError:
        return False
    return head.lstrip().startswith(b"{") and re.search(rb'"format"\s*:\s*"' + re.escape(FORMAT.encode()) + rb'"', head) is not None
