"""The drill on GPUs (``--backend nccl``): which GPU each rank takes and what NCCL must be told.

Ranks go round-robin over the machine's GPUs (``rank % gpus``). With fewer
GPUs than ranks, ranks share a GPU, and NCCL refuses two ranks of one
communicator on one device of one host ("Duplicate GPU") unless each rank
poses as its own host: every rank gets its own ``NCCL_HOSTID``, which also
sends NCCL over its network path, so sockets on loopback
(``NCCL_SOCKET_IFNAME=lo``, ``NCCL_IB_DISABLE=1``). Slow (milliseconds per
small collective) but real NCCL: a one-GPU machine runs a multi-rank drill
that way. Values the user already exported are kept.

Pure stdlib apart from :func:`check_cuda`, which imports torch, so the CLI
validates flags and the tests check the arithmetic without a GPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from rankscope.contract.errors import RankscopeError

BACKENDS = ("gloo", "nccl")
DEFAULT_BACKEND = "gloo"


def rank_device(rank: int, gpus: int) -> int:
    """The CUDA device index of global rank ``rank`` on a machine with ``gpus`` GPUs."""
    if gpus < 1:
        raise RankscopeError("--backend nccl needs a GPU: this machine shows none to torch",
                             "run on a machine with an NVIDIA GPU, or drop --backend nccl (gloo on CPU)")
    return rank % gpus


def shares_gpus(world: int, gpus: int) -> bool:
    return world > gpus


def nccl_rank_env(rank: int, world: int, gpus: int, run_id: str) -> dict[str, str]:
    """What NCCL needs in rank ``rank``'s environment before its communicators are made.

    Nothing when every rank has a GPU of its own; when ranks share, a host id
    of its own per rank and the socket transport on loopback.
    """
    if not shares_gpus(world, gpus):
        return {}
    return {"NCCL_HOSTID": f"{run_id}-rank{rank}", "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}


def not_set(env: Mapping[str, str], wanted: Mapping[str, str]) -> dict[str, str]:
    """The part of ``wanted`` that ``env`` does not set yet: the user's own exports win."""
    return {k: v for k, v in wanted.items() if k not in env}


@dataclass(frozen=True, slots=True)
class CudaInfo:
    gpus: int
    torch_version: str
    shared: bool  # fewer GPUs than ranks: ranks share them, each posing as its own host


def check_cuda(world: int) -> CudaInfo:
    """The GPUs torch sees, or a RankscopeError that says why ``--backend nccl`` cannot run here and the fix.

    Imports torch (a second or two); only the NCCL drill calls it. It does not
    create a CUDA context: ``device_count`` asks the driver (or NVML) only.
    """
    try:
        import torch
    except ImportError as exc:
        raise RankscopeError(f"--backend nccl needs torch with CUDA: torch does not import ({exc})",
                             "install a CUDA build of torch, e.g. pip install torch "
                             "--index-url https://download.pytorch.org/whl/cu128") from exc
    version = str(torch.__version__)
    if not torch.cuda.is_available():
        cuda_build = getattr(torch.version, "cuda", None)
        why = (f"this torch ({version}) is a CPU build" if not cuda_build
               else f"torch {version} (CUDA {cuda_build}) finds no usable GPU or driver")
        raise RankscopeError(
            f"--backend nccl needs CUDA: torch.cuda.is_available() is False; {why}",
            "run on a machine with an NVIDIA GPU and driver and a CUDA build of torch (pip install torch "
            "--index-url https://download.pytorch.org/whl/cu128), or drop --backend nccl to drill on gloo (CPU)")
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available():
        raise RankscopeError(f"--backend nccl: torch {version} was built without NCCL",
                             "install a CUDA build of torch that ships NCCL (the official wheels do)")
    gpus = int(torch.cuda.device_count())
    return CudaInfo(gpus=gpus, torch_version=version, shared=shares_gpus(world, gpus))
