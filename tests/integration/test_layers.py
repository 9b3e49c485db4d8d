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
    contract = {"rankscope", "rankscope.contract", "rankscope.contract.snapshot", "rankscope.contract.errors",
                "rankscope.contract.vocabulary", "rankscope.contract.ranks", "rankscope.contract.frames",
                "rankscope.contract.log_records", "rankscope.contract.crash_records", "rankscope.contract.fr_records"}
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
    # the contract's vocabulary of operations (stdlib only) is the one thing it shares with the readers
    shared = {"rankscope", "rankscope.contract", "rankscope.contract.vocabulary"}
    assert all(m in shared or m.startswith("rankscope.ccl_plugin") for m in ours), sorted(ours)


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


# Every rankscope package, lowest first: a module may import only from its own package or one listed before it.
# (The order and the reason for each place: docs/architecture.md, "Layer rules".)
LAYERS = ("contract", "ccl_plugin", "analyzers", "probes", "formats", "actions", "wire", "tui", "drill", "cli")
_FOLDERS = {"core": "rankscope", **{f: f"rankscope.{f}" for f in ("analyzers", "probes", "ccl_plugin", "tui")}}


def _all_modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for folder, base in _FOLDERS.items():
        for path in _py_files(folder):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            out[".".join([base, *parts])] = path
    return out


def _import_graph() -> dict[str, set[str]]:
    """Which rankscope modules each one imports: at the top, in functions and under TYPE_CHECKING alike."""
    modules = _all_modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for a in node.names:  # `from rankscope.tui import state` names a module too
                    name = f"{node.module}.{a.name}"
                    deps.add(name if name in modules else node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[module] = {d for d in deps if d in modules and d != module}
    return graph


def _package(module: str) -> str | None:
    """The layer a module belongs to (None: the top-level ``rankscope`` and its ``__main__``, above every layer)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else None


def _tui_import_graph() -> dict[str, set[str]]:
    graph = _import_graph()
    return {m: {d for d in deps if d.startswith("rankscope.tui")} for m, deps in graph.items()
            if m.startswith("rankscope.tui")}


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


def test_every_package_is_in_a_layer() -> None:
    found = {_package(m) for m in _all_modules()} - {None}
    assert found == set(LAYERS), f"put {sorted(found - set(LAYERS))} in LAYERS (and in docs/architecture.md)"


def _backwards(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for module, deps in sorted(graph.items()):
        here = _package(module)
        for dep in sorted(deps):
            there = _package(dep)
            if here is not None and there is not None and LAYERS.index(there) > LAYERS.index(here):
                out.append(f"{module} -> {dep}")
    return out


def test_layers_point_one_way() -> None:
    """contract <- ccl_plugin <- analyzers <- probes <- formats <- actions <- wire <- tui <- drill <- cli."""
    backwards = _backwards(_import_graph())
    assert not backwards, "imports against the layer order: " + "; ".join(backwards)


def test_the_layer_check_sees_a_backwards_import() -> None:
    graph = {"rankscope.actions.evict_backends": {"rankscope.wire.slurm", "rankscope.contract.errors"},
             "rankscope.drill.slurm_drill": {"rankscope.cli.commands.target", "rankscope.tui.app"},
             "rankscope.cli.main": {"rankscope.drill.suite"}, "rankscope.__main__": {"rankscope.cli.main"}}
    assert _backwards(graph) == ["rankscope.actions.evict_backends -> rankscope.wire.slurm",
                                 "rankscope.drill.slurm_drill -> rankscope.cli.commands.target"]


def test_no_import_circle_between_packages() -> None:
    packages = {p: set() for p in LAYERS}
    for module, deps in _import_graph().items():
        if (here := _package(module)) is not None:
            packages[here] |= {t for d in deps if (t := _package(d)) is not None and t != here}
    assert _cycle(packages) is None, " -> ".join(_cycle(packages) or [])


@pytest.mark.parametrize("package", LAYERS)
def test_no_import_circle_inside_a_package(package: str) -> None:
    """A module imports no module that imports it back, lazily or not (drill: the launcher starts the worker,
    the worker reads what the launcher sets, from its own module)."""
    prefix = f"rankscope.{package}"
    graph = {m: {d for d in deps if d.startswith(prefix)} for m, deps in _import_graph().items()
             if m.startswith(prefix)}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def _script_imports(folder: Path) -> dict[str, set[str]]:
    """Which scripts of a folder of scripts (not a package: each imports the others by their bare names) each one
    imports, at the top or in functions."""
    files = {p.stem: p for p in folder.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def test_no_import_circle_between_benchmarks(tmp_path: Path) -> None:
    """Benchmarks share their helpers through modules of their own (``base_code``), never by importing each other
    back (bench_bundle and bench_fanout once did)."""
    graph = _script_imports(ROOT / "benchmarks")
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])
    (tmp_path / "a.py").write_text("def f():\n    from b import g\n")  # the check sees a lazy import circle
    (tmp_path / "b.py").write_text("from a import f\n")
    assert _cycle(_script_imports(tmp_path)) == ["a", "b", "a"]


# What screens and widgets may use of ``self.app``: Textual's own App API, never the rankscope app's state.
_TEXTUAL_APP_API = {"notify", "console", "push_screen", "pop_screen", "exit", "bell"}


@pytest.mark.parametrize("path", [*_py_files("tui/screens"), *_py_files("tui/widgets")], ids=lambda p: p.name)
def test_screens_and_widgets_draw_what_they_are_handed_never_reaching_back_into_the_app(path: Path) -> None:
    """One store: the app hands each redraw its state; a screen reading the app's attributes would draw another."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in {"getattr", "hasattr"}:
            target = node.args[0] if node.args else None
            assert not (isinstance(target, ast.Attribute) and target.attr == "app"), \
                f"{path}:{node.lineno} looks the app's attributes up by name"
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "app":
            assert node.attr in _TEXTUAL_APP_API, f"{path}:{node.lineno} reads self.app.{node.attr}"


# What the app may set on itself after __init__: the one store, and the last copy/write (told, never drawn).
_APP_SETS = {"state", "last_copied", "last_written"}


# The app and the parts it is put together from (tui/app_part.py).
@pytest.mark.parametrize("path", sorted((ROOT / "tui").glob("app*.py")), ids=lambda p: p.name)
def test_the_app_changes_nothing_drawn_outside_its_one_store(path: Path) -> None:
    """After __init__, tui/app.py assigns only ``self.state`` (through a reducer) of what the screens draw."""
    for fn in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) or fn.name == "__init__":
            continue
        for node in ast.walk(fn):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AnnAssign | ast.AugAssign) else []
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    assert t.attr in _APP_SETS, f"{path}:{node.lineno} keeps self.{t.attr} beside AppState"
                    if t.attr == "state":
                        call = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
                        assert isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and \
                            isinstance(call.func.value, ast.Name) and call.func.value.id == "st", \
                            f"{path}:{node.lineno} sets the state other than by a reducer of rankscope.tui.state"


def test_the_docs_these_rules_cite_are_in_the_repository() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert "## Layer rules" in text and "tests/integration/test_layers.py" in text
