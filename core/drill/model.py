"""The drill's model: tensor-parallel MLP blocks split into pipeline stages.

Small on purpose (hidden size 64): a step must stay well under 100 ms with
eight ranks on two CPU cores, yet every kind of traffic a real job has is
there, through real ``torch.distributed`` calls that py-spy sees:

- TP: a column-parallel linear (each rank holds a slice of the output
  features) followed by a row-parallel linear (a slice of the input features)
  whose partial outputs are summed with ``all_reduce``; in backward the input
  gradient of the column-parallel layer is summed the same way. Both are
  autograd Functions, as in Megatron's ``copy_to`` / ``reduce_from`` regions.
- PP: stages send activations forward and gradients backward with
  ``send``/``recv`` on the pipeline group, micro-batch by micro-batch (GPipe).
- DP: gradients are averaged with ``all_reduce`` over the data-parallel group.

Weights are drawn whole from a generator seeded per layer and then sliced,
so every TP size starts from the same full model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from rankscope.drill.faults import DrillLayout
from torch import nn


@dataclass(frozen=True)
class Groups:
    """This rank's process groups and coordinates."""

    layout: DrillLayout
    rank: int
    tp_group: Any
    pp_group: Any
    dp_group: Any

    @property
    def tp_rank(self) -> int:
        return self.layout.coords(self.rank)[0]

    @property
    def dp_rank(self) -> int:
        return self.layout.coords(self.rank)[1]

    @property
    def pp_rank(self) -> int:
        return self.layout.coords(self.rank)[2]

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    def pp_peer(self, offset: int) -> int:
        tp, dp, pp = self.layout.coords(self.rank)
        return self.layout.rank_of(tp, dp, pp + offset)


def make_groups(layout: DrillLayout, rank: int) -> Groups:
    """Create every TP, PP and DP group, on every rank, in the same order.

    ``new_group`` is collective over the whole world, so all ranks must call
    it for all groups, even those they are not in. The descriptions are the
    names Megatron uses, so the CCL plugin can record which group is which.
    """
    mine: dict[str, Any] = {}
    for kind, desc in (("tp", "TENSOR_MODEL_PARALLEL_GROUP"), ("pp", "PIPELINE_MODEL_PARALLEL_GROUP"),
                       ("dp", "DATA_PARALLEL_GROUP")):
        for members in layout.groups(kind):
            group = dist.new_group(ranks=list(members), group_desc=desc)
            if rank in members:
                mine[kind] = group
    return Groups(layout=layout, rank=rank, tp_group=mine["tp"], pp_group=mine["pp"], dp_group=mine["dp"])


# Called right before a collective or a send, so a fault can stop or delay the
# rank exactly there. Arguments: the group kind ("tp", "pp", "dp") and the op.
CommHook = Callable[[str, str], None]


def _no_hook(kind: str, op: str) -> None:
    return None


class _Comm:
    """The hook the worker installs; module level so autograd Functions reach it."""

    hook: CommHook = _no_hook
    device: torch.device | None = None  # where receive buffers go (None: the CPU); a GPU with NCCL


def set_comm_hook(hook: CommHook) -> None:
    _Comm.hook = hook


def set_comm_device(device: torch.device) -> None:
    _Comm.device = device


def tp_all_reduce(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    _Comm.hook("tp", "all_reduce")
    dist.all_reduce(tensor, group=group)
    return tensor


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; all-reduce of the input gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None]:
        return tp_all_reduce(grads[0].contiguous(), ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """All-reduce of the partial outputs forward; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return tp_all_reduce(x.contiguous(), group)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grads[0], None


def _full_weight(seed: int, out_features: int, in_features: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scale = float(in_features) ** -0.5
    weight: torch.Tensor = torch.randn(out_features, in_features, generator=gen) * scale
    return weight


class ColumnParallelLinear(nn.Module):
    """y_i = x W_i^T: this rank's slice of the output features."""

    def __init__(self, seed: int, in_features: int, out_features: int, groups: Groups) -> None:
        super().__init__()
        tp = groups.layout.tp
        if out_features % tp:
            raise ValueError(f"{out_features} output features do not split over tp={tp}")
        part = out_features // tp
        full = _full_weight(seed, out_features, in_features)
        self.weight = nn.Parameter(full[groups.tp_rank * part:(groups.tp_rank + 1) * part].clone())
        self.bias = nn.Parameter(torch.zeros(part))
        self.group = groups.tp_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _CopyToTensorParallel.apply(x, self.group)  # type: ignore[no-untyped-call]
        out: torch.Tensor = nn.functional.linear(x, self.weight, self.bias)
        return out


class RowParallelLinear(nn.Module):
    """y = sum_i x_i W_i^T: partial products summed over the TP group."""

    def __init__(self, seed: int, in_features: int, out_features: int, groups: Groups) -> None:
        super().__init__()
        tp = groups.layout.tp
        if in_features % tp:
            raise ValueError(f"{in_features} input features do not split over tp={tp}")
        part = in_features // tp
        full = _full_weight(seed, out_features, in_features)
        self.weight = nn.Parameter(full[:, groups.tp_rank * part:(groups.tp_rank + 1) * part].clone())
        self.bias = nn.Parameter(torch.zeros(out_features))
        self.group = groups.tp_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = nn.functional.linear(x, self.weight)
        out: torch.Tensor = _ReduceFromTensorParallel.apply(partial, self.group)  # type: ignore[no-untyped-call]
        return out + self.bias


class ParallelMLP(nn.Module):
    """A residual MLP block: column-parallel up, GELU, row-parallel down."""

    def __init__(self, seed: int, hidden: int, groups: Groups) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = ColumnParallelLinear(seed * 2, hidden, 4 * hidden, groups)
        self.down = RowParallelLinear(seed * 2 + 1, 4 * hidden, hidden, groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = self.up(self.norm(x))
        out: torch.Tensor = x + self.down(nn.functional.gelu(h))
        return out


class Stage(nn.Module):
    """One pipeline stage: ``layers_per_stage`` blocks; the first embeds, the last predicts."""

    def __init__(self, groups: Groups, *, hidden: int, features: int, layers_per_stage: int, seed: int) -> None:
        super().__init__()
        self.groups = groups
        base = seed * 1000 + groups.pp_rank * layers_per_stage
        self.embed: nn.Module | None = None
        self.head: nn.Module | None = None
        if groups.first_stage:
            self.embed = nn.Linear(features, hidden)
            with torch.no_grad():
                self.embed.weight.copy_(_full_weight(seed * 1000 + 997, hidden, features))
                self.embed.bias.zero_()
        self.blocks = nn.ModuleList(ParallelMLP(base + i, hidden, groups) for i in range(layers_per_stage))
        if groups.last_stage:
            self.head = nn.Linear(hidden, 1)
            with torch.no_grad():
                self.head.weight.copy_(_full_weight(seed * 1000 + 998, 1, hidden))
                self.head.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x = self.head(x)
        return x


def send_forward(t: torch.Tensor, groups: Groups) -> None:
    _Comm.hook("pp", "send")
    dist.send(t.contiguous(), dst=groups.pp_peer(+1), group=groups.pp_group)


def recv_forward(shape: tuple[int, ...], groups: Groups) -> torch.Tensor:
    buf = torch.empty(shape, device=_Comm.device)
    dist.recv(buf, src=groups.pp_peer(-1), group=groups.pp_group)
    return buf


def send_backward(t: torch.Tensor, groups: Groups) -> None:
    _Comm.hook("pp", "send")
    dist.send(t.contiguous(), dst=groups.pp_peer(-1), group=groups.pp_group)


def recv_backward(shape: tuple[int, ...], groups: Groups) -> torch.Tensor:
    buf = torch.empty(shape, device=_Comm.device)
    dist.recv(buf, src=groups.pp_peer(+1), group=groups.pp_group)
    return buf


def all_reduce_gradients(model: nn.Module, groups: Groups) -> None:
    """Average gradients over the data-parallel group, as one flat buffer."""
    params = [p for p in model.parameters() if p.grad is not None]
    if groups.layout.dp == 1 or not params:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
    _Comm.hook("dp", "all_reduce")
    dist.all_reduce(flat, group=groups.dp_group)
    flat /= groups.layout.dp
    offset = 0
    for p in params:
        assert p.grad is not None
        n = p.grad.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
        offset += n


ComputeHook = Callable[[], None]


def train_step(
    model: Stage,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    micro_batches: int,
    hidden: int,
    compute_hook: ComputeHook | None = None,
    before_compute: ComputeHook | None = None,
) -> float | None:
    """One GPipe step: all forwards, then all backwards, then DP and the update.

    Returns the mean loss on the last stage (None elsewhere).
    ``before_compute`` and ``compute_hook`` run around each micro-batch's
    forward compute, inside the step, so a compute fault sits where a slow
    kernel would and can scale with the time the compute really took.
    """
    groups = model.groups
    optimizer.zero_grad(set_to_none=True)
    xs = x.chunk(micro_batches)
    ys = y.chunk(micro_batches)
    inputs: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    for i in range(micro_batches):
        inp = xs[i] if groups.first_stage else recv_forward((xs[i].shape[0], hidden), groups).requires_grad_(True)
        if before_compute is not None:
            before_compute()
        out = model(inp)
        if compute_hook is not None:
            compute_hook()
        if not groups.last_stage:
            send_forward(out.detach(), groups)
        inputs.append(inp)
        outputs.append(out)
    losses: list[float] = []
    for i in reversed(range(micro_batches)):
        out = outputs[i]
        if groups.last_stage:
            loss = nn.functional.mse_loss(out, ys[i]) / micro_batches
            loss.backward()  # type: ignore[no-untyped-call]
            losses.append(float(loss.detach()) * micro_batches)
        else:
            grad = recv_backward(tuple(out.shape), groups)
            out.backward(grad)  # type: ignore[no-untyped-call]
        if not groups.first_stage:
            grad_in = inputs[i].grad
            assert grad_in is not None
            send_backward(grad_in, groups)
    all_reduce_gradients(model, groups)
    optimizer.step()
    if groups.last_stage:
        return sum(losses) / len(losses)
    return None
