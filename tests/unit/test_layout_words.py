"""A layout is worded once (the contract's ``Layout``): its bad sizes and its text read the same in every reader."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest
from rankscope.actions.config import load_actions_config
from rankscope.analyzers.backup_plan import backup_plan
from rankscope.analyzers.topology import validate_layout
from rankscope.cli.options import add_layout_args, layout_from_args
from rankscope.contract.errors import RankscopeError
from rankscope.contract.snapshot import DIM_WORDS, DIMS, SIZES_FIX, Layout
from rankscope.tui.widgets.verdict import layout_text
from repo_paths import ROOT

WORDS = "tp must be a whole number of at least 1, got 0"


def test_the_contract_names_every_bad_size_as_its_reader_typed_it() -> None:
    layout = Layout(tp=0, pp=2, dp=-1, ranks_per_machine=0)
    assert layout.size_problems() == ("tp must be a whole number of at least 1, got 0; "
                                      "dp must be a whole number of at least 1, got -1; "
                                      "ranks_per_machine must be a whole number of at least 1, got 0")
    assert layout.size_problems(lambda k: f"--{k}").startswith("--tp must be a whole number of at least 1, got 0")
    assert Layout(tp=2, pp=True).size_problems() == "pp must be a whole number of at least 1, got True"
    assert Layout(tp=2, pp=4).size_problems() is None


def test_topology_the_backup_plan_the_command_line_and_the_config_word_a_bad_size_alike(tmp_path: Path) -> None:
    bad = Layout(tp=0, pp=4, dp=2)
    with pytest.raises(ValueError) as topology:
        validate_layout(bad)
    assert str(topology.value) == f"{WORDS}; {SIZES_FIX}"

    with pytest.raises(RankscopeError) as plan:
        backup_plan(bad, ranks_per_machine=2)
    assert (plan.value.message, plan.value.fix) == (WORDS, SIZES_FIX)

    parser = argparse.ArgumentParser()
    add_layout_args(parser)
    with pytest.raises(RankscopeError) as cli:
        layout_from_args(parser.parse_args(["--tp", "0", "--pp", "4"]))
    assert cli.value.message == f"--{WORDS}"

    config = tmp_path / "rankscope.toml"
    config.write_text("[layout]\ntp = 0\npp = 4\n", encoding="utf-8")
    with pytest.raises(RankscopeError) as file:
        load_actions_config(config, tmp_path / "state")
    assert file.value.message == f"{config} [layout] {WORDS}" and file.value.fix == SIZES_FIX


@pytest.mark.parametrize("layout", [Layout(tp=2, pp=4, dp=4, ranks_per_machine=2), Layout(tp=2, cp=2),
                                    Layout(), Layout(pp=2, dp=2)])
def test_the_tui_header_shows_the_contracts_text_of_the_layout(layout: Layout) -> None:
    assert layout_text(layout) == layout.sizes_text(per_machine=True)
    assert layout_text(layout, per_machine=False) == layout.sizes_text()
    assert layout_text(None) == "layout unknown"


def test_the_layouts_text() -> None:
    assert Layout(tp=2, pp=4, dp=4, ranks_per_machine=2).sizes_text(per_machine=True) == "TP=2 PP=4 DP=4, 2/machine"
    assert Layout(tp=2, pp=4, dp=4, ranks_per_machine=2).sizes_text() == "TP=2 PP=4 DP=4"
    assert Layout(cp=2).sizes_text(per_machine=True) == "CP=2"
    assert Layout().sizes_text("all sizes 1", per_machine=True) == "all sizes 1"


def _layout_lists(source: str) -> list[int]:
    """Lines of literals that spell the layout's vocabulary: the five dimensions in Megatron's order (``DIMS``),
    or the dimensions' words (``DIM_WORDS``: three or more of 'tensor', 'pipeline', 'data', ...)."""
    words = set(DIM_WORDS.values())
    found = []
    for node in ast.walk(ast.parse(source)):
        elts = list(node.elts) if isinstance(node, ast.Tuple | ast.List) else \
            [*node.keys, *node.values] if isinstance(node, ast.Dict) else []
        strings = tuple(e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str))
        if strings == DIMS or len(words & set(strings)) >= 3:
            found.append(node.lineno)
    return found


def test_the_scan_finds_a_second_copy_of_the_layouts_vocabulary() -> None:
    assert _layout_lists('DIMS = ("tp", "cp", "ep", "dp", "pp")\n') == [1]
    assert _layout_lists('W = ["tensor", "pipeline", "data", "context"]\n') == [1]
    assert _layout_lists('M = {"tp": "tensor", "pp": "pipeline", "dp": "data"}\n') == [1]
    assert _layout_lists('PREFER = ("pp", "dp", "tp", "cp", "ep")\n') == [], "an order of preference is its own idea"


def test_no_module_but_the_contract_spells_the_layouts_vocabulary() -> None:
    offenders = [f"{path.relative_to(ROOT)}:{line}"
                 for folder in ("analyzers", "core", "probes", "tui")
                 for path in sorted((ROOT / folder).rglob("*.py"))
                 if path != ROOT / "core" / "contract" / "snapshot.py" and "proto" not in path.parts
                 for line in _layout_lists(path.read_text(encoding="utf-8"))]
    assert not offenders, "the layout's dimensions and their words belong in core/contract/snapshot.py:\n" + \
        "\n".join(offenders)
