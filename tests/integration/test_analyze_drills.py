"""Real drills graded by the analyzer: a TP=2, PP=2, DP=2 job on 4 local machines, one hang each.

Each test starts ``rankscope drill --headless`` (real torchrun nodes, real
agents, real py-spy), lets it hang at a rank drawn from a fixed seed (hang-p2p:
rank 5, the job tests/integration/test_drill.py checks the capture and cleanup
of; ``headless_drills`` runs it once for both), reads the bundle it wrote and
checks that the verdict's top suspect is of the right kind and holds the
faulty machine. The drill stops every process it started; the fixture also
stops the drill's whole process group if the test fails or times out.
"""

from __future__ import annotations

import random

import pytest
from headless_drills import DRILL_TIMEOUT_S, HANG_P2P, HeadlessDrills
from rankscope.analyzers.analysis import analyze_snapshot
from rankscope.contract.bundle import read_bundle
from rankscope.drill.scoring import score_verdict

SEED = 20251121
WORLD = 8
# The progress stall that ends a drill's wait: 3 s of no step is a hang here as well as 5 s (the CLI's default).
STALL = ("--stall-seconds", "3")


def drawn_rank(fault: str) -> int:
    return random.Random(f"{SEED}-{fault}").randrange(WORLD)


# The kind each hang names first (the drill's registry says the same in its ground truth).
CASES = [("hang-compute", "rank"), ("hang-p2p", "pp"), ("hang-collective", "tp")]


@pytest.mark.drill
@pytest.mark.timeout(DRILL_TIMEOUT_S + 60)
@pytest.mark.parametrize("fault, kind", CASES, ids=[c[0] for c in CASES])
def test_drill_hang_is_found(headless_drills: HeadlessDrills, fault: str, kind: str) -> None:
    # hang-p2p is the job test_drill.py checks too (rank 5, step 6), run once for both
    fault, rank, step, *options = HANG_P2P if fault == "hang-p2p" else (fault, drawn_rank(fault), 5, *STALL)
    drill = headless_drills.run(fault, rank, step, *options)
    report = drill.report
    bundle = read_bundle(drill.bundle)
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
