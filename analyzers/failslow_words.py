"""The fail-slow verdict's words: its one-line summary, the rank and GPU the counters name, and which of C4's two
slow kinds (communication or not) its strongest evidence shows."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from rankscope.analyzers.failslow_config import FailSlowConfig
from rankscope.analyzers.failslow_vote import DEVICE_DETECTORS, DetectorFlag
from rankscope.analyzers.findings import Suspect, SuspectKind
from rankscope.analyzers.labels import suspect_label
from rankscope.analyzers.step_time import StepTrend
from rankscope.contract.frames import is_communication

# Interconnect throughput: a host or GPU metric whose outlier is a link's, not a computer's
_LINK_METRICS = frozenset({"gpu_pcie_kbps", "gpu_nvlink_kbps"})


def slow_kind(lead: DetectorFlag, ranks: Collection[int] = (), frame: str | None = None,
              slow_send: bool = False) -> str:
    """Which of C4's two slow kinds a suspect (``ranks``) shows, from its strongest evidence (``lead``).

    Communication slow: a slow link (the counters' N > β·mean, their common end among ``ranks``), an interconnect
    metric (PCIe, NVLink) beyond its peers, stack rounds whose outliers part from the others in a communication
    call (``frame``: they sit in a send, a recv or a collective while the others have moved on), or the counters'
    blame of a rank whose pipeline peers wait on its send/recv while its sampled stacks wait as much as theirs, more
    of them in its send/recv (``slow_send``): the slow link between it and the ranks waiting (Aegis §5.2).
    Non-communication slow otherwise: a late arriver or a rank its peers wait on that waits less than they do (it
    computes, loads or is fed slowly), a slow step, a busy host or GPU, a rank's sampled stacks in its own work.
    """
    if lead.detector == "ccl" and set(lead.link_ranks) & set(ranks or lead.ranks):
        return "communication slow"
    if lead.detector in ("metrics", "minder") and lead.metric in _LINK_METRICS:
        return "communication slow"
    if lead.detector == "stacks" and frame is not None and is_communication(frame):
        return "communication slow"
    if lead.detector in DEVICE_DETECTORS and slow_send:
        return "communication slow"
    return "non-communication slow"


def rank_gpu(rank: int, gpu_of: Mapping[int, tuple[int, bool]]) -> str:
    """``rank 5 (GPU 2)`` where NVML placed its process, ``rank 5 (GPU 5, assumed from its local rank)`` on a
    machine with GPUs where it did not, ``rank 5`` without GPUs (``gpu_of``: rank -> its GPU and whether NVML said
    so)."""
    gpu = gpu_of.get(rank)
    if gpu is None:
        return f"rank {rank}"
    return f"rank {rank} (GPU {gpu[0]})" if gpu[1] else f"rank {rank} (GPU {gpu[0]}, assumed from its local rank)"


def gpu_words(top: Suspect, ranks_of: Callable[[str], tuple[int, ...]], gpu_of: Mapping[int, tuple[int, bool]]) -> str:
    """The counters' unit is the rank and its GPU: ``rank 5 (GPU 5) on m0`` when their evidence names fewer
    ranks than the machine holds (several GPUs of one machine, or a one-machine job); "" otherwise."""
    if not set(top.sources) & set(DEVICE_DETECTORS) or len(top.machines) != 1:
        return ""
    if set(top.ranks) >= set(ranks_of(top.machines[0])):
        return ""
    return f"{', '.join(rank_gpu(r, gpu_of) for r in top.ranks)} on {top.machines[0]}"


@dataclass(frozen=True, slots=True)
class Scene:
    """What the summary reads besides the suspects: the config, the machines' ranks and GPUs, the reachable
    machines and whether any snapshot was taken."""

    config: FailSlowConfig
    ranks_of: Callable[[str], tuple[int, ...]]
    gpu_of: Mapping[int, tuple[int, bool]]
    reachable: int
    snapshots: int


def summary(scene: Scene, suspects: list[Suspect], flags: list[DetectorFlag], conf: float, trend: StepTrend | None,
            confident: bool = True, c4_kind: str | None = None) -> str:
    """The verdict's line: the named suspect (a suspicion below the bar), what is being watched, or why none."""
    cfg = scene.config
    if suspects:
        top = suspects[0]
        lead = top.evidence[0] if top.evidence else ""
        where = "" if top.kind is SuspectKind.MACHINE else f" on {', '.join(top.machines)}"
        name = gpu_words(top, scene.ranks_of, scene.gpu_of) or f"{suspect_label(top)}{where}"
        kind = f" ({c4_kind})" if c4_kind else ""
        if not confident:
            # below the bar it is a suspicion, worded as one: never a verdict line
            return (f"suspect, not a verdict: {name}{kind} — {lead}; confidence {conf:.2f} from "
                    f"{'+'.join(top.sources)}, below the {cfg.confident_at:.2f} bar")
        return (f"fail-slow: {name}{kind} — {lead}; "
                f"confidence {conf:.2f} from {'+'.join(top.sources)}")
    if flags:
        f = max(flags, key=lambda x: x.held / x.required if x.required else 0.0)
        unit = {"stacks": f" of {cfg.rounds_needed} rounds", "ccl": " calls",
                "samples": " confidence"}.get(f.detector, "s")
        return f"watching: {f.machine} [{f.detector}] {f.evidence} (alarms at {f.required:g}{unit})"
    n = scene.reachable
    if scene.snapshots == 0 or n == 0:
        return "no fail-slow verdict: no machine answered"
    if trend is not None and trend.ratio is not None and trend.ratio >= cfg.step_ratio:
        return f"job slower ({trend.evidence()}) but no machine stands out among {n}"
    if n == 1:
        return "no fail-slow: 1 machine answered, no peers to compare it with"
    return f"no fail-slow: {n} machines alike"
