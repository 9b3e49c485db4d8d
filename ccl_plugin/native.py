"""The shim's native fast path: built at first use, loaded once per process, or the Python path says why not.

Why at first use (as the NCCL plugin): a training node gets it from `rankscope run` and the autoload without
an install step, and a wheel stays pure Python. Ranks starting together may each compile; each renames a
whole file into the cache, so none loads a half-written one. Without a compiler or Python's headers, or with
``RANKSCOPE_CCL_NATIVE=0``, the counters count in Python (same counters, more µs a call), said in one line.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Mapping
from types import ModuleType

from rankscope.ccl_plugin.build import SHIM_MODULE, BuildError, build_shim, cache_dir

ENV_NATIVE = "RANKSCOPE_CCL_NATIVE"  # "0": count in Python even where the native path builds
_UNSET = object()
_loaded: object = _UNSET


def _say(message: str) -> None:
    """One line, however many lines a compiler said."""
    print(f"rankscope: {' '.join(message.split())[:600]}", file=sys.stderr, flush=True)


def load(environ: Mapping[str, str] | None = None) -> ModuleType | None:
    """The fast-path module, or None (said once on stderr) when this process counts in Python."""
    global _loaded
    if _loaded is not _UNSET:
        return _loaded if isinstance(_loaded, ModuleType) else None
    _loaded = None
    env = os.environ if environ is None else environ
    if env.get(ENV_NATIVE, "1").strip() == "0":
        _say(f"CCL counters count in Python ({ENV_NATIVE}=0): a few µs more a collective")
        return None
    try:
        path = build_shim()
        loader = importlib.machinery.ExtensionFileLoader(SHIM_MODULE, str(path))
        spec = importlib.util.spec_from_file_location(SHIM_MODULE, path, loader=loader)
        if spec is None:
            raise ImportError(f"no module spec for {path}")
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except BuildError as exc:
        _say(f"CCL counters count in Python (a few µs more a collective): {exc.message}; {exc.fix}")
        return None
    except Exception as exc:  # a broken cache entry or loader surprise: the Python path still counts
        _say(f"CCL counters count in Python (a few µs more a collective): the fast path did not load "
             f"({type(exc).__name__}: {exc}); remove {cache_dir()} to rebuild it")
        return None
    _loaded = module
    return module


def forget() -> None:
    """Tests: let the next ``load`` decide again."""
    global _loaded
    _loaded = _UNSET
