"""The drill's fault registry, its parallel layout and the ground truth of a run.

Pure Python (no torch, no processes), so the CLI can validate flags and the
tests can check the layout math and the expected suspects cheaply.

A fault is chosen by name, rank (or machine) and step. The plan travels to
every rank in one environment variable (``RANKSCOPE_DRILL_FAULT``), so the
injection is fixed at launch and the ranks need no side channel. Faults that
act from outside the ranks (a noisy neighbour, a throttled process) are
carried out by the orchestrator (``rankscope.drill.session``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from rankscope.contract.errors import RankscopeError
from rankscope.contract.snapshot import Layout

FAULT_ENV = "RANKSCOPE_DRILL_FAULT"
GROUPS = ("tp", "pp", "dp")


# --------------------------------------------------------------------------
# Layout: Megatron's default order tp-cp-ep-dp-pp (cp = ep = 1 here)
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DrillLayout:
    """TP x PP x DP ranks spread over ``machines`` nodes of consecutive ranks.

    ``rank = tp + TP * (dp + DP * pp)``: tp varies fastest, then dp, then pp,
    as in Megatron's default order string with cp = ep = 1.
    """

    tp: int = 2
    pp: int = 2
    dp: int = 2
    machines: int = 4

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "machines"):
            if getattr(self, name) < 1:
                raise RankscopeError(f"--{name} must be at least 1, got {getattr(self, name)}", f"pass --{name} 1 or more")
        if self.world % self.machines:
            raise RankscopeError(
                f"{self.world} ranks (tp {self.tp} x pp {self.pp} x dp {self.dp}) do not split evenly over {self.machines} machines",
                f"choose --machines among the divisors of {self.world}: {', '.join(str(d) for d in _divisors(self.world))}",
            )

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def ranks_per_machine(self) -> int:
        return self.world // self.machines

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp, dp, pp) coordinates of a global rank."""
        self._check_rank(rank)
        return rank % self.tp, (rank // self.tp) % self.dp, rank // (self.tp * self.dp)

    def rank_of(self, tp: int, dp: int, pp: int) -> int:
        return tp + self.tp * (dp + self.dp * pp)

    def machine_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.ranks_per_machine

    def ranks_on(self, machine: int) -> tuple[int, ...]:
        if not 0 <= machine < self.machines:
            raise RankscopeError(f"machine {machine} does not exist", f"choose a machine from 0 to {self.machines - 1}")
        start = machine * self.ranks_per_machine
        return tuple(range(start, start + self.ranks_per_machine))

    def group_of(self, kind: str, rank: int) -> tuple[int, ...]:
        """The member ranks of the ``kind`` group (tp, pp or dp) that holds ``rank``."""
        tp, dp, pp = self.coords(rank)
        if kind == "tp":
            return tuple(self.rank_of(t, dp, pp) for t in range(self.tp))
        if kind == "dp":
            return tuple(self.rank_of(tp, d, pp) for d in range(self.dp))
        if kind == "pp":
            return tuple(self.rank_of(tp, dp, p) for p in range(self.pp))
        raise RankscopeError(f"unknown parallel group {kind!r}", f"use one of {', '.join(GROUPS)}")

    def groups(self, kind: str) -> tuple[tuple[int, ...], ...]:
        """All groups of a kind, in the order every rank creates them."""
        seen: dict[tuple[int, ...], None] = {}
        for r in range(self.world):
            seen.setdefault(self.group_of(kind, r), None)
        return tuple(seen)

    def machines_of(self, ranks: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(sorted({self.machine_of(r) for r in ranks}))

    def to_snapshot_layout(self) -> Layout:
        return Layout(tp=self.tp, pp=self.pp, dp=self.dp, ranks_per_machine=self.ranks_per_machine)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world:
            raise RankscopeError(f"rank {rank} does not exist in a job of {self.world} ranks", f"choose a rank from 0 to {self.world - 1}")


def machine_name(index: int) -> str:
    """The name a drill machine's agent reports (``--machine-name``)."""
    return f"machine-{index}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# --------------------------------------------------------------------------
# The registry
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FaultSpec:
    """What a fault does, where it shows and what a correct verdict names.

    ``suspect``: the kind of suspect a correct verdict names first ("rank",
    "machine", or a parallel group "tp"/"pp"/"dp"; "group" means the group the
    plan names; "desync" means the ranks of the group the plan names, which run
    a different program from their peers). ``role``: the process the injected frame is in. ``by``:
    "rank" when the training processes inject it themselves, "orchestrator"
    when the drill acts from outside.
    """

    name: str
    category: str  # "hang", "slow" or "none"
    description: str
    suspect: str
    role: str = "main"
    frame: str | None = None
    by: str = "rank"
    default_group: str | None = None  # for faults aimed at a parallel group
    state: str | None = None  # the /proc state the faulty rank's main process is left in (sigstop: "T")
    needs_cuda: bool = False  # acts on the rank's GPU: only a --backend nccl drill can carry it out


FAULTS: dict[str, FaultSpec] = {
    f.name: f
    for f in (
        FaultSpec("none", "none", "healthy baseline: no fault, same length", "none", frame=None),
        FaultSpec("hang-compute", "hang", "the rank never leaves its forward compute", "rank",
                  frame="drill_injected_hang_compute"),
        FaultSpec("hang-p2p", "hang", "a pipeline stage stops sending (activations forward, gradients backward)", "pp",
                  frame="drill_injected_hang_p2p"),
        FaultSpec("skip-send", "hang", "a pipeline stage skips one send (a rank-dependent branch) and goes on to its "
                  "next receive: it and its peer wait on each other", "desync",
                  frame="drill_injected_skip_send", default_group="pp"),
        FaultSpec("hang-collective", "hang", "the rank stalls before a collective of its group", "group",
                  frame="drill_injected_hang_collective", default_group="tp"),
        FaultSpec("dataloader-stall", "hang", "the rank's dataloader worker blocks; the rank waits for data", "rank",
                  role="dataloader", frame="drill_injected_dataloader_stall"),
        FaultSpec("checkpoint-stall", "hang", "the rank's checkpoint writer blocks; the rank waits for it", "rank",
                  role="checkpoint", frame="drill_injected_checkpoint_stall"),
        FaultSpec("crash", "hang", "the rank exits with an error; torchrun tears its node down", "rank",
                  frame="drill_injected_crash"),
        FaultSpec("desync", "hang", "the rank's group (--fault-group, default tp) runs one step more than the rest "
                  "of the job, which has left the training loop for its closing barrier: a program mismatch that "
                  "eviction does not cure", "desync", frame="drill_injected_desync", default_group="tp"),
        FaultSpec("dataloader-deadlock", "hang", "two threads of the rank's dataloader worker take two locks in "
                  "opposite order and deadlock; the rank waits for data", "rank",
                  role="dataloader", frame="drill_injected_dataloader_deadlock"),
        FaultSpec("sigstop", "hang", "the rank's process is stopped with SIGSTOP (state T): py-spy cannot read it "
                  "and its peers wait for it", "rank", frame=None, by="orchestrator", state="T"),
        FaultSpec("slow-compute", "slow", "the rank burns CPU in its compute until its steps take --fault-factor "
                  "times its healthy step", "rank",
                  frame="drill_injected_slow_compute"),
        FaultSpec("slow-gpu", "slow", "the rank queues extra matrix multiplications on its own GPU before its "
                  "collectives until its steps take --fault-factor times its healthy step: its host does not wait "
                  "for them, its collectives start late on the device and its peers' device time shows it",
                  "rank", frame="drill_injected_slow_gpu", needs_cuda=True),
        FaultSpec("slow-comm", "slow", "the rank's sends on one group are delayed by --fault-delay-ms", "group",
                  frame="drill_injected_slow_comm", default_group="pp"),
        FaultSpec("slow-dataloader", "slow", "the rank's dataloader worker takes --fault-delay-ms longer per batch", "rank",
                  role="dataloader", frame="drill_injected_slow_dataloader"),
        FaultSpec("cpu-contention", "slow", "noisy processes (nice -5) spin on one core, where the machine's "
                  "ranks are confined", "machine",
                  role="other", frame="drill_injected_cpu_noise", by="orchestrator"),
        FaultSpec("thermal", "slow", "the rank's device is throttled (GPU: locked lower clock; CPU: the process is "
                  "stopped each step until its steps take --fault-factor times its healthy step)", "rank", frame=None,
                  by="orchestrator"),
    )
}

HANG_FAULTS = tuple(n for n, f in FAULTS.items() if f.category == "hang")
SLOW_FAULTS = tuple(n for n, f in FAULTS.items() if f.category == "slow")


def fault_spec(name: str) -> FaultSpec:
    spec = FAULTS.get(name)
    if spec is None:
        raise RankscopeError(f"unknown fault {name!r}", f"choose one of: {', '.join(FAULTS)}")
    return spec


def refuse_off_gpu(name: str, backend: str) -> None:
    """A RankscopeError naming the fix when fault ``name`` needs the rank's GPU and ``backend`` gives it none."""
    if fault_spec(name).needs_cuda and backend != "nccl":
        raise RankscopeError(f"{name} acts on the rank's GPU, and a --backend {backend} drill runs on CPU",
                             "pass --backend nccl on a machine with an NVIDIA GPU, or drill a rank slow on its "
                             "host with --fault slow-compute")


# --------------------------------------------------------------------------
# The plan: what, where, when
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """One injected fault; ``rank`` is -1 for the healthy baseline.

    Slow faults may be intermittent: on for ``on_steps``, off for
    ``off_steps``, repeating from ``step`` (0 means always on).
    """

    name: str
    rank: int
    step: int
    group: str | None = None
    factor: float = 2.0  # slow-compute, thermal: how many times longer
    delay_ms: float = 50.0  # slow-comm, slow-dataloader
    on_steps: int = 0
    off_steps: int = 0
    machine: int | None = None  # cpu-contention: the machine the noise is pinned to

    @property
    def spec(self) -> FaultSpec:
        return fault_spec(self.name)

    def active(self, step: int) -> bool:
        """Whether the fault acts at ``step`` (for slow faults: at every active step)."""
        if self.name == "none" or step < self.step:
            return False
        if self.on_steps <= 0 or self.off_steps <= 0:
            return True
        return (step - self.step) % (self.on_steps + self.off_steps) < self.on_steps

    def hits(self, rank: int, step: int) -> bool:
        return rank == self.rank and self.active(step)

    def to_env(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_env(cls, text: str | None) -> FaultPlan:
        """The plan a rank was launched with; no variable means the healthy baseline."""
        if not text:
            return cls(name="none", rank=-1, step=0)
        data = json.loads(text)
        return cls(**data)


def make_plan(
    name: str,
    layout: DrillLayout,
    *,
    rank: int | None = None,
    machine: int | None = None,
    step: int = 10,
    group: str | None = None,
    factor: float = 2.0,
    delay_ms: float = 50.0,
    on_steps: int = 0,
    off_steps: int = 0,
    seed: int = 0,
    backend: str | None = None,
) -> FaultPlan:
    """Check the flags against the layout and pick a rank where none was given.

    A rank not given is drawn from ``seed`` (on ``machine`` if given), so the
    same flags always give the same drill; the report says which rank it was.
    ``backend``, when given, is checked too: a GPU fault on a CPU drill is refused.
    """
    spec = fault_spec(name)
    if backend is not None:
        refuse_off_gpu(name, backend)
    if name == "none":
        return FaultPlan(name="none", rank=-1, step=step)
    if step < 1:
        raise RankscopeError(f"--fault-step must be 1 or more, got {step}", "the first steps warm the job up; pass --fault-step 5 or more")
    if factor < 1.0:
        raise RankscopeError(f"--fault-factor must be at least 1.0, got {factor}", "pass e.g. --fault-factor 1.5 (50% slower)")
    rng = random.Random(seed)
    if rank is None:
        pool = layout.ranks_on(machine) if machine is not None else tuple(range(layout.world))
        rank = rng.choice(pool)
    else:
        layout.coords(rank)  # raises for a rank that does not exist
        if machine is not None and layout.machine_of(rank) != machine:
            raise RankscopeError(f"rank {rank} is on machine {layout.machine_of(rank)}, not machine {machine}",
                                 "pass only one of --fault-rank and --fault-machine")
    if spec.default_group is not None:
        group = group or _default_group(spec.default_group, layout)
        if group not in GROUPS:
            raise RankscopeError(f"unknown group {group!r} for {name}", f"pass --fault-group with one of {', '.join(GROUPS)}")
        if getattr(layout, group) < 1 or len(layout.group_of(group, rank)) < 2:
            raise RankscopeError(f"{name} on the {group} group needs a {group} size of 2 or more",
                                 f"raise --{group} or pass another --fault-group")
    elif group is not None:
        raise RankscopeError(f"{name} takes no --fault-group", "drop --fault-group")
    if name == "desync" and group is not None and len(layout.group_of(group, rank)) == layout.world:
        raise RankscopeError(f"desync on the {group} group would put every rank one step ahead, so nothing differs",
                             "pass a --fault-group smaller than the whole job, or raise another parallel size")
    if name == "skip-send" and group != "pp":
        raise RankscopeError("skip-send skips a pipeline send", "pass --fault-group pp (the default) and --pp 2 or more")
    if name == "hang-p2p" and layout.pp < 2:
        raise RankscopeError("hang-p2p needs pipeline stages to send between", "pass --pp 2 or more")
    return FaultPlan(
        name=name, rank=rank, step=step, group=group, factor=factor, delay_ms=delay_ms,
        on_steps=on_steps, off_steps=off_steps, machine=layout.machine_of(rank),
    )


def _default_group(preferred: str, layout: DrillLayout) -> str:
    order = (preferred, *[g for g in ("tp", "dp", "pp") if g != preferred])
    for g in order:
        if getattr(layout, g) > 1:
            return g
    raise RankscopeError("this fault needs a parallel group of 2 or more ranks", "raise --tp, --pp or --dp")


# --------------------------------------------------------------------------
# Ground truth
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GroundTruth:
    """What the drill did, and what a correct verdict names.

    ``suspect_ranks``/``suspect_machines``: the ranks and machines of the
    expected suspect (the whole group for a group fault, the rank's machine
    for a rank fault, all ranks of the machine for a machine fault).
    """

    fault: str
    category: str
    description: str
    rank: int | None
    machine: str | None
    step: int | None
    suspect_kind: str
    suspect_ranks: tuple[int, ...]
    suspect_machines: tuple[str, ...]
    frame: str | None
    role: str
    group: str | None = None
    coords: Mapping[str, int] = field(default_factory=dict)
    factor: float | None = None
    delay_ms: float | None = None
    intermittent: tuple[int, int] | None = None
    injected_by: str = "rank"
    process_state: str | None = None  # the faulty rank's /proc state the fault leaves (sigstop: "T")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["coords"] = dict(self.coords)
        return out


def ground_truth(plan: FaultPlan, layout: DrillLayout, *, checkpoint_every: int = 0) -> GroundTruth:
    spec = plan.spec
    if plan.name == "none":
        return GroundTruth(fault="none", category="none", description=spec.description, rank=None, machine=None,
                           step=None, suspect_kind="none", suspect_ranks=(), suspect_machines=(), frame=None,
                           role="main", injected_by="none")
    tp, dp, pp = layout.coords(plan.rank)
    step = plan.step
    if plan.name == "checkpoint-stall" and checkpoint_every > 0:
        # The writer stalls on the first checkpoint written at or after the fault step.
        step = -(-plan.step // checkpoint_every) * checkpoint_every
    kind = spec.suspect
    if kind == "group":
        assert plan.group is not None
        kind = plan.group
    if kind == "desync":
        assert plan.group is not None
        ranks = layout.group_of(plan.group, plan.rank)  # the ranks one step ahead of everyone else
    elif kind in GROUPS:
        ranks = layout.group_of(kind, plan.rank)
    elif kind == "machine":
        ranks = layout.ranks_on(layout.machine_of(plan.rank))
    else:
        ranks = (plan.rank,)
    intermittent = (plan.on_steps, plan.off_steps) if plan.on_steps > 0 and plan.off_steps > 0 else None
    return GroundTruth(
        fault=plan.name,
        category=spec.category,
        description=spec.description,
        rank=plan.rank,
        machine=machine_name(layout.machine_of(plan.rank)),
        step=step,
        suspect_kind=kind,
        suspect_ranks=ranks,
        suspect_machines=tuple(machine_name(m) for m in layout.machines_of(ranks)),
        frame=spec.frame,
        role=spec.role,
        group=plan.group,
        coords={"tp": tp, "dp": dp, "pp": pp},
        factor=plan.factor if plan.name in ("slow-compute", "slow-gpu", "thermal") else None,
        delay_ms=plan.delay_ms if plan.name in ("slow-comm", "slow-dataloader") else None,
        intermittent=intermittent if spec.category == "slow" else None,
        injected_by=spec.by,
        process_state=spec.state,
    )
