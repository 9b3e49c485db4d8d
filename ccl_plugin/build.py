"""Building the NCCL profiler plugin and the shim's fast path with the system's C compiler, once, into a cache.

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
import sys
import sysconfig
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


# The shim's fast path: a CPython extension module (fastshim.c) that takes its slot layout from the plugin's
# generated header, so both writers store the one layout.
SHIM_MODULE = "_rankscope_shim"
SHIM_SOURCE = "fastshim.c"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rankscope"


def find_compiler() -> str | None:
    for cand in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cand and shutil.which(cand):
            return cand
    return None


def _digest(paths: tuple[Path, ...] | None = None, extra: tuple[str, ...] = ()) -> str:
    h = hashlib.sha256()
    for path in paths if paths is not None else tuple(source_dir() / name for name in SOURCES):
        h.update(path.read_bytes())
    for word in extra:
        h.update(word.encode())
    return h.hexdigest()[:16]


def _compile(cc: str, what: str, cmd: list[str], tmp: Path, out: Path) -> Path:
    """Run ``cmd`` (which writes ``tmp``) and rename its output into place: ranks that race each get a whole file."""
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise BuildError(f"compiling {what} failed: {proc.stderr.strip()[:2000]}",
                         f"check the compiler ({cc}); command: {' '.join(cmd)}")
    os.replace(tmp, out)
    return out


def _need_compiler() -> str:
    cc = find_compiler()
    if cc is None:
        raise BuildError("no C compiler found (tried $CC, cc, gcc, clang)",
                         "install one (e.g. `apt-get install gcc`) or set CC; the Python counters work without it")
    return cc


def build_plugin(out_dir: Path | None = None, extra_flags: tuple[str, ...] = ()) -> Path:
    """Path of the built plugin, compiling it if this source version is not built yet."""
    try:
        digest = _digest()
    except OSError as exc:
        raise BuildError(f"plugin sources missing: {exc}", "reinstall rankscope") from exc
    out = (out_dir or cache_dir()) / f"{LIB_NAME}-{digest}.so"
    if out.exists() and not extra_flags:
        return out
    cc = _need_compiler()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [cc, "-O2", "-std=c11", "-fPIC", "-shared", "-Wall", "-Werror", "-fvisibility=hidden",
           *extra_flags, "-o", str(tmp), str(source_dir() / "profiler.c"), "-lpthread"]
    return _compile(cc, "the NCCL profiler plugin", cmd, tmp, out)


def build_shim(out_dir: Path | None = None, extra_flags: tuple[str, ...] = ()) -> Path:
    """Path of the shim's fast-path extension for this interpreter, compiling it if not built yet.

    Named by the digest of its sources, this interpreter's ABI and the flags, so interpreters and versions
    sharing one cache never load each other's build.
    """
    include = sysconfig.get_paths().get("include", "")
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    source = Path(__file__).resolve().parent / SHIM_SOURCE
    try:
        digest = _digest((source, source_dir() / "rankscope_layout.h"), (sys.version, include, suffix, *extra_flags))
    except OSError as exc:
        raise BuildError(f"the shim's C source is missing: {exc}", "reinstall rankscope") from exc
    out = (out_dir or cache_dir()) / f"{SHIM_MODULE}-{digest}{suffix}"
    if out.exists():
        return out
    if not include or not (Path(include) / "Python.h").is_file():
        raise BuildError(f"no Python headers (Python.h) in {include or 'this interpreter'}",
                         "install them (e.g. `apt-get install python3-dev`); the Python counters work without them")
    cc = _need_compiler()
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    cmd = [cc, "-O2", "-std=gnu11", "-fPIC", "-shared", "-Wall", "-fvisibility=hidden", *extra_flags,
           f"-I{include}", f"-I{source_dir()}", "-o", str(tmp), str(source)]
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        return _compile(cc, "the shim's fast path", cmd, tmp, out)
    except OSError as exc:
        raise BuildError(f"the build cache {out.parent} cannot be written ({exc.strerror})",
                         "set XDG_CACHE_HOME to a directory this user can write") from exc
