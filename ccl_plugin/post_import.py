"""Run a function right after a module's body has executed, once.

The CCL hooks must patch ``torch.distributed`` and the backup hook must
register on ``torch.optim.optimizer`` before user code binds their names, but
importing torch ourselves would cost every Python start a second or more. So
a one-shot meta-path finder waits for the module's import, lets the real
loader run, then calls back with the fresh module. Never raises.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any


def after_import(name: str, callback: Callable[[ModuleType], None]) -> None:
    """``callback(module)`` now if ``name`` is imported, else right after its import."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
    elif not any(isinstance(f, _OneShotFinder) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _OneShotFinder(name, callback))


class _CallingLoader(importlib.abc.Loader):
    """Runs the real loader, then the callback on the fresh module."""

    def __init__(self, inner: importlib.abc.Loader, callback: Callable[[ModuleType], None]) -> None:
        self.inner = inner
        self.callback = callback

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        self.callback(module)

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, ...
        return getattr(self.inner, name)


class _OneShotFinder(importlib.abc.MetaPathFinder):
    """Catches the import of one module once, and wraps its loader."""

    def __init__(self, name: str, callback: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.callback = callback

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)  # one shot; also keeps the lookup below from finding us
        try:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is None or spec.loader is None:
                return None
            spec.loader = _CallingLoader(spec.loader, self.callback)
            return spec
        except Exception:
            return None
