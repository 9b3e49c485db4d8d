"""Writes the hand-made py-spy dumps of ByteRobust's Fig. 7 (run once; the JSON is committed).

TP=2, PP=4, DP=4 on 16 machines of two ranks, order ``tp-pp-dp``
(rank = tp + 2*(pp + 4*dp)), so machine m hosts ranks 2m and 2m+1 and the
last pipeline (dp=3) lives on machines 12-15:

- machines 0-11 (ranks 0-23): finished backward, in the optimizer's gradient all-reduce;
- machines 12-13 (ranks 24-27): waiting in ``irecv`` for activation gradients;
- machine 14 (ranks 28-29): waiting in ``isend``;
- machine 15 (ranks 30-31): the last stage, stalled in ``all_gather_into_tensor`` in backward.

Each file is what ``py-spy dump --pid P --json`` prints: a list of threads,
innermost frame first. Healthy ranks differ in line numbers and carry torch
wrapper frames and an idle pin-memory thread, so the test also checks that
signatures ignore those.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
SITE = "/opt/venv/lib/python3.11/site-packages"
MEG = "/workspace/Megatron-LM/megatron"


def f(name: str, filename: str, line: int, shim: bool = False) -> dict[str, object]:
    return {"name": name, "filename": filename, "module": None, "short_filename": filename.rsplit("/", 1)[-1],
            "line": line, "locals": None, "is_entry": shim, "is_shim_entry": shim}


COMMON = [  # outermost first here; reversed when written
    f("<module>", "/workspace/pretrain_gpt.py", 240, shim=True),
    f("pretrain", f"{MEG}/training/training.py", 345),
    f("train", f"{MEG}/training/training.py", 1180),
    f("train_step", f"{MEG}/training/training.py", 702),
]

OPTIMIZER = [
    f("MixedPrecisionOptimizer.step", f"{MEG}/core/optimizer/optimizer.py", 470),
    f("DistributedDataParallel.finish_grad_sync", f"{MEG}/core/distributed/distributed_data_parallel.py", 300),
    f("_ParamAndGradBucketGroup.start_grad_sync", f"{MEG}/core/distributed/param_and_grad_buffer.py", 210),
    f("wrapper", f"{SITE}/torch/distributed/c10d_logger.py", 81),
    f("all_reduce", f"{SITE}/torch/distributed/distributed_c10d.py", 2806),
]

SCHEDULE = f("forward_backward_pipelining_without_interleaving", f"{MEG}/core/pipeline_parallel/schedules.py", 1780)


def p2p(outer: str, op: str) -> list[dict[str, object]]:
    return [
        SCHEDULE,
        f(outer, f"{MEG}/core/pipeline_parallel/schedules.py", 1400),
        f(outer, f"{MEG}/core/pipeline_parallel/p2p_communication.py", 470),
        f("_communicate", f"{MEG}/core/pipeline_parallel/p2p_communication.py", 390),
        f("_p2p_ops", f"{MEG}/core/pipeline_parallel/p2p_communication.py", 220),
        f("wrapper", f"{SITE}/torch/distributed/c10d_logger.py", 81),
        f(op, f"{SITE}/torch/distributed/distributed_c10d.py", 2090),
    ]


LAST_STAGE = [
    SCHEDULE,
    f("backward_step", f"{MEG}/core/pipeline_parallel/schedules.py", 390),
    f("backward", f"{SITE}/torch/autograd/__init__.py", 353),
    f("_engine_run_backward", f"{SITE}/torch/autograd/graph.py", 824),
    f("BackwardCFunction.apply", f"{SITE}/torch/autograd/function.py", 307),
    f("_ReduceScatterToSequenceParallelRegion.backward", f"{MEG}/core/tensor_parallel/mappings.py", 330),
    f("_gather_along_first_dim", f"{MEG}/core/tensor_parallel/mappings.py", 120),
    f("wrapper", f"{SITE}/torch/distributed/c10d_logger.py", 81),
    f("all_gather_into_tensor", f"{SITE}/torch/distributed/distributed_c10d.py", 3710),
]

PIN_MEMORY = [
    f("Thread._bootstrap", "/usr/lib/python3.11/threading.py", 1002, shim=True),
    f("Thread._bootstrap_inner", "/usr/lib/python3.11/threading.py", 1045),
    f("Thread.run", "/usr/lib/python3.11/threading.py", 982),
    f("_pin_memory_loop", f"{SITE}/torch/utils/data/_utils/pin_memory.py", 59),
    f("do_one_step", f"{SITE}/torch/utils/data/_utils/pin_memory.py", 35),
    f("Queue.get", "/usr/lib/python3.11/multiprocessing/queues.py", 113),
    f("Connection.poll", "/usr/lib/python3.11/multiprocessing/connection.py", 257),
    f("wait", "/usr/lib/python3.11/multiprocessing/connection.py", 948),
    f("selectors.select", "/usr/lib/python3.11/selectors.py", 415),
]


def main_frames(rank: int) -> list[dict[str, object]]:
    machine = rank // 2
    if machine <= 11:
        tail = OPTIMIZER
    elif machine <= 13:
        tail = p2p("recv_backward", "irecv")
    elif machine == 14:
        tail = p2p("send_backward", "isend")
    else:
        tail = LAST_STAGE
    frames = [dict(x) for x in COMMON + tail]
    frames[2]["line"] = 1180 + rank % 3  # healthy ranks sit on different lines of the training loop
    return frames


def dump(rank: int) -> list[dict[str, object]]:
    pid = 4000 + rank
    return [
        {"pid": pid, "thread_id": 139900000000000 + rank, "thread_name": f"Thread-{2 + rank % 2} (_pin_memory_loop)",
         "os_thread_id": pid + 7, "active": False, "owns_gil": False,
         "frames": list(reversed(PIN_MEMORY)), "process_info": None},
        {"pid": pid, "thread_id": 139800000000000 + rank, "thread_name": "MainThread", "os_thread_id": pid,
         "active": True, "owns_gil": False, "frames": list(reversed(main_frames(rank))), "process_info": None},
    ]


if __name__ == "__main__":
    for rank in range(32):
        (HERE / f"rank{rank}.json").write_text(json.dumps(dump(rank), indent=1) + "\n")
