"""What one Python stack frame says: a call that talks to other ranks, and what a sampled stack was doing.

The stack analyzers (rank states, origins, suspects) and the sampled-wait
detector read frames by these words, and the agent's sampler reads py-spy's
samples by them (``contract.collapsed``), so all of them call the same frame
the same thing. A frame is ``name (path/file.py[:line])``.

Pure and cheap: stdlib only.
"""

from __future__ import annotations

from collections.abc import Sequence

_P2P_WORDS = ("send", "recv", "_communicate")
_COLLECTIVE_WORDS = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "broadcast", "barrier",
                     "all_to_all", "alltoall", "gather", "scatter", "reduce_from", "reduce_to")
_COMM_FILES = ("distributed_c10d.py", "p2p_communication.py", "c10d_logger.py")


def communication_kind(frame_text_: str) -> str | None:
    """``"p2p"`` or ``"collective"`` for a frame that talks to other ranks, else None.

    Told from the function name (``irecv``, ``tp_all_reduce``, ``send_forward``)
    or from torch's communication modules; a ``wait`` counts only there, since
    queue and lock waits are local.
    """
    name, _, rest = frame_text_.partition(" (")
    short = name.lower().rsplit(".", 1)[-1]
    if any(w in short for w in _P2P_WORDS):
        return "p2p"
    if any(w in short for w in _COLLECTIVE_WORDS):
        return "collective"
    base = rest.rstrip(")").split(":", 1)[0]
    if base in _COMM_FILES:
        return "collective" if "wait" in short or base != "p2p_communication.py" else "p2p"
    return None


def is_communication(frame_text_: str) -> bool:
    """Whether a normalised frame is a collective or point-to-point call (a rank waiting for others)."""
    return communication_kind(frame_text_) is not None


CLASSES: tuple[str, ...] = ("collective", "p2p", "compute", "data", "other")

# A frame of the data pipeline (the main thread waiting for a batch).
_DATA_FILES = ("dataloader.py", "fetch.py", "worker.py", "queues.py")
_DATA_NAMES = ("_next_data", "_get_data", "_try_get_data", "__next__", "fetch")
# A frame of the model's own work: forward, backward, the optimizer.
_COMPUTE_NAMES = ("forward", "backward", "_call_impl", "_wrapped_call_impl", "step", "run_backward",
                  "_engine_run_backward", "matmul", "linear", "loss")
_COMPUTE_DIRS = ("torch/nn/", "torch/autograd/", "torch/optim/", "torch/_tensor.py", "torch/functional.py")


def _name_and_file(frame: str) -> tuple[str, str]:
    name, _, rest = frame.partition(" (")
    return name.rsplit(".", 1)[-1].lower(), rest.rstrip(")").split(":", 1)[0]


def classify(frames: Sequence[str]) -> str:
    """What one main-thread sample was doing; frames innermost first, as ``name (path/file.py[:line])``.

    The innermost frame that says something decides: a collective or p2p call
    (``communication_kind``: the rank waits for others), a data-loader
    frame ("data"), a model frame ("compute"); a stack with none of them is
    "other" (logging, checkpointing, the rank's own bookkeeping).
    """
    for frame in frames:
        kind = communication_kind(frame)
        if kind is not None:
            return kind
        name, path = _name_and_file(frame)
        base = path.rsplit("/", 1)[-1]
        if ("torch/utils/data" in path and base in _DATA_FILES) or (name in _DATA_NAMES and "data" in path):
            return "data"
        if name in _COMPUTE_NAMES or any(d in path for d in _COMPUTE_DIRS):
            return "compute"
    return "other"


__all__ = ["CLASSES", "classify", "communication_kind", "is_communication"]
