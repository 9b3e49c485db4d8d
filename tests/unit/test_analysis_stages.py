"""The analysis pass runs as stages in order (docs/analysis-pass.md), each never reaching back to an earlier one.

Two checks: no stage module imports a later stage, directly or through any
analyzer module it imports (lazy imports inside functions count); and one
real capture walked through ``analyze_job`` enters each stage module once,
in order, with no stage's code running again once the next has started.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from types import FrameType

import pytest
from rankscope.analyzers.analysis import analyze_job
from rankscope.contract.bundle import read_bundle
from repo_paths import DATA, ROOT

STAGES = ("stage_evidence", "stage_rank_states", "stage_waits", "stage_roots", "stage_suspects", "stage_verdict")
ANALYZERS = ROOT / "analyzers"
PREFIX = "rankscope.analyzers."


def _imports(module: str) -> set[str]:
    """The analyzer modules ``module`` names in any import statement, at module level or inside a function."""
    tree = ast.parse((ANALYZERS / f"{module}.py").read_text(encoding="utf-8"))
    out: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        out |= {n[len(PREFIX):].split(".")[0] for n in names if n.startswith(PREFIX)}
    return {m for m in out if (ANALYZERS / f"{m}.py").exists()}


def _reach(module: str) -> set[str]:
    """Every analyzer module ``module`` imports, followed through the modules it imports."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for m in _imports(todo.pop()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def test_the_stage_modules_exist_and_analysis_calls_them_all() -> None:
    assert all((ANALYZERS / f"{s}.py").exists() for s in STAGES)
    assert set(STAGES) <= _imports("analysis")


@pytest.mark.parametrize("index", range(len(STAGES)))
def test_no_stage_imports_a_later_stage(index: int) -> None:
    later = set(STAGES[index + 1:]) | {"analysis"}
    assert not _reach(STAGES[index]) & later, f"{STAGES[index]} reaches {sorted(_reach(STAGES[index]) & later)}"


def test_the_reach_check_sees_an_import_through_another_module() -> None:
    """The check itself can fail: the verdict stage reaches the scoring (suspects.py) through the suspects stage."""
    assert "suspects" in _reach("stage_verdict") and "suspects" not in _imports("stage_verdict")
    assert "stage_evidence" in _reach("stage_suspects")  # through stage_roots -> stage_waits -> ... the results


def test_one_capture_walks_through_the_stages_once_in_order() -> None:
    bundle = read_bundle(DATA / "bundles" / "h100" / "hang-p2p.bundle.json")
    files = {str((ANALYZERS / f"{s}.py").resolve()): s for s in STAGES}
    known: dict[str, str | None] = {}
    walk: list[str] = []

    def profile(frame: FrameType, event: str, arg: object) -> None:
        del arg
        if event != "call":
            return
        name = frame.f_code.co_filename
        if name not in known:  # each file resolved once: "<string>" (dataclass methods) and the like are no stage
            known[name] = files.get(str(Path(name).resolve())) if name.endswith(".py") else None
        stage = known[name]
        if stage is not None and (not walk or walk[-1] != stage):
            walk.append(stage)

    sys.setprofile(profile)
    try:
        verdict = analyze_job(bundle.latest).verdict
    finally:
        sys.setprofile(None)
    assert list(STAGES) == walk, walk
    # The walk was a real one: the capture's truth is named (rank 3 stopped before its send to rank 1).
    top = verdict.top
    assert top is not None and top.ranks == (1, 3) and top.roots == (3,), verdict.summary
