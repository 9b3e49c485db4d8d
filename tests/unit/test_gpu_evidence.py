"""The GPU's evidence as the profiler plugin gives it: NCCL's operation names, communicators by commHash with no
member ranks, kernel-channel timings. A skipped send in a pipeline, a DataLoader deadlock in a job that uses
send/recv, a late arriver and a slow link among the GPUs of one machine; and the join of the plugin's
communicators with the shim's torch groups."""

from __future__ import annotations

import dataclasses

import numpy as np
from plugin_fixtures import ONE_GPU, PIPE, PluginJob, gpu_snapshot, loader_job, pipeline_job
from rankscope.analyzers.analysis import analyze_job
from rankscope.analyzers.failslow import FailSlowDetector
from rankscope.analyzers.failslow_config import FailSlowConfig
from rankscope.analyzers.failslow_vote import FailSlowVerdict
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


# --------------------------------------------------------------------------
# a victim of the slow rank is no suspect: TP2 x DP2, rank 3 slow
# --------------------------------------------------------------------------

TP_HASH = {0: "7a7a7a7a7a7a7a7a", 1: "8b8b8b8b8b8b8b8b"}  # TP groups (0, 1), (2, 3)
DP_HASH = {0: "9c9c9c9c9c9c9c9c", 1: "aeaeaeaeaeaeaeae"}  # DP groups (0, 2), (1, 3)


CP_HASH = "c0c0c0c0c0c0c0c0"  # a third group of ranks 2 and 3 (``mutual``)


def _tp_dp_series(n: int, ranks_per_machine: int, slow: int | None = 3, mutual: bool = False) -> list[JobSnapshot]:
    """Four ranks (TP=2, DP=2, tp fastest), one poll per step, each rank's TP and DP all-reduce as the plugin
    counts them (NCCL's names, commHash, no member ranks, the kernel-channel TD). ``slow`` computes slowly: its TP
    peer waits for it in their TP all-reduce in every other step's last call (a long TD there, the slow rank's
    short), and then both arrive last at their own DP all-reduces, the peer having waited. ``mutual``: ranks 2 and
    3 also share a third group in which rank 2 arrives last in every other step and rank 3 waits."""
    rng = np.random.default_rng(7)
    peer = None if slow is None else slow ^ 1
    out = []
    for t in range(n):
        files: dict[int, RankCounters] = {}
        infos: dict[int, RankInfo] = {}
        for r in range(4):
            tp, dp = r // 2, r % 2  # which TP group, which DP group

            def noisy(td: float) -> float:
                return td * (1 + 0.05 * rng.standard_normal())

            tp_late = t % 2 == 0
            tp_td = 0.002 if r == slow and tp_late else 0.040 if r == peer and tp_late else noisy(0.010)
            dp_td = 0.004 if r in (slow, peer) else noisy(0.030)
            comms: tuple[Communicator, ...] = (
                Communicator(TP_HASH[tp], "nccl", "", (), comm_nranks=2, comm_rank=r % 2),
                Communicator(DP_HASH[dp], "nccl", "", (), comm_nranks=2, comm_rank=r // 2))
            ops: tuple[OpCounters, ...] = (
                OpCounters(TP_HASH[tp], "AllReduce", 4 * (t + 1), 16 * (t + 1), 16 * (t + 1), last_duration_s=tp_td,
                           recent_throughput=(2e10,) * 5),
                OpCounters(DP_HASH[dp], "AllReduce", t + 1, 4 * (t + 1), 4 * (t + 1), last_duration_s=dp_td,
                           recent_throughput=(2e10,) * 5))
            if mutual and r in (2, 3):
                late_here = t % 2 == 1
                comms += (Communicator(CP_HASH, "nccl", "", (), comm_nranks=2, comm_rank=r - 2),)
                ops += (OpCounters(CP_HASH, "AllReduce", 2 * (t + 1), 8 * (t + 1), 8 * (t + 1),
                                   last_duration_s=(0.002 if r == 2 else 0.040) if late_here else noisy(0.010),
                                   recent_throughput=(2e10,) * 5),)
            files[r] = RankCounters(r, 1000 + r, 4, "j", float(t), communicators=comms, ops=ops, steps=t + 1,
                                    last_step_duration_s=0.1)
            infos[r] = RankInfo(r, r % ranks_per_machine, 4, 1000 + r, gpu=r % ranks_per_machine)
        machines = tuple(
            MachineSnapshot(f"machine-{m}", f"127.0.0.1:{5000 + m}", True, Instant(1000.0 + t, 50.0 + t),
                            ranks=tuple(infos[r] for r in mine), counters=tuple(files[r] for r in mine),
                            gpus=GpuStatus(available=True, gpus=tuple(GpuMetrics(i) for i in range(ranks_per_machine))))
            for m, mine in enumerate(range(i, i + ranks_per_machine) for i in range(0, 4, ranks_per_machine)))
        out.append(JobSnapshot(Instant(1_700_000_000.0 + t, 100.0 + t), machines))
    return out


def test_a_rank_late_only_because_it_waited_on_the_slow_rank_is_a_victim_not_a_suspect() -> None:
    """Rank 3 slow: rank 2 waited for it in their TP all-reduce and so came last to its own DP all-reduce, as
    rank 3 did to its. The tally once blamed both (the drill's evidence line named the victim); now only rank 3,
    with a note on rank 2."""
    for rpm, where in ((2, "machine-1"), (4, "machine-0")):
        last = _watch(_tp_dp_series(30, rpm))
        top = last.verdict.top
        assert top is not None and top.ranks == (3,) and top.machines == (where,), last.verdict.summary
        assert top.evidence[0].startswith(f"[ccl] rank 3 arrived last in 20 of its last 20 collectives on comm "
                                          f"{DP_HASH[1]}"), top.evidence
        assert not any("rank 2 arrived last" in e for e in top.evidence), top.evidence
        assert last.verdict.summary.startswith(f"suspect, not a verdict: rank 3 (GPU {3 % rpm}) on {where} "
                                               "(non-communication slow)"), last.verdict.summary
        note = next(n for n in last.verdict.notes if n.startswith("rank 2 arrives late"))
        assert f"waits on rank 3: on comm {TP_HASH[1]} rank 3 arrived last in" in note and "rank 2 in 0" in note


def test_the_victim_rule_rests_on_the_wait_in_the_shared_group() -> None:
    """The same DP lateness without rank 3 arriving last in the TP group both share: nothing says rank 2 waited
    on rank 3, so both stay blamed; and a healthy job blames nobody."""
    snaps = _tp_dp_series(30, 2)
    quiet = []
    for s in snaps:  # rank 3 never late in TP: its and rank 2's TP durations alike
        machines = []
        for m in s.machines:
            files = []
            for rc in m.counters:
                tp = rc.ops[0]
                files.append(dataclasses.replace(rc, ops=(dataclasses.replace(tp, last_duration_s=0.010), rc.ops[1])))
            machines.append(dataclasses.replace(m, counters=tuple(files)))
        quiet.append(dataclasses.replace(s, machines=tuple(machines)))
    top = _watch(quiet).verdict.top
    assert top is not None and top.ranks == (2, 3), top
    assert _watch(_tp_dp_series(30, 2, slow=None)).verdict.top is None


def test_two_ranks_each_waiting_on_the_other_somewhere_both_stay_blamed() -> None:
    """Rank 2 waited on rank 3 in their TP group and rank 3 on rank 2 in a third group: nothing says which one
    held the other up first, so neither is let off as a victim."""
    last = _watch(_tp_dp_series(30, 2, mutual=True))
    top = last.verdict.top
    assert top is not None and top.ranks == (2, 3), last.verdict.summary
    assert not any("arrives late at its collectives because it waits on rank" in n for n in last.verdict.notes)


def test_a_suspicion_reads_as_one_in_watch_and_the_tui() -> None:
    """The late-arriver test alone stays below the confidence bar: `rankscope watch` (its line and its JSON)
    and the TUI's Fail-slow view say suspect with its confidence, never a fail-slow verdict."""
    from rankscope.cli.commands.watch import human_line, verdict_event
    from rankscope.tui.failslow_state import FailSlowTracker
    from rankscope.tui.widgets.failslow import summary_text

    snaps = _one_machine_series(24, late=5)
    last = _watch(snaps)
    assert not last.confident
    event = verdict_event(last, snaps[-1], snaps[0].captured.mono)
    assert (event["confident"], event["machine"], event["ranks"]) == (False, "gpu-host", [5])
    line = human_line(event)
    assert "] suspect, not a verdict: rank 5 (GPU 5) on gpu-host (non-communication slow) — [ccl]" in line, line
    assert "below the 0.70 bar" in line and "fail-slow:" not in line, line

    view = FailSlowTracker().feed_series((s, None) for s in snaps)
    text = summary_text(view)
    assert text.plain.startswith("suspect, not a verdict: rank 5 (GPU 5) on gpu-host"), text.plain
    assert "(confident)" not in text.plain
    assert all("red" not in str(span.style) for span in text.spans), text.spans  # drawn as a suspicion, not an alarm


def _with_backend(snap: JobSnapshot, backend: str) -> JobSnapshot:
    """The same poll with every communicator of ``backend`` (as a gloo job's shim would have written them)."""
    machines = tuple(dataclasses.replace(m, counters=tuple(
        dataclasses.replace(rc, communicators=tuple(dataclasses.replace(c, backend=backend) for c in rc.communicators))
        for rc in m.counters)) for m in snap.machines)
    return dataclasses.replace(snap, machines=machines)


def test_a_pipelines_last_stage_standing_apart_on_the_host_is_no_verdict_on_a_gpu_job() -> None:
    """On the H200 a healthy 4-rank pipeline had every stack round flag its last stage (machine-1, ranks 2-3: they
    sit in train_step while the first stage waits at its sync point) and that alone made a confident fail-slow
    verdict: a false alarm. On a job whose collectives run on the GPU the host's stacks are one vote below the bar;
    on CPU (gloo) the same rounds still name the group."""
    from rankscope.analyzers.findings import Suspect
    from rankscope.analyzers.rounds import StackRound

    last_stage = StackRound(Suspect(SuspectKind.PP, (2, 3), ("machine-1",), 1.0, ("outliers",), group_index=1), 2, "x")
    healthy = _tp_dp_series(12, 2, slow=None)
    for backend, confident in (("nccl", False), ("gloo", True)):
        det = FailSlowDetector(FailSlowConfig(rounds_needed=5))
        last = None
        for s in healthy:
            last = det.update(_with_backend(s, backend), last_stage)
        assert last is not None and det.on_device is (backend == "nccl")
        assert last.confident is confident, (backend, last.verdict.summary)
        top = last.verdict.top
        assert top is not None and top.ranks == (2, 3) and top.machines == ("machine-1",), last.verdict.summary
        prefix = "fail-slow: " if confident else "suspect, not a verdict: "
        assert last.verdict.summary.startswith(prefix), last.verdict.summary


def test_the_stacks_group_and_the_counters_late_arriver_name_the_rank_together() -> None:
    """Rank 3 slow: the stack rounds flag its pipeline stage (ranks 2-3), the plugin's TD names rank 3. Together
    they pass the bar, and the verdict names the rank both point at, with its GPU, not the whole group."""
    from rankscope.analyzers.findings import Suspect
    from rankscope.analyzers.rounds import StackRound

    stage = StackRound(Suspect(SuspectKind.PP, (2, 3), ("machine-1",), 1.0, ("outliers",), group_index=1), 2, "x")
    det = FailSlowDetector(FailSlowConfig(rounds_needed=5))
    last = None
    for s in _tp_dp_series(30, 2):
        last = det.update(s, stage)
    assert last is not None and last.confident, last.verdict.summary
    top = last.verdict.top
    assert top is not None and top.ranks == (3,) and top.machines == ("machine-1",), last.verdict.summary
    assert set(top.sources) == {"ccl", "stacks"}, top.sources
    assert last.verdict.summary.startswith("fail-slow: rank 3 (GPU 1) on machine-1 (non-communication slow) — "), \
        last.verdict.summary
