"""The GPU's evidence as the profiler plugin gives it: NCCL's operation names, communicators by commHash with no
member ranks, kernel-channel timings. A skipped send in a pipeline, a DataLoader deadlock in a job that uses
send/recv, a late arriver and a slow link among the GPUs of one machine; and the join of the plugin's
communicators with the shim's torch groups."""

from __future__ import annotations

import numpy as np
from plugin_fixtures import ONE_GPU, PIPE, PluginJob, gpu_snapshot, loader_job, pipeline_job
from rankscope.analyzers.analysis import analyze_job
from rankscope.analyzers.failslow import FailSlowConfig, FailSlowDetector, FailSlowVerdict
from rankscope.analyzers.findings import SuspectKind
from rankscope.analyzers.topology import Topology, joined_counters
from rankscope.contract.snapshot import (
    Communicator,
    GpuMetrics,
    GpuStatus,
    Instant,
    JobSnapshot,
    Layout,
    MachineSnapshot,
    OpCounters,
    RankCounters,
    RankInfo,
)


def test_a_pipeline_stage_that_skipped_a_send_is_named_with_its_peer() -> None:
    """Rank 0 skipped its forward send and went on to its backward recv: it and rank 2 wait on each other's send.
    The pair is named; ranks 1 and 3 (their DP peers, waiting in all-reduces) are victims, never a desync."""
    verdict = analyze_job(gpu_snapshot(pipeline_job(skipped_send=0), PIPE)).verdict
    top = verdict.top
    assert top is not None, verdict.summary
    assert (top.kind, top.ranks, top.victims) == (SuspectKind.DESYNC, (0, 2), (1, 3)), verdict.summary
    assert verdict.summary.startswith("desync: ranks 0,2 of their PP group wait for each other's send/recv")
    lines = [e for s in verdict.suspects for e in s.evidence]
    assert "rank 0 waits in recv from rank 2 on comm 0a0a0a0a0a0a0a0a (PP group [0, 2]) (WC 39 < WR 40); " \
           "rank 2 never posted the matching send" in lines
    assert not any("Recv CL" in e or "Send CL" in e for e in lines), lines


def test_a_healthy_pipeline_names_nobody() -> None:
    verdict = analyze_job(gpu_snapshot(pipeline_job(), PIPE)).verdict
    assert verdict.top is None and verdict.summary.startswith("no verdict"), verdict.summary


def test_a_loader_deadlock_in_a_job_with_send_recv_names_the_loader_rank() -> None:
    """Ranks 0-1 only send and 2-3 only receive on the default communicator: their Send and Recv are never
    compared by launch count (the bug named "rank 0, 1, 2: Recv CL 0 < 31"); rank 1, waiting for a batch from
    its stuck DataLoader worker, is the root and the other three wait on it."""
    job, stacks = loader_job(stuck=1)
    verdict = analyze_job(gpu_snapshot(job, ONE_GPU, stacks)).verdict
    top = verdict.top
    assert top is not None, verdict.summary
    assert (top.kind, top.ranks, top.roots, top.victims) == (SuspectKind.RANK, (1,), (1,), (0, 2, 3)), verdict.summary
    assert verdict.summary.startswith("rank 1 on node0 (loading data; 3 ranks wait on it)")
    lines = [e for s in verdict.suspects for e in s.evidence]
    assert not any(" CL 0 <" in e or "Recv CL" in e or "recv CL" in e for e in lines), lines


def test_the_plugins_communicator_joins_the_shims_group_as_one_row() -> None:
    """The shim's DP group (no description: torch's "undefined") and NCCL's communicator of the same ranks are
    one communicator: one row per collective with the device's completion and TD, named by its layout role."""
    shim = Communicator("6", "nccl", "undefined", (1, 3))
    files = {}
    for place, r in enumerate((1, 3)):
        plugin = Communicator("35e426846b6fb3c4", "nccl", "", (), comm_nranks=2, comm_rank=place)
        files[r] = RankCounters(r, 1000 + r, 4, "j", 1.0, communicators=(shim, plugin), ops=(
            OpCounters("6", "all_reduce", 40, 40, 40, last_duration_s=0.5),
            OpCounters("35e426846b6fb3c4", "AllReduce", 40, 160, 159 if r == 3 else 160, last_duration_s=0.004),
            OpCounters("35e426846b6fb3c4", "Recv", 7, 28, 27, open_peers=(1 - place,))))
    topology = Topology(layout=Layout(tp=2, dp=2), world_size=4)
    joined = joined_counters(files, topology)
    for r, peer in ((1, 3), (3, 1)):
        rc = joined[r]
        assert [(c.comm_id, c.description, c.ranks) for c in rc.communicators] == [("6", "DP group [1, 3]", (1, 3))]
        rows = {o.op: o for o in rc.ops}
        assert set(rows) == {"all_reduce", "recv"} and all(o.comm_id == "6" for o in rc.ops)
        assert (rows["all_reduce"].cl, rows["all_reduce"].wr, rows["all_reduce"].last_duration_s) == (40, 160, 0.004)
        assert rows["recv"].open_peers == (peer,)
    assert joined[3].ops[0].wc == 159  # the device's completion: one request still open on rank 3


# --------------------------------------------------------------------------
# device time per rank: eight GPUs on one machine
# --------------------------------------------------------------------------

HASH = "35e426846b6fb3c4"


GPU_OF = (3, 7, 2, 6, 1, 5, 0, 4)  # rank -> the GPU NVML sees its process on: not its local rank


def _one_machine_series(n: int, late: int | None = None, slow_link: int | None = None,
                        gpus: str = "nvml") -> list[JobSnapshot]:
    """Eight ranks on one machine, one all-reduce per step as the plugin counts it: TD from the kernel-channel
    events, N from the proxy's last five requests. ``gpus``: "nvml" (the agent read each process's GPU, GPU_OF),
    "assumed" (the machine has GPUs but NVML placed no process), "none" (no GPU data on the machine)."""
    rng = np.random.default_rng(5)
    out = []
    for t in range(n):
        infos, files = [], []
        for r in range(8):
            td = 0.004 if r == late else 0.020 * (1 + 0.05 * rng.standard_normal())
            rate = 2e10 / 3 if r == slow_link else 2e10 * (1 + 0.05 * rng.standard_normal())
            comm = Communicator(HASH, "nccl", "", (), comm_nranks=8, comm_rank=r)
            op = OpCounters(HASH, "AllReduce", t + 1, 4 * (t + 1), 4 * (t + 1), last_duration_s=td,
                            recent_throughput=(rate,) * 5)
            infos.append(RankInfo(r, r, 8, 1000 + r, gpu=GPU_OF[r] if gpus == "nvml" else None,
                                  gpu_uuid=f"GPU-{GPU_OF[r]}" if gpus == "nvml" else None))
            files.append(RankCounters(r, 1000 + r, 8, "j", float(t), communicators=(comm,), ops=(op,), steps=t + 1,
                                      last_step_duration_s=0.1))
        status = (GpuStatus(available=False, reason="no GPU data: NVML sees no GPU on this machine") if gpus == "none"
                  else GpuStatus(available=True, gpus=tuple(GpuMetrics(i) for i in range(8))))
        machine = MachineSnapshot("gpu-host", "127.0.0.1:5000", True, Instant(1000.0 + t, 50.0 + t), ranks=tuple(infos),
                                  counters=tuple(files), gpus=status)
        out.append(JobSnapshot(Instant(1_700_000_000.0 + t, 100.0 + t), (machine,)))
    return out


def _watch(snaps: list[JobSnapshot]) -> FailSlowVerdict:
    det = FailSlowDetector(FailSlowConfig())
    last = None
    for s in snaps:
        last = det.update(s)
    assert last is not None
    return last


def test_a_late_arriver_among_the_gpus_of_one_machine_is_named_by_rank_and_gpu() -> None:
    """Its GPU is the one NVML saw its process on (GPU 5 for rank 5 here would be the local rank's guess)."""
    last = _watch(_one_machine_series(24, late=5))
    top = last.verdict.top
    assert top is not None and top.ranks == (5,), last.verdict.summary
    summary = last.verdict.summary
    assert summary.startswith("suspect, not a verdict: rank 5 (GPU 5) on gpu-host (non-communication slow) — "
                              "[ccl] rank 5 arrived last"), summary
    assert "below the" in summary and not last.confident  # the late-arriver test alone is a suspicion


def test_a_ranks_gpu_is_the_one_nvml_saw_its_process_on() -> None:
    last = _watch(_one_machine_series(24, late=2))
    assert last.verdict.summary.startswith("suspect, not a verdict: rank 2 (GPU 2) on gpu-host"), last.verdict.summary
    last = _watch(_one_machine_series(24, late=0))
    assert last.verdict.summary.startswith("suspect, not a verdict: rank 0 (GPU 3) on gpu-host"), last.verdict.summary


def test_without_nvml_placing_the_process_the_gpu_is_said_to_be_assumed_or_not_named() -> None:
    last = _watch(_one_machine_series(24, late=0, gpus="assumed"))
    assert last.verdict.summary.startswith(
        "suspect, not a verdict: rank 0 (GPU 0, assumed from its local rank) on gpu-host (non-communication slow)"), \
        last.verdict.summary
    last = _watch(_one_machine_series(24, late=0, gpus="none"))
    assert last.verdict.summary.startswith("suspect, not a verdict: rank 0 on gpu-host (non-communication slow)"), \
        last.verdict.summary


def test_a_slow_link_among_the_gpus_of_one_machine_is_communication_slow() -> None:
    last = _watch(_one_machine_series(24, slow_link=6))
    top = last.verdict.top
    assert top is not None and top.ranks == (6,), last.verdict.summary
    assert last.verdict.summary.startswith("suspect, not a verdict: rank 6 (GPU 0) on gpu-host (communication slow)"), \
        last.verdict.summary


def test_a_healthy_one_machine_job_names_no_gpu() -> None:
    last = _watch(_one_machine_series(24))
    assert last.verdict.top is None, last.verdict.summary
    assert not last.verdict.summary.startswith(("fail-slow", "suspect")), last.verdict.summary


def test_a_plugin_job_with_unjoinable_peers_drops_them_rather_than_misread_them() -> None:
    """A communicator of 4 places only 2 ranks report: the places cannot be turned into global ranks."""
    job = PluginJob(4)
    job.comm("f00df00df00df00d", (0, 1))
    files = job.files()
    files = {r: rc for r, rc in files.items() if r in (0, 1)}
    bigger = {r: RankCounters(rc.rank, rc.pid, 4, "j", 1.0,
                              communicators=(Communicator("f00df00df00df00d", "nccl", "", (), 4, r),),
                              ops=(OpCounters("f00df00df00df00d", "Recv", 3, 12, 11, open_peers=(3,)),))
              for r, rc in files.items()}
    joined = joined_counters(bigger)
    assert joined[0].ops[0].open_peers == () and joined[0].ops[0].op == "recv"


def test_the_tuis_ccl_table_shows_one_communicator_per_group_and_no_lag_between_senders_and_receivers() -> None:
    """The default communicator of the loader job: ranks 0-1 only send, 2-3 only receive; plugin-only counters."""
    from rankscope.tui.digest import digest

    job, stacks = loader_job(stuck=1)
    comms = {c.comm_id: c for c in digest(gpu_snapshot(job, ONE_GPU, stacks)).comms}
    world = comms["d0000000000000aa"]
    assert world.ranks == (0, 1, 2, 3)
    assert [(r.rank, r.cl, r.lags, r.open_requests) for r in world.rows] == [
        (0, 0, False, False), (1, 0, False, False), (2, 0, False, True), (3, 0, False, True)]
    tp = comms["7a7a7a7a7a7a7a7a"]  # rank 1 never launched the all-reduce rank 0 waits in
    assert [(r.rank, r.cl, r.lags) for r in tp.rows] == [(0, 10, False), (1, 9, True)]


def test_each_hang_says_which_of_c4s_kinds_it_is() -> None:
    from rankscope.analyzers.labels import hang_kind

    job, stacks = loader_job(stuck=1)
    assert hang_kind(analyze_job(gpu_snapshot(job, ONE_GPU, stacks)).verdict) == "non-communication hang"
    assert hang_kind(analyze_job(gpu_snapshot(pipeline_job(skipped_send=0), PIPE)).verdict) == "communication hang"
    assert hang_kind(analyze_job(gpu_snapshot(pipeline_job(), PIPE)).verdict) is None
