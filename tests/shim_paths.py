"""The shim's two paths, for tests that run on both: the native fast path (where a compiler builds it) and Python.

``fast("native")`` is the module production loads (``native.load()``); a machine without a C compiler skips
the native case rather than failing it (its Python path is still tested), while one with a compiler must
load it.
"""

from __future__ import annotations

from types import ModuleType

import pytest
from rankscope.ccl_plugin import native
from rankscope.ccl_plugin.build import find_compiler

PATHS = ("native", "python")


def fast(path: str) -> ModuleType | None:
    if path == "python":
        return None
    if find_compiler() is None:
        pytest.skip("no C compiler: the native fast path cannot be built here")
    module = native.load({})
    assert module is not None, "a compiler exists but the native fast path did not load (see stderr)"
    return module
