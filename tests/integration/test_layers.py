"""The layer rules of docs/architecture.md ("Layer rules"), checked against what really gets imported.

Each module is imported in a fresh interpreter and the resulting
``sys.modules`` is inspected, so a rule broken through an indirect import is
caught too. A static pass checks the rules an import list cannot show
(analyzers and the action planner read no clock and do no I/O; the TUI
reaches agents only through rankscope.wire.client).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import ROOT

PACKAGES = {"analyzers": "rankscope.analyzers", "probes": "rankscope.probes",
            "ccl_plugin": "rankscope.ccl_plugin", "tui": "rankscope.tui"}


def _modules(folder: str) -> list[str]:
    base = PACKAGES[folder]
    out = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        rel = path.relative_to(ROOT / folder).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        out.append(".".join([base, *parts]))
    return out


def _imported_by(module: str) -> set[str]:
    code = (
        "import importlib, json, sys\n"
        f"importlib.import_module({module!r})\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"importing {module} failed:\n{proc.stderr}"
    return set(json.loads(proc.stdout.strip().splitlines()[-1]))


def _third_party(mods: set[str]) -> set[str]:
    tops = {m.split(".")[0] for m in mods}
    return {t for t in tops if t not in sys.stdlib_module_names and not t.startswith("_")}


@pytest.mark.parametrize("module", _modules("analyzers"))
def test_analyzers_import_only_stdlib_numpy_and_the_contract(module: str) -> None:
    mods = _imported_by(module)
    assert _third_party(mods) <= {"numpy", "rankscope"}, _third_party(mods)
    ours = {m for m in mods if m.startswith("rankscope")}
    allowed = ("rankscope.analyzers",)
    contract = {"rankscope", "rankscope.contract", "rankscope.contract.snapshot", "rankscope.contract.errors"}
    extra = {m for m in ours if m not in contract and not m.startswith(allowed)}
    assert not extra, f"{module} pulls in {sorted(extra)}"


@pytest.mark.parametrize("module", _modules("probes"))
def test_probes_never_import_textual(module: str) -> None:
    mods = _imported_by(module)
    assert not {m for m in mods if m.split(".")[0] == "textual" or m.startswith("rankscope.tui")}


@pytest.mark.parametrize("module", _modules("ccl_plugin"))
def test_ccl_plugin_imports_only_stdlib(module: str) -> None:
    mods = _imported_by(module)
    # torch is allowed (it is already in a training process) but must be imported lazily,
    # so importing the plugin alone never pulls it in.
    assert _third_party(mods) <= {"rankscope"}, _third_party(mods)
    ours = {m for m in mods if m.startswith("rankscope")}
    assert all(m in {"rankscope"} or m.startswith("rankscope.ccl_plugin") for m in ours), sorted(ours)


@pytest.mark.parametrize("module", _modules("tui"))
def test_tui_never_imports_node_side_libraries(module: str) -> None:
    mods = _imported_by(module)
    banned = {"psutil", "pynvml", "torch"}
    assert not (_third_party(mods) & banned)
    assert not any(m.startswith("rankscope.probes") for m in mods)


# ---- static rules --------------------------------------------------------

_CLOCK_OR_IO_MODULES = {"time", "os", "subprocess", "socket", "pathlib", "io", "shutil", "datetime",
                        "random", "threading", "asyncio", "urllib", "http"}


def _py_files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


# The action planner decides from facts its agent gathered, so a test that gives it facts checks what the agent shows.
_PURE = [*_py_files("analyzers"), ROOT / "core" / "actions" / "planning.py"]


@pytest.mark.parametrize("path", _PURE, ids=lambda p: p.name)
def test_analyzers_and_the_action_planner_do_no_io_and_read_no_clock(path: Path) -> None:
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names = {(node.module or "").split(".")[0]}
        else:
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in {"open", "print", "input"}, f"{path}:{node.lineno} does I/O"
            continue
        bad = names & _CLOCK_OR_IO_MODULES
        assert not bad, f"{path}:{node.lineno} imports {bad}: it must stay pure"


@pytest.mark.parametrize("path", _py_files("tui"), ids=lambda p: p.name)
def test_tui_reaches_agents_only_through_the_client(path: Path) -> None:
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        else:
            continue
        for name in names:
            assert not name.startswith(("grpc", "rankscope.wire.proto")), f"{path}:{node.lineno} imports {name}"


def _tui_import_graph() -> dict[str, set[str]]:
    """Which rankscope.tui modules each tui module imports: at the top, in functions and under TYPE_CHECKING alike."""
    graph: dict[str, set[str]] = {}
    for path, module in zip(_py_files("tui"), _modules("tui"), strict=True):
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rankscope.tui"):
                base = node.module or ""
                for a in node.names:  # `from rankscope.tui import state` names a module too
                    deps.add(f"{base}.{a.name}" if f"{base}.{a.name}" in graph or base == "rankscope.tui" else base)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("rankscope.tui")}
        graph[module] = deps
    known = set(graph)
    return {m: {d for d in deps if d in known and d != m} for m, deps in graph.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return [*path[path.index(d):], d]
            if d not in state and (found := visit(d)) is not None:
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)) is not None:
            return found
    return None


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_tui_modules_import_no_circle() -> None:
    """Screens and widgets depend on the state and the analysis, never back on the app (docs/architecture.md)."""
    assert _cycle(_tui_import_graph()) is None, " -> ".join(_cycle(_tui_import_graph()) or [])


# What screens and widgets may use of ``self.app``: Textual's own App API, never the rankscope app's state.
_TEXTUAL_APP_API = {"notify", "console", "push_screen", "pop_screen", "exit", "bell"}


@pytest.mark.parametrize("path", [*_py_files("tui/screens"), *_py_files("tui/widgets")], ids=lambda p: p.name)
def test_screens_and_widgets_draw_what_they_are_handed_never_reaching_back_into_the_app(path: Path) -> None:
    """One store: the app hands each redraw its frame; a screen reading ``self.app.state`` would draw another."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in {"getattr", "hasattr"}:
            target = node.args[0] if node.args else None
            assert not (isinstance(target, ast.Attribute) and target.attr == "app"), \
                f"{path}:{node.lineno} looks the app's attributes up by name"
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "app":
            assert node.attr in _TEXTUAL_APP_API, f"{path}:{node.lineno} reads self.app.{node.attr}"


def test_the_docs_these_rules_cite_are_in_the_repository() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert "## Layer rules" in text and "tests/integration/test_layers.py" in text
