"""The one vocabulary of communication operations, whoever wrote the name.

Three writers name the same operation three ways: torch's API and the shim
(``all_reduce``, ``isend``, ``batch_isend_irecv``), NCCL and its profiler
plugin (``AllReduce``, ``Send``, ``Recv``), and the flight recorder
(``nccl:all_reduce``, ``nccl:send 0->1``). Every reader asks here what an
operation is, so a point-to-point op is never read as a collective because of
its spelling (a ``Recv`` compared by launch count across a communicator of
ranks that only send and ranks that only receive names the wrong rank).

An operation has a kind (collective, point-to-point, or unknown) and a
canonical name (torch's public spelling, so the shim's ``all_reduce`` and the
plugin's ``AllReduce`` are one operation). A name no table here knows is
``UNKNOWN`` and keeps its spelling: it is shown as written, never guessed.
Point-to-point ops are matched per peer pair (a send with the peer's recv),
never by launch count across a communicator.

Pure and cheap: stdlib only, imported by the plugin's writer as well as the analyzers.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from enum import StrEnum


class OpKind(StrEnum):
    COLLECTIVE = "collective"
    P2P = "point-to-point"
    UNKNOWN = "unknown"


SEND = "send"
RECV = "recv"
BARRIER = "barrier"

# Backends whose collectives run on an accelerator: the host only enqueues them, so a rank's host stack says
# little about how fast its device work goes (every host waits at the same synchronisation call).
DEVICE_BACKENDS = frozenset({"nccl", "xccl", "hccl"})


def on_device(backend: str) -> bool:
    """Whether a communicator of ``backend`` runs its collectives on an accelerator (NCCL, XCCL, HCCL)."""
    return backend.lower() in DEVICE_BACKENDS


# canonical name -> kind
_CANONICAL: dict[str, OpKind] = {
    "all_reduce": OpKind.COLLECTIVE,
    "broadcast": OpKind.COLLECTIVE,
    "reduce": OpKind.COLLECTIVE,
    "all_gather": OpKind.COLLECTIVE,
    "all_gather_into_tensor": OpKind.COLLECTIVE,
    "reduce_scatter": OpKind.COLLECTIVE,
    "reduce_scatter_tensor": OpKind.COLLECTIVE,
    "all_to_all": OpKind.COLLECTIVE,
    "all_to_all_single": OpKind.COLLECTIVE,
    "gather": OpKind.COLLECTIVE,
    "scatter": OpKind.COLLECTIVE,
    BARRIER: OpKind.COLLECTIVE,
    SEND: OpKind.P2P,
    RECV: OpKind.P2P,
    "send_recv": OpKind.P2P,  # NCCL's fused SendRecv (one P2P event carrying both directions)
}

# Every other spelling -> its canonical name. Keys are folded (lower case, no "_"), so NCCL's
# CamelCase and torch's snake_case of one name need one entry.
_ALIASES: dict[str, str] = {
    # torch's private, coalesced, object and non-blocking variants
    "allreducecoalesced": "all_reduce",
    "allgatherbase": "all_gather_into_tensor",
    "allgathersingle": "all_gather_into_tensor",
    "allgatherintotensorcoalesced": "all_gather_into_tensor",
    "allgathercoalesced": "all_gather",
    "allgatherobject": "all_gather",
    "reducescatterbase": "reduce_scatter_tensor",
    "reducescattersingle": "reduce_scatter_tensor",
    "reducescattertensorcoalesced": "reduce_scatter_tensor",
    "alltoallbase": "all_to_all_single",
    "broadcastobjectlist": "broadcast",
    "gatherobject": "gather",
    "scatterobjectlist": "scatter",
    "monitoredbarrier": BARRIER,
    "isend": SEND,
    "irecv": RECV,
    "sendobjectlist": SEND,
    "recvobjectlist": RECV,
    "batchisendirecv": "send_recv",
    # NCCL's function names (ncclFuncToString) that fold differently from torch's
    "alltoall": "all_to_all",
    "sendrecv": "send_recv",
}
_FOLDED: dict[str, str] = {name.replace("_", ""): name for name in _CANONICAL} | _ALIASES
_MATCHING = {SEND: RECV, RECV: SEND}
_PREFIX = re.compile(r"^[A-Za-z0-9]+:")  # the flight recorder's "nccl:" / "gloo:"


@dataclass(frozen=True, slots=True)
class Operation:
    """What one spelling of an operation means."""

    spelling: str  # as the writer wrote it
    name: str  # canonical (torch's public name); the spelling itself when unknown
    kind: OpKind

    @property
    def known(self) -> bool:
        return self.kind is not OpKind.UNKNOWN


@functools.lru_cache(maxsize=4096)  # a job spells a handful of names, read once per rank per capture
def operation(spelling: str) -> Operation:
    """The operation ``spelling`` names: ``AllReduce``, ``all_reduce``, ``nccl:send 0->1``, ``isend``...

    A flight recorder's ``backend:`` prefix and peer suffix are dropped; the
    rest is folded (case and underscores) and looked up. An unknown name stays
    as written, of kind ``UNKNOWN``.
    """
    body = _PREFIX.sub("", spelling.strip()).split(" ", 1)[0]
    folded = body.lower().lstrip("_").replace("_", "")
    name = _FOLDED.get(folded)
    if name is None:
        return Operation(spelling, spelling, OpKind.UNKNOWN)
    return Operation(spelling, name, _CANONICAL[name])


def op_kind(spelling: str) -> OpKind:
    return operation(spelling).kind


def canonical_op(spelling: str) -> str:
    """The canonical name (``AllReduce`` -> ``all_reduce``; ``Recv`` -> ``recv``); an unknown name as written."""
    return operation(spelling).name


def is_point_to_point(spelling: str) -> bool:
    return operation(spelling).kind is OpKind.P2P


def is_collective(spelling: str) -> bool:
    return operation(spelling).kind is OpKind.COLLECTIVE


def matching_op(spelling: str) -> str | None:
    """The canonical op that completes a point-to-point op on its peer (send <-> recv); None for any other."""
    return _MATCHING.get(operation(spelling).name)


def is_send(spelling: str) -> bool:
    return operation(spelling).name == SEND


def direction_word(spelling: str) -> str:
    """``to`` for a send, ``from`` for anything else that has a peer: "send to rank 3", "recv from rank 1"."""
    return "to" if is_send(spelling) else "from"


def known_spellings() -> tuple[str, ...]:
    """Every name this vocabulary knows, canonical first (for documentation and tests)."""
    return (*_CANONICAL, *_ALIASES)


# What a flight recorder's entries of one collective must agree on, read from the op's spelling (torch's names, as
# the flight recorder writes them).
_UNEVEN_SUFFIXES = ("_v", "_v_single")  # torch's "v" collectives: every side's sizes differ per rank by design
_UNEVEN_INPUTS = ("all_to_all", "scatter")  # families whose members' inputs may differ...
_UNEVEN_OUTPUTS = ("all_to_all", "gather")  # ...or whose outputs may
_ROOT_INPUT_ONLY = ("scatter", "broadcast", "_broadcast_oop")  # only the root's input is data: inputs' dtypes may differ
_ROOT_OUTPUT_ONLY = ("gather",)  # only the root's output is data


class Shape(StrEnum):
    """How a collective's output size follows from its input's on one rank."""

    KEPT = "kept"  # all-reduce: output is the input's shape
    GATHERED = "gathered"  # all-gather: output numel = input numel x group size
    SCATTERED = "scattered"  # reduce-scatter: input numel = output numel x group size
    FREE = "free"  # no rule (or none known)


# canonical op -> how its output's size follows from its input's
_SHAPES = {"all_reduce": Shape.KEPT, "all_gather": Shape.GATHERED, "all_gather_into_tensor": Shape.GATHERED,
           "reduce_scatter": Shape.SCATTERED, "reduce_scatter_tensor": Shape.SCATTERED}


@dataclass(frozen=True, slots=True)
class TensorRule:
    """What the tensors of one collective's entries must satisfy, on each rank and across its members."""

    inputs_agree: bool  # every member's input sizes are the same
    outputs_agree: bool  # every member's output sizes are the same
    # Object collectives carry pickled sizes and c10d's upper-case coalesced OpTypes (``ALLGATHER_coalesced``) lists
    # of tensors: neither keeps a shape rule.
    shape: Shape
    totals_agree: bool  # the group's total input equals its total output (all-to-all)
    input_dtypes_agree: bool  # every member's input holds data of one dtype (not only a root's)
    output_dtypes_agree: bool
    dtype_kept: bool  # on each rank the output has the input's dtype


@functools.lru_cache(maxsize=1024)
def tensor_rule(spelling: str) -> TensorRule:
    """The rule of a collective spelled ``spelling`` (``all_reduce``, ``all_to_all_v``, ``gather``...)."""
    uneven = spelling.endswith(_UNEVEN_SUFFIXES)
    ruled = "object" not in spelling and spelling == spelling.lower()
    rooted = spelling in _ROOT_INPUT_ONLY or spelling in _ROOT_OUTPUT_ONLY
    return TensorRule(inputs_agree=not uneven and not spelling.startswith(_UNEVEN_INPUTS),
                      outputs_agree=not uneven and not spelling.startswith(_UNEVEN_OUTPUTS),
                      shape=_SHAPES.get(canonical_op(spelling), Shape.FREE) if ruled else Shape.FREE,
                      totals_agree=spelling.startswith("all_to_all"),
                      input_dtypes_agree=spelling not in _ROOT_INPUT_ONLY,
                      output_dtypes_agree=spelling not in _ROOT_OUTPUT_ONLY, dtype_kept=not rooted)


# Group descriptions that name nothing: torch's default for ``new_group`` without ``group_desc``, and none.
UNNAMED_GROUP_DESCRIPTIONS = frozenset({"", "undefined"})


def is_unnamed_group(description: str) -> bool:
    return description.strip().lower() in UNNAMED_GROUP_DESCRIPTIONS


__all__ = ["BARRIER", "RECV", "SEND", "UNNAMED_GROUP_DESCRIPTIONS", "OpKind", "Operation", "Shape", "TensorRule", "canonical_op",
           "direction_word", "is_collective", "is_point_to_point", "is_send", "is_unnamed_group", "known_spellings",
           "matching_op", "op_kind", "operation", "tensor_rule"]
