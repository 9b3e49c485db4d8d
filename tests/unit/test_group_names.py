"""Group numbers in a suspect's name are marked as numbers: "PP groups 2-3 (ranks 2-3,6-7)" read as ranks."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from rankscope.analyzers.findings import Suspect, SuspectKind
from rankscope.analyzers.labels import group_name, numbered, suspect_label


def test_the_drill_pairs_groups_read_as_groups_beside_their_ranks() -> None:
    pp = Suspect(SuspectKind.PP, (2, 3, 6, 7), ("machine-1", "machine-3"), 1.0, ("stacks",), ("stacks",),
                 groups=(2, 3))
    assert suspect_label(pp) == "PP groups #2 and #3 (ranks 2-3,6-7)"
    one = Suspect(SuspectKind.PP, (4, 5, 6, 7), ("m2",), 1.0, ("stacks",), ("stacks",), group_index=1)
    assert suspect_label(one) == "PP group #1 (ranks 4-7)"


def test_group_names_of_one_none_and_runs() -> None:
    assert group_name("tp", ()) == "TP group"
    assert group_name("dp", (0,)) == "DP group #0"
    assert group_name("pp", (2, 3, 4, 5, 9)) == "PP groups #2-#5, #9"


@given(st.lists(st.integers(min_value=0, max_value=10_000), min_size=1, max_size=40))
def test_every_group_number_is_marked_and_the_text_reads_back_as_the_same_groups(groups: list[int]) -> None:
    text = numbered(groups)
    read: set[int] = set()
    for part in text.replace(" and ", ", ").split(", "):
        ends = part.split("-")
        assert all(end.startswith("#") for end in ends), text
        first, last = int(ends[0][1:]), int(ends[-1][1:])
        read.update(range(first, last + 1))
    assert read == set(groups)
