"""ruff and mypy over the project, as CI runs them: `python tests/static_checks.py`.

mypy resolves modules by their folder names, but the repository's folders are
installed under other names (core/ is `rankscope`, tui/ is `rankscope.tui`,
...). So this lays out a tree of symbolic links under build/typecheck with the
installed names and points mypy at it; setuptools' editable finder cannot be
followed by a static checker.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def link_tree() -> Path:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs: dict[str, str] = cfg["package-dir"]
    base = ROOT / "build" / "typecheck"
    pkg_root = base / "rankscope"
    pkg_root.mkdir(parents=True, exist_ok=True)
    for entry in pkg_root.iterdir():
        if entry.is_symlink():
            entry.unlink()
    core = ROOT / dirs["rankscope"]
    for item in core.iterdir():
        if item.name == "__pycache__":
            continue
        (pkg_root / item.name).symlink_to(item)
    for name, folder in dirs.items():
        if name == "rankscope":
            continue
        (pkg_root / name.split(".", 1)[1]).symlink_to(ROOT / folder)
    return base


def run() -> int:
    base = link_tree()
    env = dict(os.environ, MYPYPATH=str(base))
    bindir = Path(sys.executable).parent
    ruff = subprocess.run([str(bindir / "ruff"), "check", "."], cwd=ROOT, check=False)
    mypy = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "-p", "rankscope"],
        cwd=base, env=env, check=False,
    )
    return ruff.returncode or mypy.returncode


if __name__ == "__main__":
    raise SystemExit(run())
