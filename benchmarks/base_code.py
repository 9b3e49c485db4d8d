"""The code at another commit, to run side by side with this checkout's: what every benchmark's base side imports.

A benchmark prints its figures beside the same measurement of a base commit
(``--base-ref``); the base's code is unpacked from git once per commit into
the temporary directory and put first on ``sys.path`` (or ``PYTHONPATH``).
"""

from __future__ import annotations

import subprocess
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def base_package(ref: str) -> Path:
    """A folder whose ``rankscope`` package is ``core/`` at ``ref`` (put first on sys.path to import it)."""
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", ref], capture_output=True, text=True,
                         check=True).stdout.strip()
    root = Path(tempfile.gettempdir()) / f"rankscope-bench-base-{sha[:12]}"
    pkg = root / "pkg"
    if not (pkg / "rankscope").exists():
        archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", sha, *BASE_TREES],
                                 capture_output=True, check=True).stdout
        src = root / "src"
        src.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile() as f:
            f.write(archive)
            f.seek(0)
            with tarfile.open(fileobj=f) as tar:
                tar.extractall(src, filter="data")
        pkg.mkdir(parents=True, exist_ok=True)
        (pkg / "rankscope").symlink_to(src / "core")
        for tree in BASE_TREES[1:]:
            (pkg / tree).symlink_to(src / tree)
    return pkg


# The base code is a whole tree (its analyzers and probes match its core); its core had one flat package, so the
# modules this benchmark (and fanout_source) use had other names there (#15 split core/ by role).
BASE_TREES = ("core", "analyzers", "probes", "ccl_plugin")
BASE_NAMES = {"rankscope.contract.snapshot": "rankscope.snapshot", "rankscope.contract.bundle": "rankscope.bundle",
              "rankscope.wire.tokens": "rankscope.tokens", "rankscope.wire.agent": "rankscope.agent",
              "rankscope.wire.client": "rankscope.client", "rankscope.wire.proto": "rankscope.proto",
              "rankscope.wire.proto.rankscope_pb2": "rankscope.proto.rankscope_pb2",
              "rankscope.wire.proto.rankscope_pb2_grpc": "rankscope.proto.rankscope_pb2_grpc"}


def base_root(ref: str) -> Path:
    """The folder to put first on sys.path to run the code at ``ref``: for a ref from after #15 split core/ by
    role, its whole tree under this checkout's module names (``base_tree``); before it, its flat
    core (``base_package``, its modules renamed by ``use_impl``)."""
    split = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{ref}:core/wire"], capture_output=True,
                           check=False).returncode == 0
    if split:
        return base_tree(ref)
    return base_package(ref)


def same_names(base: str) -> bool:
    """Whether the base code's modules have this checkout's names (a base from after #15: it relays too)."""
    return (Path(base) / "rankscope" / "wire").is_dir()


def base_tree(ref: str) -> Path:
    """A folder to put first on sys.path whose ``rankscope`` is the package at ``ref``, its trees inside it.

    ``base_package`` gives ``core/`` as ``rankscope`` with the other trees beside it, so
    ``rankscope.analyzers`` falls through to this checkout's editable install; here each tree it unpacked is
    linked inside the package (as pyproject's package-dir maps them), so the base's own analyzers run. (The
    TUI is not among them: neither opening a bundle nor ``rankscope analyze`` imports it.)
    """
    src = base_package(ref).parent / "src"
    pkg = src.parent / "whole" / "rankscope"
    if not pkg.exists():
        pkg.mkdir(parents=True)
        for entry in (src / "core").iterdir():
            (pkg / entry.name).symlink_to(entry)
        for tree in BASE_TREES[1:]:
            (pkg / tree).symlink_to(src / tree)
    return pkg.parent
