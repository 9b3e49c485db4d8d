"""A healthy pipeline watched live on an H200 (the GPU check's slow part, 4 ranks TP2×PP2 sharing one GPU, shim and
NCCL plugin loaded), replayed through the fail-slow detector: the series `rankscope watch --record` keeps.

On that GPU every host waits at the same synchronisation call and the last stage always stands apart on the host,
and the second stage's recv is posted ahead and stays open on the device. Before, the stack rounds alone made a
confident verdict on machine-1 (a false alarm), and the pipeline waits, compared with every rank for want of a
replica (DP=1), named rank 1.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
from rankscope.analyzers.failslow import replay
from rankscope.analyzers.failslow_config import FailSlowConfig
from rankscope.cli.main import main
from rankscope.contract.bundle import read_bundle

SERIES = Path(__file__).resolve().parents[1] / "data" / "bundles" / "h200" / "healthy-pipeline.watch.json.gz"


def test_a_healthy_gpu_pipeline_raises_no_fail_slow_verdict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "watch.json"
    path.write_bytes(gzip.decompress(SERIES.read_bytes()))
    bundle = read_bundle(path)
    assert bundle.ground_truth is not None and bundle.ground_truth["fault"] == "none"
    verdicts = replay(bundle.snapshots, FailSlowConfig(rounds_needed=5), bundle.snapshots[0].layout)
    assert len(verdicts) == 42
    assert not any(v.confident for v in verdicts), [v.verdict.summary for v in verdicts if v.confident][:1]
    assert not any(f.detector == "p2p_wait" for v in verdicts for f in v.flags)
    # the host's stacks still see the last stage apart, and say so as a suspicion with its confidence
    worded = [v.verdict.summary for v in verdicts if v.verdict.top is not None]
    assert worded and all(s.startswith("suspect, not a verdict: ") for s in worded), worded[:1]

    # `rankscope analyze` of the same series words its stack rounds' degrader as the suspicion it is
    assert main(["analyze", str(path)]) == 0
    out = capsys.readouterr().out
    assert "  suspect, not a verdict: machine machine-1 (ranks 2-3) flagged in 10 of the last 14 rounds; next: rank 2 (3) (the job's " \
           "collectives run on a GPU" in out, out[-1500:]
    assert "degrader:" not in out
