"""Building the NCCL profiler plugin with the system's C compiler, once, into a cache.

Why at first use and not at install time: wheels are built without knowing
whether the training node has NCCL, and a pure-Python wheel stays portable.
The library depends on nothing but libc (the NCCL ABI structs are declared in
``nccl/profiler.c`` from NVIDIA's documented layout), so any cc builds it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

SOURCES = ("profiler.c", "rankscope_layout.h", "nccl_profiler_abi.h")
LIB_NAME = "librankscope_nccl_profiler"


class BuildError(Exception):
    """The plugin could not be built; ``fix`` says what to install or set."""

    def __init__(self, message: str, fix: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix


def source_dir() -> Path:
    return Path(__file__).resolve().parent / "nccl"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rankscope"


def find_compiler() -> str | None:
    for cand in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cand and shutil.which(cand):
            return cand
    return None


def _digest() -> str:
    h = hashlib.sha256()
    for name in SOURCES:
        h.update((source_dir() / name).read_bytes())
    return h.hexdigest()[:16]


def build_plugin(out_dir: Path | None = None, extra_flags: tuple[str, ...] = ()) -> Path:
    """Path of the built plugin, compiling it if this source version is not built yet."""
    try:
        digest = _digest()
    except OSError as exc:
        raise BuildError(f"plugin sources missing: {exc}", "reinstall rankscope") from exc
    out = (out_dir or cache_dir()) / f"{LIB_NAME}-{digest}.so"
    if out.exists() and not extra_flags:
        return out
    cc = find_compiler()
    if cc is None:
        raise BuildError("no C compiler found (tried $CC, cc, gcc, clang)",
                         "install one (e.g. `apt-get install gcc`) or set CC; the Python counters work without it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [cc, "-O2", "-std=c11", "-fPIC", "-shared", "-Wall", "-Werror", "-fvisibility=hidden",
           *extra_flags, "-o", str(tmp), str(source_dir() / "profiler.c"), "-lpthread"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise BuildError(f"compiling the NCCL profiler plugin failed: {proc.stderr.strip()[:2000]}",
                         f"check the compiler ({cc}); command: {' '.join(cmd)}")
    os.replace(tmp, out)
    return out
