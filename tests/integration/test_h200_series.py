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

from rankscope.analyzers.failslow import FailSlowConfig, replay
from rankscope.contract.bundle import read_bundle

SERIES = Path(__file__).resolve().parents[1] / "data" / "bundles" / "h200" / "healthy-pipeline.watch.json.gz"


def test_a_healthy_gpu_pipeline_raises_no_fail_slow_verdict(tmp_path: Path) -> None:
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
