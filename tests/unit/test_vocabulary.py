"""The contract's one vocabulary of operations: every writer's spelling, and no second list of names anywhere."""

from __future__ import annotations

import ast

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rankscope.contract.vocabulary import (
    OpKind,
    canonical_op,
    direction_word,
    is_point_to_point,
    known_spellings,
    matching_op,
    op_kind,
    operation,
)
from repo_paths import ROOT

# (spelling, canonical name, kind): NCCL's function names (the profiler plugin), torch's API (the shim),
# the flight recorder's profiling names.
SPELLINGS = [
    ("AllReduce", "all_reduce", OpKind.COLLECTIVE),
    ("all_reduce", "all_reduce", OpKind.COLLECTIVE),
    ("allreduce_coalesced", "all_reduce", OpKind.COLLECTIVE),
    ("nccl:all_reduce", "all_reduce", OpKind.COLLECTIVE),
    ("AllGather", "all_gather", OpKind.COLLECTIVE),
    ("_all_gather_base", "all_gather_into_tensor", OpKind.COLLECTIVE),
    ("ReduceScatter", "reduce_scatter", OpKind.COLLECTIVE),
    ("reduce_scatter_tensor", "reduce_scatter_tensor", OpKind.COLLECTIVE),
    ("Broadcast", "broadcast", OpKind.COLLECTIVE),
    ("barrier", "barrier", OpKind.COLLECTIVE),
    ("Send", "send", OpKind.P2P),
    ("Recv", "recv", OpKind.P2P),
    ("send", "send", OpKind.P2P),
    ("isend", "send", OpKind.P2P),
    ("irecv", "recv", OpKind.P2P),
    ("batch_isend_irecv", "send_recv", OpKind.P2P),
    ("SendRecv", "send_recv", OpKind.P2P),
    ("nccl:send 0->1", "send", OpKind.P2P),
    ("nccl:recv 1<-0", "recv", OpKind.P2P),
]


@pytest.mark.parametrize("spelling, name, kind", SPELLINGS)
def test_every_writers_spelling_has_one_meaning(spelling: str, name: str, kind: OpKind) -> None:
    op = operation(spelling)
    assert (op.name, op.kind, op.spelling) == (name, kind, spelling)
    assert op.known


def test_the_shims_and_the_plugins_names_are_one_operation() -> None:
    assert canonical_op("all_reduce") == canonical_op("AllReduce")
    assert canonical_op("recv") == canonical_op("Recv") == canonical_op("irecv")
    assert matching_op("Send") == "recv" and matching_op("irecv") == "send"
    assert matching_op("AllReduce") is None
    assert direction_word("Send") == "to" and direction_word("Recv") == "from"


@pytest.mark.parametrize("name", ["LOG", "coalesced", "MyFancyCollective", "sendfoo", ""])
def test_an_unknown_name_is_shown_as_written_never_guessed(name: str) -> None:
    op = operation(name)
    assert op.kind is OpKind.UNKNOWN and op.name == name and not op.known
    assert not is_point_to_point(name)


@given(st.text(max_size=40))
def test_any_text_gets_an_answer_and_unknown_keeps_its_spelling(text: str) -> None:
    op = operation(text)
    assert op.kind in OpKind
    if op.kind is OpKind.UNKNOWN:
        assert op.name == text
    else:
        assert op_kind(op.name) is op.kind  # a canonical name is known under itself


# --------------------------------------------------------------------------
# one definition: no module but the vocabulary keeps its own set of operation names
# --------------------------------------------------------------------------

SCANNED = ("analyzers", "core", "probes", "ccl_plugin", "tui", "benchmarks")
VOCABULARY = ROOT / "core" / "contract" / "vocabulary.py"


# Lists of names that are not operation spellings, though some read like them: words looked for inside py-spy
# frames' function names (``_communicate``, ``reduce_from``), the functions the plugin wraps, a benchmark's made-up
# counters.
NOT_SPELLINGS = {ROOT / "core" / "contract" / "frames.py", ROOT / "ccl_plugin" / "call_args.py",
                 ROOT / "benchmarks" / "fanout_source.py"}


def _is_data(node: ast.expr | None) -> bool:
    """A number (or a choice of two) or an empty container: a table keyed by names (counts, caches), not a meaning
    given to them."""
    if isinstance(node, ast.IfExp):
        return _is_data(node.body) and _is_data(node.orelse)
    return (isinstance(node, ast.Constant) and isinstance(node.value, int | float)) or (
        isinstance(node, ast.Dict | ast.List | ast.Set | ast.Tuple) and not getattr(node, "elts", getattr(node, "keys", ())))


def _listed(node: ast.AST) -> list[ast.expr | None]:
    """The entries of a literal that lists names: a set, tuple or list's elements, a mapping's keys (unless it only
    counts or caches under them), the strings an ``==`` chain joined by ``or``/``and`` compares with."""
    if isinstance(node, ast.Set | ast.Tuple | ast.List):
        return list(node.elts)
    if isinstance(node, ast.Dict) and not all(_is_data(v) for v in node.values):
        return list(node.keys)
    if isinstance(node, ast.BoolOp):
        return [c.comparators[0] for c in node.values if isinstance(c, ast.Compare) and len(c.comparators) == 1
                and isinstance(c.ops[0], ast.Eq | ast.NotEq)]
    return []


def name_sets(source: str) -> list[tuple[int, list[str]]]:
    """Set, tuple and list literals (``set([...])`` and ``frozenset((...))`` too, by the literal inside), mappings
    keyed by names and ``op == "send" or op == "recv"`` chains whose strings are mostly operation names (line,
    names)."""
    found: list[tuple[int, list[str]]] = []
    for node in ast.walk(ast.parse(source)):
        elts = _listed(node)
        if not elts:
            continue
        strings = [e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        ops = [s for s in strings if operation(s).known]
        if len(ops) >= 2 and 2 * len(ops) >= len(strings):
            found.append((getattr(node, "lineno", 0), ops))
    return found


def test_the_scan_finds_a_second_list_of_point_to_point_names() -> None:
    assert name_sets('P2P_OPS = frozenset({"send", "recv"})\n') == [(1, ["send", "recv"])]
    assert name_sets('_ALL = {"all_reduce", "allreduce_coalesced"}\n') == [(1, ["all_reduce", "allreduce_coalesced"])]
    assert name_sets('K = set(["Send", "Recv", "other"])\n') == [(1, ["Send", "Recv"])]
    assert name_sets('FRAMES = frozenset({"wait", "poll", "_recv", "recv", "accept", "select"})\n') == []
    # a family kept beside a reader as a tuple (the flight recorder's uneven-size ops were)
    assert name_sets('_UNEVEN = ("all_to_all", "scatter")\n') == [(1, ["all_to_all", "scatter"])]
    assert name_sets('if kind in ["gather", "scatter", "x"]: pass\n') == [(1, ["gather", "scatter"])]
    # a mapping that gives names a meaning, and a comparison chain, are lists of names too
    assert name_sets('KIND = {"send": "p2p", "recv": "p2p"}\n') == [(1, ["send", "recv"])]
    assert name_sets('p2p = op == "send" or op == "recv"\n') == [(1, ["send", "recv"])]
    # a table that counts or caches under names gives them no meaning
    assert name_sets('seen = {"send": 0, "recv": 0}\nslots = {"send": {}, "recv": {}}\n') == []


def test_no_module_but_the_vocabulary_defines_operation_names() -> None:
    offenders = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == VOCABULARY or path in NOT_SPELLINGS or "proto" in path.parts:
                continue
            for line, ops in name_sets(path.read_text(encoding="utf-8")):
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {ops}")
    assert not offenders, "operation names belong in core/contract/vocabulary.py:\n" + "\n".join(offenders)


def test_the_vocabulary_knows_its_own_spellings() -> None:
    names = known_spellings()
    assert len(names) == len(set(names))
    for n in names:
        assert operation(n).known, n
