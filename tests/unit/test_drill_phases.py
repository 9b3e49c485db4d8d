"""The ranks' phase reports: the step each rank of a restarted job loaded, read by the drill's recovery."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from rankscope.drill.control import RecoveryEvent, resumed_text
from rankscope.drill.progress import PHASES_DIR, LoadedStep, read_loaded, read_phases, write_phase


def test_the_step_each_rank_loaded_is_read_back_newest_first_and_only_since_the_restart(tmp_path: Path) -> None:
    write_phase(tmp_path, 0, "loaded", LoadedStep(8, "checkpoint"))
    write_phase(tmp_path, 1, "loaded", LoadedStep(8, "checkpoint"))
    folder = tmp_path / PHASES_DIR
    since = max(json.loads(p.read_text().splitlines()[-1])["wall"] for p in folder.glob("*.jsonl")) + 0.001
    assert read_loaded(tmp_path, 0.0) == {0: LoadedStep(8, "checkpoint"), 1: LoadedStep(8, "checkpoint")}
    assert read_loaded(tmp_path, since) == {}  # the first job's reports are not the restart's
    # A restart: rank 0 restores a newer backup; a rank's other phases and a half-written line are no step.
    with open(folder / "rank0.jsonl", "a") as f:
        f.write(json.dumps({"rank": 0, "pid": 1, "phase": "loaded", "wall": since + 1, "step": 12,
                            "source": "backup"}) + "\n")
        f.write('{"rank": 0, "phase": "loaded", "wa')
    with open(folder / "rank1.jsonl", "a") as f:
        f.write(json.dumps({"rank": 1, "pid": 2, "phase": "joined", "wall": since + 1}) + "\n")
    assert read_loaded(tmp_path, since) == {0: LoadedStep(12, "backup")}
    assert set(read_phases(tmp_path, since)) == {"loaded", "joined"}


def _event(step: int, source: str) -> RecoveryEvent:
    return RecoveryEvent("evict-1", ("machine-2",), ("standby-0",), ("machine-0", "standby-0"), True, "ok",
                         0.0, 1.0, 0.0, step, resume_source=source)


def test_the_journal_line_names_where_the_step_came_from() -> None:
    assert resumed_text(_event(12, "backup"), "").startswith(
        "the job resumed from step 12 (the in-memory backup every rank held) on machine-0 standby-0")
    assert resumed_text(_event(8, "checkpoint"), "").startswith(
        "the job resumed from step 8 (the newest checkpoint every rank saved)")
    assert resumed_text(_event(0, "start"), "").startswith(
        "the job resumed from its start (no checkpoint or backup every rank held)")
    assert resumed_text(_event(0, ""), "").startswith("the job resumed from its start (no checkpoint every rank saved)")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=40), st.dictionaries(
    st.sampled_from(["rank", "phase", "wall", "step", "source", "pid"]),
    st.one_of(st.integers(-3, 3), st.floats(allow_nan=True), st.text(max_size=5), st.none(), st.sampled_from(["loaded"])),
    max_size=6).map(json.dumps)), max_size=8))
@example(['{"rank": Infinity, "phase": "loaded", "wall": 1.0}', '{"rank": 0, "phase": "loaded", "wall": 1.0, '
          '"step": -Infinity, "source": "x"}'])  # json.dumps writes them; int() of them overflows
def test_any_line_in_a_phase_file_is_a_report_or_skipped(tmp_path_factory: pytest.TempPathFactory,
                                                         lines: list[str]) -> None:
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / PHASES_DIR).mkdir()
    (run_dir / PHASES_DIR / "rank0.jsonl").write_text("\n".join(lines))
    for rank, loaded in read_loaded(run_dir, 0.0).items():
        assert isinstance(rank, int) and isinstance(loaded.step, int) and isinstance(loaded.source, str)
