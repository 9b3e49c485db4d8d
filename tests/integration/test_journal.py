"""The incident journal the agents keep: written by a view that may act, read by any, checked entry by entry."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rankscope.actions.journal import (
    MAX_ENTRIES,
    Journal,
    JournalEntry,
    JournalError,
    entries_from_bytes,
    entries_to_bytes,
    entry_from_json,
)

pytestmark = pytest.mark.timeout(60)


def test_a_journal_keeps_each_entry_once_in_time_order_and_at_most_its_bound(tmp_path: Path) -> None:
    j = Journal(tmp_path / "journal.jsonl")
    a, b = JournalEntry(20.0, "verdict", "PP group 3"), JournalEntry(10.0, "hung", "no progress since 00:00:10")
    assert j.append([a, b]) == (b, a)
    assert j.append([a]) == (b, a)  # the acting view and a second one write the same moment once
    many = [JournalEntry(100.0 + i, "action", f"step {i}") for i in range(MAX_ENTRIES + 5)]
    for start in range(0, len(many), 50):
        j.append(many[start:start + 50])
    kept = j.read()
    assert len(kept) == MAX_ENTRIES and kept[-1] == many[-1]
    (tmp_path / "journal.jsonl").write_text((tmp_path / "journal.jsonl").read_text() + '{"wall": 1, "ki')
    assert len(j.read()) == MAX_ENTRIES  # a line cut by a crash is skipped, the rest stays


@pytest.mark.parametrize("bad", [
    {"wall": float("nan"), "kind": "hung", "text": "x"}, {"wall": -1, "kind": "hung", "text": "x"},
    {"wall": 1, "kind": "rm -rf", "text": "x"}, {"wall": 1, "kind": "hung", "text": ""},
    {"wall": True, "kind": "hung", "text": "x"}, [1, 2], {"wall": 1, "kind": "hung", "text": "x", "by": 3},
    {"wall": 1, "kind": "resumed", "text": "x", "observed": "yes"},
])
def test_an_entry_that_is_not_a_journals_is_refused(bad: object) -> None:
    with pytest.raises(JournalError):
        entry_from_json(bad)


def test_a_views_sighting_of_a_resumption_stays_one_through_the_journal() -> None:
    seen = JournalEntry(10.0, "resumed", "training runs again after the restart", "alice@desk", observed=True)
    told = JournalEntry(9.0, "resumed", "the job resumed from step 20", "rankscope drill")
    assert entries_from_bytes(entries_to_bytes([seen, told])) == (seen, told)
    assert [e.observed for e in entries_from_bytes(entries_to_bytes([seen, told]))] == [True, False]
    assert "observed" not in told.to_json()  # an older reader sees the entries it knew


@given(st.binary(max_size=300))
def test_any_body_is_entries_or_a_journal_error(body: bytes) -> None:
    try:
        entries = entries_from_bytes(body)
    except JournalError:
        return
    assert entries_from_bytes(entries_to_bytes(entries)) == entries


@given(st.text(max_size=600))
def test_text_is_printable_and_bounded(text: str) -> None:
    try:
        e = entry_from_json({"wall": 1.0, "kind": "verdict", "text": text})
    except JournalError:
        return
    assert e.text.isprintable() and len(e.text) <= 400


async def test_agents_serve_the_journal_to_read_tokens_and_take_entries_from_act_tokens(tmp_path: Path) -> None:
    from rankscope.actions.config import ActionsConfig
    from rankscope.wire.agent import AgentConfig, start_agent
    from rankscope.wire.client import JobClient
    from rankscope.wire.tokens import parse_tokens

    read, act = "read" + uuid.uuid4().hex, "act0" + uuid.uuid4().hex
    tokens = parse_tokens(f"read:{read}\nact:{act}", "test")
    agents = [await start_agent(AgentConfig(tokens=tokens, port=0, machine_name=f"m{i}", run_id=f"none-{uuid.uuid4()}",
                                            actions=ActionsConfig(tmp_path / f"state-m{i}"))) for i in range(2)]
    try:
        addresses = [a.address for a in agents]
        hung = JournalEntry(1000.0, "hung", "no progress since 00:16:40", "alice@desk")
        async with JobClient(addresses, read) as reader:
            assert await reader.journal([hung]) == ()  # a read token writes nothing
            assert await reader.journal() == ()
        async with JobClient(addresses, act, acting=True) as actor:
            assert await actor.journal([hung]) == (hung,)
        async with JobClient(addresses, read) as reader:
            assert await reader.journal() == (hung,)  # both agents keep it; the story has it once
        for i in range(2):
            assert Journal(tmp_path / f"state-m{i}" / "journal.jsonl").read() == (hung,)
    finally:
        for a in agents:
            await a.stop(0)
