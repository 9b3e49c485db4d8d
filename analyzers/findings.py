"""What analyzers return: suspects with evidence, gathered into a verdict.

Every detector (stack aggregation, CCL counters, fail-slow rounds, metric
outliers) speaks these types, so their findings merge into one ranking and
the CLI, the TUI and the drill's scorer read one shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class SuspectKind(StrEnum):
    """The parallel group (or single rank / machine) a suspect stands for."""

    PP = "pp"
    DP = "dp"
    TP = "tp"
    CP = "cp"
    EP = "ep"
    RANK = "rank"
    MACHINE = "machine"
    COMM = "comm"  # a communicator recorded by the CCL plugin, not a layout group
    DESYNC = "desync"  # ranks inside a different collective from their group peers (a program mismatch)


# Among suspects equal on their evidence, the kind named first: a desync (a program mismatch), then the groups in
# the order ByteRobust over-evicts them, then one machine, one rank, a communicator. One order for the stacks'
# candidates (``suspects``) and the merged verdict (``verdict``).
KIND_ORDER: tuple[SuspectKind, ...] = (SuspectKind.DESYNC, SuspectKind.PP, SuspectKind.DP, SuspectKind.TP,
                                       SuspectKind.CP, SuspectKind.EP, SuspectKind.MACHINE, SuspectKind.RANK,
                                       SuspectKind.COMM)


def kind_order(kind: str) -> int:
    """A kind's place in ``KIND_ORDER`` (an unknown kind last)."""
    return KIND_ORDER.index(SuspectKind(kind)) if kind in KIND_ORDER else len(KIND_ORDER)


class Side(StrEnum):
    """Which of Aegis's two sides a fact shows a rank stuck on (C4's hang kinds follow from it, ``labels.hang_kind``)."""

    OWN_WORK = "computation side"  # in its own work: computing, loading data, stopped, unreadable, a launch not made
    COMMUNICATION = "communication side"  # inside (or on its way into) a send/recv or collective that never completes


@dataclass(frozen=True, slots=True)
class Suspect:
    """One candidate for eviction: the ranks, their machines and why.

    ``score`` orders suspects (higher is more likely); ``sources`` names the
    detectors that agree (e.g. ``("stacks", "ccl")``); ``evidence`` is one
    human-readable line per fact, the first being the headline.
    """

    kind: SuspectKind
    ranks: tuple[int, ...]
    machines: tuple[str, ...]
    score: float
    evidence: tuple[str, ...]
    sources: tuple[str, ...] = ()
    group_index: int | None = None  # which group of that kind (e.g. the 3rd PP group); the first when several
    diverging_frame: str | None = None  # where the outliers leave the dominant stack path
    victims: tuple[int, ...] = ()  # ranks that only wait on this suspect: evidence, never suspects of their own
    state: str = ""  # what its root ranks are doing, e.g. "loading data", "unreadable (D, in nvidia_wait)"
    groups: tuple[int, ...] = ()  # every group of that kind it spans, when more than one (PP groups 6-7)
    # The ranks the evidence pins as the cause (the rank the others wait on, a rank that never posted what its peers
    # wait for, a rank stuck in its own code). Empty when the evidence cannot tell the group's members apart or points
    # at the link between them; then the whole group is the precise answer. ``ranks`` stays the whole group, which is
    # what ByteRobust's over-eviction takes.
    roots: tuple[int, ...] = ()
    # Its detector's own name for it, when that says more than ``labels.suspect_label`` (the stack aggregation's
    # "PP groups 6-7 on machine-12..15", a desync's "desync: ranks 2-3 ... "): what its detector's headline reads.
    title: str = ""
    state_side: Side | None = None  # the side ``state`` shows, when its detector knows (a chain root: its own work)
    sides: frozenset[Side] = frozenset()  # the sides its evidence shows (the counters'), folded-in suspects' included


@dataclass(frozen=True, slots=True)
class Finding:
    """A fact about the job that is more than "evict these machines".

    A desync (ranks inside a different collective from their group peers), a
    CCL or flight-recorder mismatch (sizes, dtypes, op types or states that
    disagree within one collective), a rank missing from a communicator's
    call. ``kind`` names the rule ("desync", "fr-size-mismatch", ...);
    ``advice`` says what a person should do, e.g. that eviction will not cure
    a program mismatch.
    """

    kind: str
    ranks: tuple[int, ...]
    summary: str
    evidence: tuple[str, ...] = ()
    communicator: str | None = None
    advice: str = ""


class VerdictStatus(StrEnum):
    """What a verdict says, read from this field and never from its words (``render.verdict_lines`` writes them)."""

    NAMED = "named"  # its detector's own headline: the suspects it names, or a finding without one
    NO_VERDICT = "no verdict"  # it names nobody; its summary says why
    NOT_A_RANK = "not a rank"  # every member of a communicator waits in one call: no rank is to blame
    TIMING = "timing"  # a capture of a job making steps: its ranks' differences are timing, not a fault


@dataclass(frozen=True, slots=True)
class Verdict:
    """Suspects ordered most likely first, plus what could not be judged.

    ``status``: ``NAMED`` for a detector's own headline (the suspects it names, or what it found without naming
    one: a flight recorder's mismatch); every verdict that says it has none says which kind of none.
    """

    suspects: tuple[Suspect, ...]
    summary: str  # one line for a header: "PP group 3 on machines 12-15", "no verdict: all ranks identical"
    missing_ranks: tuple[int, ...] = ()  # ranks the snapshot could not see
    notes: tuple[str, ...] = field(default=())
    findings: tuple[Finding, ...] = ()
    # The suspects ``summary`` names apart, when it names several ("2 separate suspects: ..."), each explaining its
    # own outliers; empty when it names one or none.
    named: tuple[Suspect, ...] = ()
    status: VerdictStatus = VerdictStatus.NAMED
    # The end of ``summary`` from the root rank it names on ("root rank 5 (computing; 3 ranks wait on it) (stacks)"),
    # after ", "; empty when it names none. The verdict panel draws it on a line of its own (``render.headline_parts``).
    summary_root: str = ""
    summary_head: str = ""  # with a ``summary_root``: the start of ``summary`` before it (what the summary names)

    @property
    def top(self) -> Suspect | None:
        return self.suspects[0] if self.suspects else None


def suspect_order(s: Suspect) -> tuple[float, int, tuple[int, ...]]:
    """How one detector ranks its suspects: the higher score first, then the fewer ranks, then the lower ranks."""
    return (-s.score, len(s.ranks), s.ranks)


# Finding.kind of the verdict "not a rank": every member of a communicator waits in the same collective at the same
# call site, so no rank is to blame (the communication layer, the network or a driver is). A verdict carrying it has
# no suspect picked by tie-break.
NOT_A_RANK = "not-a-rank"
NOT_A_RANK_PREFIX = "not a rank: "  # how such a verdict's headline begins (its status is VerdictStatus.NOT_A_RANK)
# What tells the communication layer, the network and a GPU or driver apart when no rank is to blame: every
# "not a rank" finding (stacks, counters, flight recorder, logs) carries it.
NOT_A_RANK_ADVICE = (
    "evicting one of these machines is a guess: every member did its part and the call itself does not "
    "complete, which points at the communication layer (NCCL, its transport), the network between the "
    "machines, or a GPU or its driver on one of them. What tells them apart: NCCL's RAS (`ncclras`, NCCL >= "
    "2.24) for the communicator's state and any rank whose operation counts differ; NCCL's own log "
    "(NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,NET) for transport errors, retries and timeouts; NVML on each "
    "machine (`nvidia-smi -q -d ECC,PERFORMANCE`, the kernel log for Xid) for Xid errors and PCIe/NVLink "
    "replay or error counters. Evict the machine one of them names; with nothing named, restart the job "
    "from its last checkpoint")


def finding_to_json(f: Finding) -> dict[str, object]:
    """One finding as ``analyze --json`` and bundles show it (every detector's findings go through here)."""
    return {
        "kind": f.kind,
        "ranks": list(f.ranks),
        "communicator": f.communicator,
        "summary": f.summary,
        "evidence": list(f.evidence),
        "advice": f.advice,
    }
