"""The shim's native fast path: loaded where a compiler builds it, else the Python path with one line saying why."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from rankscope.ccl_plugin import hook_state, native, wrappers
from rankscope.ccl_plugin.build import SHIM_MODULE, find_compiler
from repo_paths import ROOT


@pytest.fixture
def fresh() -> Iterator[None]:
    native.forget()
    try:
        yield
    finally:
        native.forget()


def load_in_child(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    code = "from rankscope.ccl_plugin import native; m = native.load(); print(m.__name__ if m else None)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          cwd=str(ROOT), check=False)


@pytest.mark.skipif(find_compiler() is None, reason="no C compiler here")
def test_the_native_path_is_the_one_loaded_where_a_compiler_exists(fresh: None, capsys: pytest.CaptureFixture[str]) \
        -> None:
    module = native.load({})
    assert module is not None and module.__name__ == SHIM_MODULE
    assert capsys.readouterr().err == ""  # nothing to say when it works
    assert native.load({}) is module  # once per process
    saved = (hook_state.STATE.fast, hook_state.STATE.tls)
    hook_state.use_fast(module)
    try:
        def all_reduce(tensor: object, op: object = None, group: object = None, async_op: bool = False) -> None:
            """torch's docstring"""

        wrapped = wrappers.make_wrapper("all_reduce", all_reduce)
        assert isinstance(wrapped, module.Wrapper)
        assert wrapped.__rankscope_original__ is all_reduce and wrapped.__name__ == "all_reduce"
        assert wrapped.__doc__ == "torch's docstring" and wrapped.__wrapped__ is all_reduce
    finally:
        hook_state.STATE.fast, hook_state.STATE.tls = saved


def test_forced_off_it_counts_in_python_and_says_so_once(fresh: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert native.load({native.ENV_NATIVE: "0"}) is None
    assert native.load({native.ENV_NATIVE: "0"}) is None
    err = capsys.readouterr().err
    assert err == "rankscope: CCL counters count in Python (RANKSCOPE_CCL_NATIVE=0): a few µs more a collective\n"


def test_without_a_compiler_it_counts_in_python_with_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("CC", native.ENV_NATIVE)}
    env.update(PATH=str(tmp_path / "empty"), XDG_CACHE_HOME=str(tmp_path / "cache"))
    done = load_in_child(env)
    assert done.returncode == 0 and done.stdout == "None\n", done
    (line,) = done.stderr.splitlines()
    assert line.startswith("rankscope: CCL counters count in Python") and "no C compiler found" in line, line
    assert "install one" in line and "Traceback" not in done.stderr


@pytest.mark.skipif(find_compiler() is None, reason="no C compiler here")
def test_a_broken_cached_build_falls_back_with_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != native.ENV_NATIVE}
    env["XDG_CACHE_HOME"] = str(tmp_path)
    assert load_in_child(env).stdout == f"{SHIM_MODULE}\n"  # built into the fresh cache
    (built,) = (tmp_path / "rankscope").glob(f"{SHIM_MODULE}-*")
    built.write_bytes(b"not a shared object")
    done = load_in_child(env)
    assert done.returncode == 0 and done.stdout == "None\n", done
    (line,) = done.stderr.splitlines()
    assert "did not load (ImportError" in line and f"remove {tmp_path / 'rankscope'} to rebuild" in line, line


@pytest.mark.skipif(find_compiler() is None, reason="no C compiler here")
def test_its_clock_is_the_one_python_times_with(fresh: None) -> None:
    """A launch timed in C is completed by Python's writer and the other way round."""
    module = native.load({})
    assert module is not None
    before = time.perf_counter()
    mid = module.now()
    after = time.perf_counter()
    assert before <= mid <= after


@pytest.mark.skipif(find_compiler() is None, reason="no C compiler here")
def test_an_unwritable_cache_falls_back_with_one_line_naming_the_fix(tmp_path: Path) -> None:
    (tmp_path / "rankscope").write_text("a file where the cache folder would be")
    env = {k: v for k, v in os.environ.items() if k != native.ENV_NATIVE}
    env["XDG_CACHE_HOME"] = str(tmp_path)
    done = load_in_child(env)
    assert done.returncode == 0 and done.stdout == "None\n", done
    (line,) = done.stderr.splitlines()
    assert f"the build cache {tmp_path / 'rankscope'} cannot be written" in line and "XDG_CACHE_HOME" in line, line
