"""Every rank's stacks the same, inside the same wait: that is the finding ("not a rank", the stall is below the
ranks), with the next evidence to fetch. The same stacks in the ranks' own work stay "no verdict".

Stacks are py-spy's text format (``Process N: cmdline``, ``Thread N (active): "MainThread"``, ``name (file:line)``
innermost first) of a DDP step: PyTorch's autograd engine (``_engine_run_backward`` in torch/autograd/graph.py,
called from ``torch.autograd.backward`` and ``Tensor.backward``), where DDP's gradient all-reduce runs from C++.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rankscope.cli.main import main

BACKWARD = ("    _engine_run_backward (torch/autograd/graph.py:769)\n    backward (torch/autograd/__init__.py:289)\n"
            "    backward (torch/_tensor.py:521)\n")
FORWARD = "    matmul_chunk (model.py:41)\n    forward (model.py:57)\n    _call_impl (torch/nn/modules/module.py:1747)\n"
LOADER = ("    _next_data (torch/utils/data/dataloader.py:1285)\n    __next__ (torch/utils/data/dataloader.py:701)\n")


def _write(folder: Path, tops: dict[int, str]) -> None:
    for r, top in tops.items():
        (folder / f"rank{r}.txt").write_text(
            f"Process {5100 + r}: /usr/bin/python3 -u train.py --local_rank={r}\nPython v3.10.12 (/usr/bin/python3)\n\n"
            f"Thread {5100 + r} (active): \"MainThread\"\n{top}    train_step (train.py:88)\n    main (train.py:140)\n"
            "    <module> (train.py:160)\n")


def _analyze(capsys: pytest.CaptureFixture[str], path: Path) -> dict[str, object]:
    assert main(["analyze", str(path), "--json"]) == 0
    data: dict[str, object] = json.loads(capsys.readouterr().out)
    return data


def test_every_rank_in_the_same_backward_is_a_stall_below_the_ranks(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path, dict.fromkeys(range(4), BACKWARD))
    data = _analyze(capsys, tmp_path)
    assert data["suspects"] == []
    summary = str(data["summary"])
    assert summary.startswith("not a rank: all 4 ranks (ranks 0-3) show the same stacks, waiting in "
                              "_engine_run_backward (graph.py)")
    assert "below the ranks: the communication layer, the network, a driver, or a GPU kernel" in summary
    f = data["findings"][0]  # type: ignore[index]
    assert f["kind"] == "not-a-rank" and f["ranks"] == [0, 1, 2, 3]
    evidence = " ".join(f["evidence"])
    assert "inside backward" in evidence and "py-spy dump --native" in evidence and "dmesg" in evidence


def test_every_rank_in_its_data_loader_points_at_what_they_all_read(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path, dict.fromkeys(range(3), LOADER))
    data = _analyze(capsys, tmp_path)
    assert data["suspects"] == [] and "shared storage" in str(data["summary"])


def test_the_same_stacks_in_their_own_work_stay_no_verdict(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path, dict.fromkeys(range(4), FORWARD))
    data = _analyze(capsys, tmp_path)
    assert data["summary"] == "no verdict: all 4 ranks show the same stacks" and data["findings"] == []


def test_one_rank_elsewhere_is_no_symmetric_stall(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path, {0: BACKWARD, 1: BACKWARD, 2: LOADER, 3: BACKWARD})
    data = _analyze(capsys, tmp_path)
    assert data["suspects"][0]["ranks"] == [2]  # type: ignore[index]
    assert not str(data["summary"]).startswith("not a rank")
