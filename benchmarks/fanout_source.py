"""Synthetic ranks for bench_fanout.py: what the probes of one machine of a big Megatron-like job would read.

Lives with the benchmarks on purpose: the agent serves it through its ``source``
hook (``rankscope.wire.agent.start_agent(..., source=...)``), so the agent server,
the wire and the client are the real ones and only /proc and py-spy are not.

Each machine: ``ranks_per_machine`` ranks, each a main process with two
threads (~40-frame training stack, a pin-memory thread) and two
subprocesses (a dataloader worker, a checkpoint writer); ~6 communicators
per rank (world, tensor, pipeline, data, model-parallel, embedding) with
counters for the collectives on each. The ranks of one pipeline stage share
a stack; one rank is stuck in a different frame, the way a hang looks.
"""

from __future__ import annotations

from collections.abc import Callable

from rankscope.contract.snapshot import (
    Communicator,
    Frame,
    HostMetrics,
    Instant,
    MachineSnapshot,
    OpCounters,
    ProcessInfo,
    ProcessRole,
    ProcessStack,
    RankCounters,
    RankInfo,
    RankStacks,
    ThreadStack,
)

TP, PP = 8, 4
MEGATRON = "megatron/core/pipeline_parallel/schedules.py"
STUCK_RANK = 5


def _training_stack(stage: int, stuck: bool) -> tuple[Frame, ...]:
    outer = [("<module>", "pretrain_gpt.py", 310), ("pretrain", "megatron/training/training.py", 268),
             ("train", "megatron/training/training.py", 1120), ("train_step", "megatron/training/training.py", 640),
             ("forward_backward_pipelining_without_interleaving", MEGATRON, 1390)]
    middle = [(f"stage{stage}_{name}", f"megatron/core/models/gpt/layer{i % 7}.py", 100 + i)
              for i, name in enumerate(["forward_step", "backward_step", "model_forward", "transformer_block",
                                        "transformer_layer", "self_attention", "column_parallel_linear",
                                        "linear_with_grad_accumulation", "reduce_from_tp_region", "all_reduce",
                                        "wrapper", "c10d_call", "work_wait", "nccl_wait", "cuda_sync",
                                        "sync_impl", "launch", "apply", "forward", "hook", "call_impl",
                                        "wrapped_call_impl", "checkpointed", "recompute", "mlp", "gelu",
                                        "row_parallel_linear", "dropout", "layernorm", "residual", "bias_add",
                                        "rotary"])]
    inner = [("recv" if stuck else "all_reduce", "torch/distributed/distributed_c10d.py", 2501 if stuck else 2288),
             ("wait", "torch/distributed/distributed_c10d.py", 4001)]
    return tuple(Frame(n, f, line, None) for n, f, line in [*inner, *reversed(middle), *reversed(outer)])


_WORKER = tuple(Frame(f"worker_{i}", f"torch/utils/data/_utils/worker{i % 3}.py", 200 + i) for i in range(15))
_WRITER = tuple(Frame(f"save_{i}", f"torch/distributed/checkpoint/writer{i % 2}.py", 50 + i) for i in range(10))
_PIN = tuple(Frame(f"pin_{i}", "torch/utils/data/_utils/pin_memory.py", 30 + i) for i in range(8))
_STACKS: dict[tuple[int, bool], tuple[Frame, ...]] = {}


def training_stack(stage: int, stuck: bool) -> tuple[Frame, ...]:
    key = (stage, stuck)
    if key not in _STACKS:
        _STACKS[key] = _training_stack(stage, stuck)
    return _STACKS[key]


_GROUPS: dict[tuple[str, int, int], Communicator] = {}


def _group(comm_id: str, description: str, ranks: Callable[[], tuple[int, ...]], world: int) -> Communicator:
    """One object per group, as one process's reading shares them (the world group alone is 16k numbers)."""
    key = (comm_id, description, world)
    made = _GROUPS.get(key)
    if made is None:
        made = _GROUPS[key] = Communicator(comm_id, "nccl", description, ranks())
    return made


def communicators(rank: int, world: int) -> tuple[Communicator, ...]:
    dp = max(1, world // (TP * PP))
    tp_first = rank - rank % TP
    mp_first = rank - rank % (TP * PP)
    pp_group = tuple(range(rank % TP + mp_first, mp_first + TP * PP, TP))
    dp_group = tuple(range(rank % (TP * PP), world, TP * PP))[:dp]  # small: one per TP*PP ranks
    return (
        _group("world", "WORLD", lambda: tuple(range(world)), world),
        _group(f"tp{tp_first}", "TENSOR_MODEL_PARALLEL_GROUP", lambda: tuple(range(tp_first, tp_first + TP)), world),
        _group(f"pp{pp_group[0]}", "PIPELINE_MODEL_PARALLEL_GROUP", lambda: pp_group, world),
        _group(f"dp{dp_group[0]}", "DATA_PARALLEL_GROUP", lambda: dp_group, world),
        _group(f"mp{mp_first}", "MODEL_PARALLEL_GROUP", lambda: tuple(range(mp_first, mp_first + TP * PP)), world),
        _group(f"emb{pp_group[0]}", "EMBEDDING_GROUP", lambda: (pp_group[0], pp_group[-1]), world),
    )


def machine(index: int, ranks_per_machine: int, world: int, *, stacks: bool, now: float) -> MachineSnapshot:
    """Machine ``index`` of the job, as one reading of its probes."""
    ranks, all_stacks, counters = [], [], []
    for local in range(ranks_per_machine):
        rank = index * ranks_per_machine + local
        pid = 10_000 + rank
        stage = (rank // TP) % PP
        subs = (ProcessInfo(pid + 1, pid, ProcessRole.DATALOADER, "pt_data_worker"),
                ProcessInfo(pid + 2, pid, ProcessRole.CHECKPOINT, "ckpt_writer"))
        ranks.append(RankInfo(rank, local, world, pid, group_rank=index, local_world_size=ranks_per_machine,
                              run_id="bench-job", launcher_pid=9_999,
                              process=ProcessInfo(pid, 9_999, ProcessRole.MAIN, "python",
                                                  ("python", "pretrain_gpt.py", "--tp", str(TP), "--pp", str(PP)),
                                                  "S", 99.0, 40 << 30, 40),
                              subprocesses=subs, started_wall=now - 3600))
        if stacks:
            main = ProcessStack(pid, ProcessRole.MAIN, (
                ThreadStack(pid, training_stack(stage, rank == STUCK_RANK), "MainThread", pid, True, True),
                ThreadStack(pid + 100, _PIN, "pin_memory", pid + 100)), name="python", capture_seconds=0.05)
            all_stacks.append(RankStacks(rank, main, (
                ProcessStack(pid + 1, ProcessRole.DATALOADER, (ThreadStack(pid + 1, _WORKER),), name="pt_data_worker"),
                ProcessStack(pid + 2, ProcessRole.CHECKPOINT, (ThreadStack(pid + 2, _WRITER),), name="ckpt_writer"),
            )))
        comms = communicators(rank, world)
        ops = tuple(OpCounters(c.comm_id, op, 1000, 1000, 999 if rank == STUCK_RANK else 1000, 1000, 999,
                               1 << 30, 0.01, (1e9, 2e9), now - 1, now - 1)
                    for c in comms for op in (("all_reduce", "broadcast") if c.description != "WORLD" else ("barrier",)))
        counters.append(RankCounters(rank, pid, world, "bench-job", now, comms, ops, 1000, 1.5, now - 1.0))
    return MachineSnapshot(
        machine=f"node{index:05d}", address="", reachable=True, captured=Instant(now, now),
        hostname=f"node{index:05d}", ranks=tuple(ranks), stacks=tuple(all_stacks),
        host=HostMetrics(50.0, 128, 2 << 40, 1 << 40, 40.0), counters=tuple(counters),
    )
