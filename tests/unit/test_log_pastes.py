"""Evidence as people paste it: the part of a report that looks wrong, a JSON with a prompt above it, a rank RAS
names by GPU, and PyTorch's fingerprint diff read as a person would.

Texts are written from the formats' sources: NVIDIA/nccl src/ras/client_support.cc (the "Errors" and "Warnings"
blocks: ``#%d-%d (%016lx) MISMATCH``, ``Communicator ranks have different %s operation counts``, ``%d ranks have
launched up to operation %ld``, ``Rank %d has launched up to operation %ld -- GPU %s managed by process %d on node
%s``, ``Rank %d -- GPU %s managed by process %d on node %s``), and PyTorch's ProcessGroupWrapper.cpp
(``compute_collective_diff``: ``"  Op type: ", this_op, "vs ", other_op``, ``"  Tensor ", arg, ": ", curr, "vs "``).
"""

from __future__ import annotations

import contextlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rankscope.analyzers.findings import SuspectKind
from rankscope.analyzers.log_evidence import _fold_same_machine, analyze_logs
from rankscope.formats.incident_logs import log_kind, read_log_text, readable_aspects

WARNINGS_ONLY = """Warnings
========

#1-0 (5c3e0a7d91f2b846) MISMATCH
  Communicator ranks have different Broadcast operation counts
  15 ranks have launched up to operation 212
  Rank 9 has launched up to operation 209 -- GPU 1 managed by process 30117 on node gpu-b07
"""


def test_a_warnings_block_alone_names_the_rank_and_gpu_behind() -> None:
    assert log_kind(WARNINGS_ONLY) == "ras"
    ev = read_log_text(WARNINGS_ONLY, "paste.txt")
    assert len(ev.ras) == 1 and ev.ras[0].comms[0].size == 16
    v = analyze_logs(ev)
    top = v.suspects[0]
    assert top.kind is SuspectKind.MACHINE and top.machines == ("gpu-b07",)
    assert v.summary.startswith("communicator rank 9 (GPU 1, pid 30117) on gpu-b07 (behind in Broadcast")
    assert "209" in v.summary and "212" in v.summary


def test_a_block_without_its_header_line_is_read_and_said() -> None:
    body = "\n".join(WARNINGS_ONLY.splitlines()[4:]) + "\n"  # from "Communicator ranks have different" on
    ev = read_log_text("some words first\n" + body, "p.txt")
    v = analyze_logs(ev)
    assert v.suspects[0].machines == ("gpu-b07",)
    assert any("without its '#G-C (hash)' line" in n for n in v.notes)


def test_a_shortened_hash_still_opens_the_block() -> None:
    text = WARNINGS_ONLY.replace("(5c3e0a7d91f2b846)", "(5c3e…)")
    v = analyze_logs(read_log_text(text, "p.txt"))
    assert v.suspects[0].machines == ("gpu-b07",) and "#1-0 (5c3e…)" in v.suspects[0].evidence[0]


def test_the_minority_listed_ahead_in_an_excerpt_leaves_the_others_behind() -> None:
    """Two of eight ranks are ahead and listed; the six behind are only counted: the size comes from the counts."""
    text = ("#0-0 (0a0b0c0d0e0f1011) MISMATCH\n  Communicator ranks have different AllGather operation counts\n"
            "  6 ranks have launched up to operation 40\n  2 ranks have launched up to operation 41\n"
            "  Rank 3 -- GPU 3 managed by process 501 on node n1\n  Rank 6 -- GPU 2 managed by process 602 on node n2\n")
    v = analyze_logs(read_log_text(text, "p.txt"))
    assert v.suspects == ()  # no machine for the ranks behind: said, not blamed
    note = next(n for n in v.notes if "every member RAS did not list" in n)
    assert "communicator rank(s) 0-2,4-5,7" in note and "whether they are global ranks is unknown" in note


def _ras_json(n: int, behind: int) -> str:
    return json.dumps({"nccl_version": "2.28.7", "communicators": [{
        "hash": "0x5c3e", "size": n, "missing_ranks": [],
        "ranks": [{"rank": r, "host": f"node{r // 4}", "pid": 4000 + r, "cuda_dev": r % 4,
                   "collective_counts": {"AllReduce": 90 if r == behind else 93}} for r in range(n)]}]}, indent=2)


def test_ras_json_after_a_status_word_and_a_prompt_is_read() -> None:
    text = "OK\n$ ncclras -f json\n" + _ras_json(8, 5) + "\n$ \n"
    assert log_kind(text) == "ras-json"
    ev = read_log_text(text, "ras.txt")
    v = analyze_logs(ev)
    assert [s.ranks for s in v.suspects] == [(5,)]
    assert any("2 line(s) before the JSON skipped" in n and "'OK" in n for n in v.notes)
    assert any("text after the JSON skipped" in n for n in v.notes)


def test_an_incomplete_rank_is_named_by_rank_and_gpu_on_its_machine() -> None:
    """A communicator of 4 in a job of 8: RAS has no data from communicator rank 2 (GPU 6, process 7710 on nodeB);
    the other ranks on nodeB answered, so the headline names the rank and GPU, the machine is where it lives."""
    text = ("Errors\n======\n\nINCOMPLETE\n  Missing communicator data from 1 job process\n"
            "  Process 7710 on node nodeB managing GPU 6\n\n"
            "#0-1 (9f00aa11bb22cc33) INCOMPLETE\n  Missing communicator data from 1 rank\n"
            "  Rank 2 -- GPU 6 managed by process 7710 on node nodeB\n\n")
    v = analyze_logs(read_log_text(text, "ras.txt"))
    assert len(v.suspects) == 1
    top = v.suspects[0]
    assert top.kind is SuspectKind.MACHINE and top.machines == ("nodeB",)
    assert v.summary == "communicator rank 2 (GPU 6, pid 7710) on nodeB (not answering RAS)"
    assert any("Process" in e or "a process pid 7710" in e for e in top.evidence)


def test_two_processes_missing_on_one_machine_are_one_suspect_naming_both() -> None:
    text = ("INCOMPLETE\n  Missing communicator data from 2 job processes\n"
            "  Process 11 on node h7 managing GPU 0\n  Process 12 on node h7 managing GPU 1\n\n")
    v = analyze_logs(read_log_text(text, "ras.txt"))
    assert len(v.suspects) == 1
    assert v.summary == "process 11 (GPU 0) on h7 (not answering RAS); process 12 (GPU 1) on h7 (not answering RAS)"


def test_fingerprint_diff_reads_as_a_person_would() -> None:
    raw = "  Op type: ALLREDUCEvs BROADCAST  Tensor Tensor shapes: 25vs 1  Tensor Tensor dtypes: Floatvs Long"
    assert readable_aspects(raw) == "op type ALLREDUCE vs BROADCAST, shapes [25] vs [1], dtypes Float vs Long"
    assert readable_aspects("\t Sequence number: 1649vs 0  Op type: BARRIERvs GATHER") == \
        "sequence number 1649 vs 0, op type BARRIER vs GATHER"
    assert readable_aspects("not the shape") == "not the shape"
    line = ("[rank1]: RuntimeError: Detected mismatch between collectives on ranks. Rank 1 is running collective: "
            "CollectiveFingerPrint(SequenceNumber=12, OpType=ALLREDUCE, TensorShape=[25], TensorDtypes=Float, "
            "TensorDeviceTypes=TensorOptions(dtype=float, device=cuda)), but Rank 0 is running collective: "
            "CollectiveFingerPrint(SequenceNumber=12, OpType=BROADCAST, TensorShape=[1], TensorDtypes=Long, "
            "TensorDeviceTypes=TensorOptions(dtype=long, device=cuda)).Collectives differ in the following aspects: "
            + raw + "\n")
    v = analyze_logs(read_log_text(line, "rank1.log"))
    assert v.summary.endswith("(differ in: op type ALLREDUCE vs BROADCAST, shapes [25] vs [1], dtypes Float vs Long)")


def test_folding_many_blocks_on_one_machine_keeps_every_line_once() -> None:
    """200,000 communicator blocks naming processes on one host fold into one suspect (linear: timed in
    benchmarks/bench_logs.py, not here)."""
    from rankscope.analyzers.findings import Suspect

    n = 200_000
    many = [Suspect(SuspectKind.MACHINE, (), ("h1",), 0.9, (f"block {i}", "same line"), ("logs",),
                    title=f"communicator rank {i % 5} on h1 (not answering RAS)") for i in range(n)]
    other = Suspect(SuspectKind.RANK, (3,), ("h2",), 1.0, ("rank line",), ("logs",))
    out = _fold_same_machine([many[0], other, *many[1:]])
    assert [s.kind for s in out] == [SuspectKind.MACHINE, SuspectKind.RANK]
    assert len(out[0].evidence) == n + 1 and out[0].evidence[:3] == ("block 0", "same line", "block 1")
    assert out[0].title.count("communicator rank") == 3 and out[0].title.endswith("and 2 more")


# --------------------------------------------------------------------------
# Every reader on pasted input: truncated, prefixed, interleaved, binary
# --------------------------------------------------------------------------

_PASTES = [WARNINGS_ONLY, _ras_json(6, 2), "INCOMPLETE\n  Missing communicator data from 1 job process\n"
           "  Process 7710 on node nodeB managing GPU 6\n",
           "[rank1]:[E603 17:48:01.005 ProcessGroupNCCL.cpp:632] [Rank 1] Watchdog caught collective operation timeout: "
           "WorkNCCL(SeqNum=9, OpType=ALLREDUCE, NumelIn=8, NumelOut=8, Timeout(ms)=600000) ran for 600068 ms\n",
           '{"header": {"id": "0xab", "rank": 0, "n_ranks": 2}, "coll_perf": {"coll": "AllReduce", "coll_sn": 4, '
           '"coll_exec_time_us": 12.5}}\n',
           "Not all ranks joining collective 5 at entry 5\ngroup info: 0:default_pg\ncollective: nccl:all_reduce\n"
           "missing ranks: {1}\n"]
_PREFIXES = ["", "OK\n", "$ ncclras -v\n", "user@host:~$ cat out.txt\n", "{not json\n", "\x1b[0m>>> "]


@settings(max_examples=200, deadline=None)
@given(base=st.sampled_from(_PASTES), other=st.sampled_from(_PASTES), prefix=st.sampled_from(_PREFIXES),
       cut=st.integers(0, 1200), shape=st.sampled_from(["truncated", "interleaved", "binary"]),
       noise=st.binary(max_size=64))
def test_every_reader_takes_a_paste_as_people_make_it(base: str, other: str, prefix: str, cut: int, shape: str,
                                                      noise: bytes) -> None:
    """Clear notes, never a traceback: the text readers, the RAS parsers and the rules, on the same pastes cut,
    prefixed, interleaved line by line with another paste, or with binary bytes in them."""
    from rankscope.formats.nccl_inspector import parse_inspector
    from rankscope.formats.nccl_ras import parse_ras_json, parse_ras_text

    text = prefix + base
    if shape == "truncated":
        text = text[:cut]
    elif shape == "interleaved":
        a, b = text.split("\n"), other.split("\n")
        text = "\n".join(x for pair in zip(a, b, strict=False) for x in pair)
    else:
        text = text[:cut] + noise.decode("utf-8", errors="replace") + text[cut:]
    ev = read_log_text(text, "paste.txt")
    assert all(isinstance(n, str) and n for n in ev.notes)
    v = analyze_logs(ev, world=8)
    assert isinstance(v.summary, str) and v.summary
    _, notes = parse_ras_text(text, "r.txt")
    assert all(isinstance(n, str) for n in notes)
    with contextlib.suppress(ValueError, RecursionError):  # its documented refusal, which read_text turns into a note
        parse_ras_json(text, "r.json")
    parse_inspector(text, "i.json")


@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=1, max_size=2048), base=st.sampled_from(_PASTES))
def test_files_with_binary_bytes_are_read_or_said_not_read(tmp_path_factory: pytest.TempPathFactory, data: bytes,
                                                           base: str) -> None:
    from rankscope.formats.incident_logs import read_logs, scan

    folder = tmp_path_factory.mktemp("paste")
    (folder / "a.log").write_bytes(base.encode() + data)
    (folder / "b.log").write_bytes(data + base.encode())
    found = [s for s in scan(folder) if s.kind is not None]
    ev = read_logs(found)
    assert all(isinstance(n, str) for n in ev.notes)
    analyze_logs(ev)
