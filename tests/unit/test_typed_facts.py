"""Facts the analysis decides on travel as typed fields, never as words read back from text it wrote.

C4's hang kind reads a suspect's sides, a rank view reads whether its machine
was reachable, the verdict panel's two lines come from the verdict's parts,
the chain names a lone rank's group by a typed id: each test here would pass
with the old text-reading code only by accident of wording, and fails when
the words and the fields disagree.
"""

from __future__ import annotations

from rankscope.analyzers.chain import WORLD_ID, GroupId, RankGroups, RankState
from rankscope.analyzers.findings import Side, Suspect, SuspectKind, Verdict
from rankscope.analyzers.labels import COMMUNICATION_HANG, NON_COMMUNICATION_HANG, hang_kind
from rankscope.analyzers.render import headline, headline_parts
from rankscope.analyzers.stage_rank_states import rank_view
from rankscope.analyzers.topology import Topology
from rankscope.contract.snapshot import CaptureError, CaptureErrorKind, Layout, ProcessRole, ProcessStack, RankStacks


def _verdict(evidence: tuple[str, ...] = ("rank 3",), state: str = "", state_side: Side | None = None,
             sides: frozenset[Side] = frozenset()) -> Verdict:
    suspect = Suspect(SuspectKind.RANK, (3,), ("m1",), 1.0, evidence, state=state, state_side=state_side, sides=sides)
    return Verdict((suspect,), "rank 3 on m1")


def test_the_hang_kind_follows_the_sides_whatever_the_words_say() -> None:
    # A state whose words read like the root's own work, from a detector that says it waits on others.
    assert hang_kind(_verdict(state="computing the schedule it waits for")) == COMMUNICATION_HANG
    assert hang_kind(_verdict(state="odd words", state_side=Side.OWN_WORK)) == NON_COMMUNICATION_HANG
    # Evidence words alone decide nothing; the sides the counters gave do.
    assert hang_kind(_verdict(evidence=("rank 3: AllReduce CL 4 < 5 (computation side)",))) is None
    assert hang_kind(_verdict(sides=frozenset({Side.COMMUNICATION}))) == COMMUNICATION_HANG
    assert hang_kind(_verdict(sides=frozenset({Side.COMMUNICATION, Side.OWN_WORK}))) == NON_COMMUNICATION_HANG
    # The state its detector named comes before the sides of what was folded into it.
    assert hang_kind(_verdict(state="behind in the collective", sides=frozenset({Side.OWN_WORK}))) \
        == COMMUNICATION_HANG


def test_a_rank_without_stacks_is_unreadable_only_when_its_machine_was_unreachable() -> None:
    reason = "machine m2 unreachable (connection refused)"
    assert rank_view(5, None, reason, unreachable=True).state is RankState.UNREADABLE
    assert rank_view(5, None, reason).state is RankState.UNKNOWN  # the words alone do not make it unreachable
    assert rank_view(5, None, "no stacks in the snapshot", unreachable=True).state is RankState.UNREADABLE


def test_an_unreadable_ranks_few_words_name_its_captures_error_kind_not_a_head_cut_from_its_reason() -> None:
    # The machine's error message holds a colon: its words before it are no kind of failure.
    gone = rank_view(5, None, "machine m2 unreachable (connect: connection refused)", unreachable=True)
    assert gone.short() == "unreadable"
    stuck = RankStacks(5, ProcessStack(pid=105, role=ProcessRole.MAIN, threads=None, error=CaptureError(
        CaptureErrorKind.TIMEOUT, "py-spy: no answer within 5 s", process_state="D", wchan="nv_wait")))
    view = rank_view(5, stuck)
    assert view.error_kind is CaptureErrorKind.TIMEOUT
    assert view.short() == "unreadable: timeout, process state D in nv_wait"


def test_the_panel_lines_come_from_the_verdicts_parts_not_its_summary() -> None:
    v = Verdict((), "PP group 1 (ranks 4-7) on m2, root rank 5 (computing; 3 ranks wait on it)",
                summary_root="root rank 5 (computing; 3 ranks wait on it)", summary_head="PP group 1 (ranks 4-7) on m2")
    assert headline_parts(v) == ("PP group 1 (ranks 4-7) on m2", "root rank 5 (computing; 3 ranks wait on it)")
    assert headline(v) == v.summary
    plain = Verdict((), "no verdict: all 8 ranks show the same stacks")
    assert headline_parts(plain) == (plain.summary, "")


def test_a_rank_in_no_group_of_a_kind_is_a_group_of_its_own_even_with_a_negative_number() -> None:
    groups = RankGroups(Topology(Layout(tp=2, pp=1, dp=2), 4), [0, 1, 2, 3])
    assert groups.gid("tp", 2) == GroupId("tp", 1) and groups.of_id(GroupId("tp", 1)) == (2, 3)
    alone = groups.gid("tp", -7)  # a damaged capture's rank number, outside every group
    assert alone == GroupId("tp", -7, alone=True) and groups.of_id(alone) == (-7,)
    assert alone != GroupId("tp", -7)  # never mistaken for a real group's index
    assert groups.of_id(WORLD_ID) == (0, 1, 2, 3)
