"""Real drills graded by the analyzer: a TP=2, PP=2, DP=2 job on 4 local machines, one hang each.

Each test starts ``rankscope drill --headless`` (real torchrun nodes, real
agents, real py-spy), lets it hang at a rank drawn from a fixed seed, reads
the bundle it wrote and checks that the verdict's top suspect is of the
right kind and holds the faulty machine. The drill stops every process it
started; the fixture also stops the drill's whole process group if the test
fails or times out.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from rankscope.analyzers.analysis import analyze_snapshot
from rankscope.contract.bundle import read_bundle
from rankscope.drill.scoring import score_verdict

SEED = 20251121
WORLD = 8
DRILL_TIMEOUT_S = 420


class DrillRunner:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[str]] = []

    def run(self, fault: str, rank: int) -> tuple[dict[str, object], Path]:
        bundle = self.tmp / f"{fault}-{rank}.json"
        cmd = [sys.executable, "-m", "rankscope", "drill", "--headless", "--json", "--fault", fault,
               "--fault-rank", str(rank), "--fault-step", "5", "--run-dir", str(self.tmp / f"run-{fault}"),
               "-o", str(bundle)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        self.procs.append(proc)
        out, err = proc.communicate(timeout=DRILL_TIMEOUT_S)
        assert proc.returncode == 0, f"drill failed ({proc.returncode}):\n{err[-3000:]}"
        return json.loads(out), bundle

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)  # the drill stops its job and agents on SIGTERM
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)


@pytest.fixture
def drills(tmp_path: Path) -> Iterator[DrillRunner]:
    runner = DrillRunner(tmp_path)
    try:
        yield runner
    finally:
        runner.stop()


# The kind each hang names first (the drill's registry says the same in its ground truth).
CASES = [("hang-compute", "rank"), ("hang-p2p", "pp"), ("hang-collective", "tp")]


@pytest.mark.drill
@pytest.mark.timeout(DRILL_TIMEOUT_S + 60)
@pytest.mark.parametrize("fault, kind", CASES, ids=[c[0] for c in CASES])
def test_drill_hang_is_found(drills: DrillRunner, fault: str, kind: str) -> None:
    rank = random.Random(f"{SEED}-{fault}").randrange(WORLD)
    report, bundle_path = drills.run(fault, rank)
    bundle = read_bundle(bundle_path)
    truth = bundle.ground_truth
    assert truth is not None and truth["rank"] == rank and truth["suspect_kind"] == kind
    verdict = analyze_snapshot(bundle.latest)
    graded = score_verdict(verdict, truth)
    top = verdict.top
    assert top is not None, verdict.summary
    assert truth["machine"] in top.machines, (verdict.summary, truth)
    assert str(top.kind) == kind, (verdict.summary, top.evidence)
    assert graded["correct"] and graded["truth_position"] == 1
    # the drill's own report carries the same verdict
    drill_verdict = report.get("verdict")
    assert isinstance(drill_verdict, dict) and drill_verdict.get("top") is not None
