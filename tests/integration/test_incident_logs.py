"""`rankscope analyze FOLDER` on pasted logs: the public incidents in ../shared/external as posted, logs mixed with
py-spy dumps, and abridged dumps.

Each external case's right answer is written from its SOURCE.md:

- nccl-1730 (NVIDIA/nccl#1730): RAS RUNNING/OK over 256 ranks while rank 118's watchdog timed out in an
  ALLREDUCE it had enqueued (and 119 more after it): no rank is behind -> "not a rank".
- nccl-1762 (NVIDIA/nccl#1762): RAS INCOMPLETE, no data from process 60004 on node 10.4.109.13 (GPU 0, rank 1 of
  a 2-rank communicator in a 10-process job): that process and node, by host and pid (its global rank is not given).
- unige-bamboo (hpc-community.unige.ch/t/4301): all 4 ranks of one node time out in the first ALLGATHER
  (SeqNum=1, NumelOut/NumelIn = 4), each with it enqueued and nothing completed -> "not a rank", pointing at the
  node's transport setup.
- ms-swift-9443 (modelscope/ms-swift#9443): DETAIL check, ranks 0 and 1 in ALLREDUCE at SequenceNumber=3104 with
  different tensor shapes: a program mismatch of both ranks (a desync), neither picked by tie-break.
- pytorch-151666 (pytorch/pytorch#151666): fr_trace, COLLECTIVE_STATE_MISMATCH at seq 1487, culprit rank 1 at
  'completed' while rank 0 is at 'scheduled': rank 0 is the one less far along; fr_trace's culprit is only the
  rank that differs from the first one read, so rank 1 is not blamed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from rankscope.cli.main import main
from repo_paths import DATA, external

EXTERNAL = external()
needs_external = pytest.mark.skipif(EXTERNAL is None, reason="../shared/external is not beside this checkout")


def _analyze(capsys: pytest.CaptureFixture[str], path: Path, *flags: str) -> dict[str, object]:
    code = main(["analyze", str(path), "--json", *flags])
    out, err = capsys.readouterr()
    assert code == 0, err
    data: dict[str, object] = json.loads(out)
    return data


def _finding_kinds(data: dict[str, object]) -> list[str]:
    return [f["kind"] for f in data["findings"]]  # type: ignore[index,union-attr]


@needs_external
def test_nccl_1730_ras_ok_while_watchdog_timed_out_is_not_a_rank(capsys: pytest.CaptureFixture[str]) -> None:
    assert EXTERNAL is not None
    data = _analyze(capsys, EXTERNAL / "nccl-1730-ras-ok-while-pytorch-timeout")
    assert data["suspects"] == [] and _finding_kinds(data)[0] == "not-a-rank"
    assert str(data["summary"]).startswith("not a rank: NCCL RAS shows every communicator RUNNING")
    assert data["logs"] == {"files": ["excerpt.txt"], "watchdog_lines": 2, "ras_reports": 1, "fr_records": 0,
                            "detail_mismatches": 0, "inspector_ranks": 0}


@needs_external
def test_nccl_1762_names_the_process_ras_has_no_data_from(capsys: pytest.CaptureFixture[str]) -> None:
    assert EXTERNAL is not None
    data = _analyze(capsys, EXTERNAL / "nccl-1762-ras-incomplete-mismatch-nocomm")
    top = data["suspects"][0]  # type: ignore[index]
    assert top["kind"] == "machine" and top["machines"] == ["10.4.109.13"] and top["ranks"] == []
    assert "pid 60004" in " ".join(top["evidence"])
    assert len(data["suspects"]) == 1  # type: ignore[arg-type]
    assert any("cut off" in n for n in data["notes"])  # type: ignore[union-attr]


@needs_external
def test_unige_first_allgather_on_every_rank_is_not_a_rank(capsys: pytest.CaptureFixture[str]) -> None:
    assert EXTERNAL is not None
    data = _analyze(capsys, EXTERNAL / "unige-bamboo-gpu008-ddp-first-allgather-timeout")
    assert data["suspects"] == []
    f = data["findings"][0]  # type: ignore[index]
    assert f["kind"] == "not-a-rank" and f["ranks"] == [0, 1, 2, 3]
    assert any("first collective" in n for n in data["notes"])  # type: ignore[union-attr]


@needs_external
def test_ms_swift_detail_mismatch_is_one_desync_of_both(capsys: pytest.CaptureFixture[str]) -> None:
    assert EXTERNAL is not None
    data = _analyze(capsys, EXTERNAL / "ms-swift-9443-detail-collective-mismatch")
    top = data["suspects"][0]  # type: ignore[index]
    assert top["kind"] == "desync" and top["ranks"] == [0, 1]
    assert "3104" in str(data["summary"]) and "log-collective-mismatch" in _finding_kinds(data)


@needs_external
def test_pytorch_151666_state_mismatch_blames_the_rank_behind(capsys: pytest.CaptureFixture[str]) -> None:
    assert EXTERNAL is not None
    data = _analyze(capsys, EXTERNAL / "pytorch-151666-fr-trace-state-mismatch")
    assert [s["ranks"] for s in data["suspects"]] == [[0]]  # type: ignore[union-attr]
    assert "culprit rank 1" in " ".join(data["suspects"][0]["evidence"])  # type: ignore[index]


def test_logs_beside_abridged_dumps_are_one_verdict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A folder as a ticket holds it: per-rank logs with watchdog lines, and abridged py-spy pastes (a header, no
    Thread line, `...` and a note after a frame). Rank 2 never issued work 41: both the stacks (it is elsewhere)
    and the logs (its last enqueued work is 40) say so."""
    for r in range(4):
        behind = r == 2
        log = (f"[rank{r}]:[E1 ProcessGroupNCCL.cpp:2268] [PG ID 0 PG GUID 0(default_pg) Rank {r}]  failure detected "
               f"by watchdog at work sequence id: 41 PG status: last enqueued work: 41, last completed work: 40\n"
               if not behind else
               f"[rank{r}]:[E1 ProcessGroupNCCL.cpp:1746] [PG ID 0 PG GUID 0(default_pg) Rank {r}] Received a dump "
               "signal due to a collective timeout from  rank 0 and we will try our best to dump the debug info. Last "
               "enqueued NCCL work: 40, last completed NCCL work: 40.\n")
        (tmp_path / f"rank{r}.log").write_text(log)
        top = "    load_batch (data.py:77)  ← stuck here\n" if behind else \
            "    ... all_reduce (torch/distributed/distributed_c10d.py:2050)   ← 卡在这里\n"
        (tmp_path / f"rank{r}.txt").write_text(f"Process {100 + r}: python train.py\n{top}    train_step (train.py:9)\n"
                                               "    <module> (train.py:30)\n")
    data = _analyze(capsys, tmp_path)
    assert data["suspects"][0]["ranks"] == [2]  # type: ignore[index]
    sources = data["suspects"][0]["sources"]  # type: ignore[index]
    assert "logs" in sources and len(sources) >= 2
    assert not any("header but no threads" in n for n in data["notes"])  # type: ignore[union-attr]


def test_public_log_excerpts_route_by_content(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The excerpts in tests/data/logs are told apart by content, whatever the file is called."""
    src = DATA / "logs" / "nccl-1911-ras-minority-ahead" / "ras.txt"
    shutil.copy(src, tmp_path / "paste.log")
    data = _analyze(capsys, tmp_path / "paste.log")
    assert sorted(data["suspects"][0]["ranks"]) == [r for r in range(32) if r not in (12, 13)]  # type: ignore[index]
