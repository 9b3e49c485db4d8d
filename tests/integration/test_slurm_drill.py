"""`rankscope drill --launcher slurm`: the README's incident end to end on a real local Slurm cluster.

A 4-rank TP2 x PP2 job on two Slurm nodes hangs in a pipeline send; the drill
attaches by job id, the analyzers name the pipeline group, its nodes are
evicted through Slurm (drained, job requeued) and the job restarts on the two
standby nodes, resuming from its checkpoint past the step where it hung.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from agent_helpers import clean_env
from rankscope.drill.slurm_cluster import ensure_installed
from test_slurm import agent_processes

RANKSCOPE = Path(sys.executable).parent / "rankscope"


@pytest.mark.drill
@pytest.mark.slurm
@pytest.mark.timeout(1500)
@pytest.mark.skipif(os.environ.get("RANKSCOPE_LONG_TESTS") != "1",
                    reason="4-6 min on 2 cores, beyond what the default suite's 20 min budget has left "
                           "(tests/integration/test_slurm.py covers attach, eviction and follow on the real cluster in the "
                           "default run). Run with RANKSCOPE_LONG_TESTS=1.")
def test_slurm_drill_hang_evict_drain_requeue_resume(tmp_path: Path) -> None:
    why = ensure_installed()
    if why is not None:
        pytest.skip(why)
    run_dir = tmp_path / "drill"
    env = clean_env()
    env.pop("SLURM_CONF", None)  # the drill starts its own cluster
    proc = subprocess.run([str(RANKSCOPE), "drill", "--launcher", "slurm", "--tp", "2", "--pp", "2", "--dp", "1",
                           "--machines", "2", "--fault", "hang-p2p", "--fault-rank", "1", "--fault-step", "10",
                           "--checkpoint-every", "5",
                           "--run-dir", str(run_dir), "--json"],
                          env=env, capture_output=True, text=True, timeout=1400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["nodes"] == ["node1", "node2"]
    assert sorted(report["suspect_ranks"]) == sorted(report["truth_ranks"]) == [1, 3]  # the hung PP group
    assert sorted(report["evicted"]) == ["node1", "node2"]
    assert report["drained"] == {"node1": "drained", "node2": "drained"}
    assert sorted(report["restarted_on"]) == ["node3", "node4"]  # the standbys
    hung_at = max(report["stalled_at_steps"].values())
    assert len(report["resumed_steps"]) == 4 and all(s > hung_at for s in report["resumed_steps"].values())
    assert "rankscope drill: start on node[3-4], restart 1" in report["resumed_from"]
    # Each node's agent recorded its eviction: the first drained both nodes and requeued the job, the other
    # found its node drained and the job requeued (its own commands ended by that requeue, or refused).
    for node in report["evicted"]:
        assert report["audit"][node][-1].startswith("succeeded:"), report["audit"]
    # Nothing left running: no agent, no Slurm daemon or job process of the drill's cluster.
    assert agent_processes() == []
    leftover = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True).stdout.split()
    assert leftover == []
