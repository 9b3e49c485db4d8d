"""Which live processes belong to a drill: a test's check that nothing it started is left behind."""

from __future__ import annotations

from pathlib import Path

import psutil


def processes_under(run_dir: Path) -> list[int]:
    """Live (not zombie) processes whose command line names ``run_dir``: the drill's nodes, ranks and agents."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if str(run_dir) in " ".join(p.info["cmdline"] or ()) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
        except psutil.Error:
            continue
    return found
