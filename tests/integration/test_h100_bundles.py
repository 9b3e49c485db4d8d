"""The bundles the project's GPU check saved on a real H100 (NCCL 2.28.9, shim and profiler plugin loaded),
re-analysed on a CPU: each names its drill's ground truth.

A 4-rank job (TP=2, PP=2) on one GPU, two ranks per machine. The plugin names
point-to-point ``Send``/``Recv`` on communicators known by hash, size and place
only; the shim's torch groups carry the members. hang-p2p stops rank 3 before
its send to rank 1: the GPU's hosts all wait at their synchronisation point, so
only the counters (rank 1's open recv from rank 3, never posted) show the
pipeline pair. Copied from ``shared/gpu/h100-drills/`` (paths in them rewritten).
"""

from __future__ import annotations

import pytest
from rankscope.analyzers.analysis import analyze_job
from rankscope.contract.bundle import read_bundle
from rankscope.drill.scoring import score_verdict
from repo_paths import DATA

BUNDLES = DATA / "bundles" / "h100"


@pytest.mark.parametrize("fault, kind, ranks", [
    ("hang-p2p", "pp", (1, 3)),
    ("hang-compute", "rank", (3,)),
    ("hang-collective", "tp", (2, 3)),
])
def test_the_h100_drills_name_their_truth(fault: str, kind: str, ranks: tuple[int, ...]) -> None:
    bundle = read_bundle(BUNDLES / f"{fault}.bundle.json")
    truth = bundle.ground_truth
    assert truth is not None and truth["fault"] == fault and tuple(truth["suspect_ranks"]) == ranks
    verdict = analyze_job(bundle.latest).verdict
    top = verdict.top
    assert top is not None, verdict.summary
    assert (str(top.kind), top.ranks, top.roots) == (kind, ranks, (3,)), (verdict.summary, top.evidence)
    graded = score_verdict(verdict, truth)
    assert graded["correct"] and graded["ranks_ok"] and graded["machines_ok"], graded


def test_hang_p2p_reads_the_plugins_recv_as_point_to_point() -> None:
    """Rank 1 waits in NCCL's ``Recv`` from rank 3: a pair, never a CL lag across the communicator."""
    verdict = analyze_job(read_bundle(BUNDLES / "hang-p2p.bundle.json").latest).verdict
    lines = [e for s in verdict.suspects for e in s.evidence]
    assert not [e for e in lines if "Recv CL" in e or "recv CL" in e or "Send CL" in e], lines
    assert any("rank 1: recv" in e and "rank 3 has no open send to rank 1" in e for e in lines), lines


def test_rankscope_analyze_says_the_pair_and_the_kind_of_hang(capsys: pytest.CaptureFixture[str]) -> None:
    from rankscope.cli.main import main

    assert main(["analyze", str(BUNDLES / "hang-p2p.bundle.json")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("verdict: PP group #1 (ranks 1,3) on machine-0..1, root rank 3 (computing;"), out[:3]
    assert out[1] == "kind: non-communication hang"  # rank 3 stopped in its own code before its send
