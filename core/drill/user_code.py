"""The drill's "user code": a small git repository whose versions the drill can hot-update between.

ByteRobust §6.1 changes a job's code in place: the machines stay, the code
directory is switched to another version and the training processes restart
on it. To drill that for real, the drill's ranks import one module,
``drill_user_code.py``, from their machine's code link
(``<run_dir>/state/<machine>/code/current``), and the module changes
something observable and deterministic:

- ``VERSION``: the name each rank records, per process start and per step,
  so a test can prove which code every step ran;
- ``lr_scale(step)``: a factor on the learning rate. ``v1`` returns exactly
  1.0, so a drill on ``v1`` computes bit for bit what a drill without the
  code link computes; ``v2`` and ``v3`` change the losses.

The repository (``<run_dir>/code/repo``) has one commit per version, tagged
``v1``, ``v2``, ``v3``; git runs as an argv list, never through a shell.
Nothing here imports torch: the launcher makes the repository and the
worker loads the module.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rankscope.contract.errors import RankscopeError

CODE_ENV = "RANKSCOPE_DRILL_CODE"  # the node's code link; unset: the worker runs as it always did
MACHINE_ENV = "RANKSCOPE_DRILL_MACHINE"  # the label of the node's machine, for the records
MODULE = "drill_user_code"
CODE_RUNS_DIR = "code_runs"  # <run_dir>/code_runs/rank<R>.jsonl: one line per process start
INITIAL_VERSION = "v1"
# name -> learning-rate factor. v1 is the identity (a float product by 1.0 is exact).
VERSIONS: dict[str, float] = {"v1": 1.0, "v2": 0.5, "v3": 0.25}
_GIT_TIMEOUT_S = 60.0
_GIT_IDENTITY = ("-c", "user.name=rankscope drill", "-c", "user.email=drill@localhost", "-c", "commit.gpgsign=false",
                 "-c", "tag.gpgsign=false")


def module_text(version: str, scale: float) -> str:
    return (
        f'"""The drill job\'s user code, version {version} (hot-updated by rankscope; see rankscope.drill.user_code)."""\n'
        "\n"
        f"VERSION = {version!r}\n"
        "\n"
        "\n"
        "def lr_scale(step: int) -> float:\n"
        f"    return {scale!r}\n"
    )


def _git(repo: Path, *argv: str) -> str:
    try:
        proc = subprocess.run(["git", "-C", str(repo), *_GIT_IDENTITY, *argv], shell=False, capture_output=True,
                              text=True, timeout=_GIT_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RankscopeError(f"git failed while making the drill's code repository: {exc}",
                             "install git, or run the drill without actions") from None
    if proc.returncode != 0:
        raise RankscopeError(f"git {argv[0]} failed in {repo}: {proc.stderr.strip() or proc.stdout.strip()}",
                             "check that git works here (git --version)")
    return proc.stdout.strip()


def make_repo(repo: Path) -> Path:
    """The drill's code repository with tags v1, v2, v3 (made once; an existing one is kept as it is)."""
    if (repo / ".git").exists():
        return repo
    repo.mkdir(parents=True, exist_ok=True)
    _git(repo, "init", "-q")
    for version, scale in VERSIONS.items():
        (repo / f"{MODULE}.py").write_text(module_text(version, scale), encoding="utf-8")
        _git(repo, "add", f"{MODULE}.py")
        _git(repo, "commit", "-q", "-m", f"drill user code {version}: learning-rate factor {scale}")
        _git(repo, "tag", version)
    return repo


@dataclass(frozen=True, slots=True)
class UserCode:
    """The user code one rank process runs with, fixed at its start (a later switch needs a restart)."""

    version: str
    path: str  # the version tree the link pointed at when the process started
    module: Any

    def lr(self, base_lr: float, step: int) -> float:
        return base_lr * float(self.module.lr_scale(step))


def load(link: str) -> UserCode:
    """Import ``drill_user_code`` from where ``link`` points now (resolved once, so the process keeps its version)."""
    tree = os.path.realpath(link)
    source = Path(tree) / f"{MODULE}.py"
    spec = importlib.util.spec_from_file_location(MODULE, source)
    if spec is None or spec.loader is None or not source.is_file():
        raise RankscopeError(f"no {MODULE}.py in {tree} (the code link {link})",
                             "point the link at a version of the drill's code repository")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return UserCode(version=str(module.VERSION), path=tree, module=module)


def from_env(run_dir: Path, rank: int, start_step: int) -> UserCode | None:
    """The rank's user code when the launcher gave its node a code link; recorded in ``code_runs``. None: no link."""
    link = os.environ.get(CODE_ENV)
    if not link:
        return None
    code = load(link)
    record_run(run_dir, rank, code, start_step, os.environ.get(MACHINE_ENV, ""))
    return code


def record_run(run_dir: Path, rank: int, code: UserCode, start_step: int, machine: str) -> None:
    folder = run_dir / CODE_RUNS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    line = {"rank": rank, "pid": os.getpid(), "machine": machine, "version": code.version, "path": code.path,
            "start_step": start_step, "wall": time.time()}
    with open(folder / f"rank{rank}.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")
