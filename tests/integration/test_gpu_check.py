"""benchmarks/gpu_check.py where no GPU is: it stops at once with the reason, and its pieces work without CUDA."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import ROOT

torch = pytest.importorskip("torch")
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402

CHECK = ROOT / "benchmarks" / "gpu_check.py"


def finished(proc: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the check")
def test_without_cuda_it_exits_at_once_with_the_reason() -> None:
    # Both runs at once: each spends its time importing torch, and CI has two cores.
    runs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for argv in ([sys.executable, str(CHECK)], [sys.executable, str(CHECK), "--json", "--parts", "drills"])]
    text, as_json = (finished(p) for p in runs)
    assert text.returncode == 2 and as_json.returncode == 2, text.stderr + as_json.stderr
    assert "torch.cuda.is_available() is False" in text.stdout and "CPU build" in text.stdout
    assert "Traceback" not in text.stdout + text.stderr
    report = json.loads(as_json.stdout)
    # no part started (no build, no drill, no bench): the report holds the env part alone
    assert list(report["parts"]) == ["env"] and "no CUDA here" in report["parts"]["env"]["error"]


def test_unknown_parts_are_refused() -> None:
    assert gpu_check.main(["--parts", "env,warp"]) == 2


def test_the_working_tree_imports_as_rankscope_through_links(tmp_path: Path) -> None:
    site = gpu_check.tree_site(tmp_path / "site")
    code = ("import rankscope.drill.gpu, rankscope.ccl_plugin.torch_hooks, rankscope.probes.gpu;"
            "print(rankscope.__file__)")
    out = subprocess.run([sys.executable, "-c", code], env=gpu_check.child_env(site), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(site))


def test_the_report_says_what_failed_and_still_shows_the_rest() -> None:
    drill = {"fault": "hang-compute", "seconds": 50.0, "truth": [3], "truth_machines": ["machine-1"],
             "verdict": "rank 3 on machine-1 (computing; 3 ranks wait on it) (stacks + ccl)", "correct": True,
             "named_ranks": [3], "stall": "stalled", "steps": {"0": 8}, "died": [], "leftovers": [],
             "counters": {"0": ["TENSOR_MODEL_PARALLEL_GROUP[0/2] all_reduce 41/41/40 OPEN"]},
             "nvml_during": [{"index": 0, "util_percent": 100.0, "power_w": 128.0}], "notes": []}
    result = {"backend": "nccl", "budget_s": 470.0, "seconds": 300.0, "parts": {
        "build": {"error": "RuntimeError: no C compiler found; fix: install one"},
        "drills": {"data": {"hang-compute": drill,
                            "hang-p2p": {"fault": "hang-p2p", "error": "drill exit 1 after 3 s", "tail": "boom"}}},
    }}
    text = "\n".join(gpu_check.report_lines(result))
    assert "[build] FAILED: RuntimeError: no C compiler found" in text
    assert "[drill hang-compute] RIGHT: verdict 'rank 3 on machine-1" in text
    assert "r0: TENSOR_MODEL_PARALLEL_GROUP[0/2] all_reduce 41/41/40 OPEN" in text
    assert "rank died: no" in text and "util 100.0 %, 128.0 W" in text
    assert "[drill hang-p2p] ERROR drill exit 1 after 3 s" in text and "    boom" in text


def test_the_evidence_drills_are_graded_and_a_shared_gpu_is_said() -> None:
    skip = {"fault": "skip-send", "seconds": 30.0, "truth": [1, 3], "truth_machines": ["machine-0", "machine-1"],
            "verdict": "desync: ranks 1,3 of their PP group wait for each other's send/recv (one skipped or "
                       "reordered a send) (stacks + ccl)", "correct": True, "named_ranks": [1, 3], "stall": "stalled",
            "steps": {"0": 8}, "died": [], "leftovers": [], "counters": {}, "nvml_during": [], "notes": []}
    healthy = {**skip, "fault": "none", "truth": [], "truth_machines": [], "verdict": "no verdict: all 4 ranks show "
               "the same stacks", "named_ranks": None, "stall": "finished"}
    result = {"backend": "nccl", "budget_s": 470.0, "seconds": 100.0, "parts": {
        "env": {"data": {"python": "3.12", "torch": "2.11", "cuda_build": "13.0", "nccl": "2.28.9",
                         "gpus": ["NVIDIA H100"], "rankscope": "installed", "agents": True,
                         "missing_agent_modules": [], "py_spy": True, "pynvml": True}},
        "evidence": {"data": {"skip-send": skip, "none": healthy}},
    }}
    text = "\n".join(gpu_check.report_lines(result))
    assert "[evidence] the drill's 4 ranks share 1 GPU(s): their kernels interfere" in text
    assert "[drill skip-send] RIGHT: verdict 'desync: ranks 1,3 of their PP group" in text
    assert "[drill none] RIGHT: verdict 'no verdict" in text
    assert gpu_check.EVIDENCE_FAULTS == ("skip-send", "dataloader-deadlock", "none")
    assert "evidence" in gpu_check.PARTS


def test_each_ranks_counters_are_one_row_per_collective() -> None:
    """The H100 hang-p2p bundle: the shim's and the plugin's rows of one collective are shown once, under the torch
    group, with NCCL's peers as global ranks."""
    from repo_paths import DATA

    per_rank, _ = gpu_check._counters_of(DATA / "bundles" / "h100" / "hang-p2p.bundle.json")
    assert per_rank["1"] == ["TENSOR_MODEL_PARALLEL_GROUP[1/2] all_reduce 144/546/545 OPEN",
                             "PIPELINE_MODEL_PARALLEL_GROU[0/2] send 36/36/36",
                             "PIPELINE_MODEL_PARALLEL_GROU[0/2] recv 36/33/32 OPEN peers [3]"]
