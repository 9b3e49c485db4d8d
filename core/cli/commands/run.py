"""`rankscope run -- <launcher and args>`: run a job with the CCL counters loaded.

Why a wrapper and not a code change: the job's ranks read a ``.pth`` hook at
start-up that turns the counters on only when this command's environment is
set, so ``rankscope run -- torchrun ... train.py`` (or any launcher that keeps
the environment) gives every rank its counter file with no edit to the job.
The hook is written into this interpreter's site-packages on first use.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rankscope.contract.errors import RankscopeError


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "run", help="run a training launcher with the CCL counters loaded into every rank",
        description="Run a launcher (torchrun, python -m torch.distributed.run, ...) so that every rank "
                    "records Aegis CL/WR/WC counters into shared memory for `rankscope agent` to read.")
    p.add_argument("--counter-dir", type=Path, default=None,
                   help="where the per-rank counter files go (default /dev/shm/rankscope)")
    p.add_argument("--job-id", default=None, help="job id in the files' names (default: TORCHELASTIC_RUN_ID or a new one)")
    p.add_argument("--no-nccl-plugin", action="store_true", help="do not build or load the NCCL profiler plugin")
    p.add_argument("--keep-files", action="store_true",
                   help="leave the counter files behind after the job ends (marked as exited), for a post-mortem")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the launcher and its arguments")
    p.set_defaults(func=run)


def _nccl_plugin(quiet: bool) -> Path | None:
    from rankscope.ccl_plugin.build import BuildError, build_plugin
    try:
        return build_plugin()
    except BuildError as exc:
        if not quiet:
            print(f"rankscope run: NCCL profiler plugin not built ({exc.message}); "
                  f"the Python counters still load. {exc.fix}", file=sys.stderr)
        return None


def cleanup(counter_dir: Path, job_id: str) -> list[Path]:
    """Remove this job's counter files whose writer is gone (a crashed rank's too)."""
    from rankscope.ccl_plugin import layout as L
    from rankscope.probes.ccl_counters import read_counter_file
    removed: list[Path] = []
    prefix = L.file_name(job_id, 0).rsplit(".rank", 1)[0] + ".rank"
    try:
        paths = [p for p in counter_dir.iterdir() if p.name.startswith(prefix) and p.name.endswith(L.FILE_SUFFIX)]
    except OSError:
        return removed
    for path in paths:
        c = read_counter_file(path).counters
        if c.error is None and not c.stale:
            continue  # a process of this job is still alive (detached worker): leave its file
        try:
            path.unlink()
            removed.append(path)
        except OSError:
            pass
    return removed


def run(args: argparse.Namespace) -> int:
    from rankscope.ccl_plugin import autoload
    from rankscope.ccl_plugin import layout as L

    cmd = list(args.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise RankscopeError("no command to run", "rankscope run -- torchrun --nproc-per-node 8 train.py")
    try:
        autoload.install_pth()
    except OSError as exc:
        raise RankscopeError(f"cannot install the CCL start-up hook ({autoload.PTH_NAME}): {exc}",
                             "run once as a user who can write to site-packages, or use a virtualenv") from exc
    counter_dir = args.counter_dir or Path(os.environ.get(L.ENV_DIR) or L.DEFAULT_DIR)
    job_id = args.job_id or os.environ.get("TORCHELASTIC_RUN_ID") or f"rs{int(time.time())}-{os.getpid()}"
    try:
        counter_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RankscopeError(f"cannot create counter directory {counter_dir}: {exc.strerror}",
                             "pass --counter-dir to a writable directory (ideally on tmpfs)") from exc
    import importlib.util
    if importlib.util.find_spec("torch") is None:
        print("rankscope run: torch is not installed in this interpreter; the ranks' Python counters will not "
              "load (the NCCL plugin still can)", file=sys.stderr)
    plugin = None if args.no_nccl_plugin else _nccl_plugin(quiet=True)
    env = dict(os.environ, **autoload.ccl_env(counter_dir, job_id, plugin))
    if args.keep_files:
        env["RANKSCOPE_CCL_KEEP"] = "1"  # the ranks (Python and NCCL writers) leave their files too
    try:
        child = subprocess.Popen(cmd, env=env)
    except OSError as exc:
        raise RankscopeError(f"cannot start {cmd[0]!r}: {exc.strerror}", "check the command after '--'") from exc

    def forward(signum: int, _frame: Any) -> None:
        child.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = child.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if not args.keep_files:
            cleanup(counter_dir, job_id)
    return rc if rc >= 0 else 128 - rc
