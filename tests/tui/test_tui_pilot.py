"""Pilot tests of the TUI on recorded bundles: verdict, navigation, filter, copy, write, lost agents."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from queue_source import QueueSource
from rankscope.contract.bundle import read_bundle
from rankscope.tui.app import AppOptions, RankscopeApp
from rankscope.tui.screens.help import HelpScreen
from rankscope.tui.screens.rank import RankScreen
from rankscope.tui.sources import BundleSource
from rankscope.tui.state import AppState
from textual.command import CommandList, CommandPalette
from tui_bundles import FIG7_LAYOUT, T0, fig7_bundle, job, lost_series
from tui_screen import screen_text, until

pytestmark = pytest.mark.timeout(60)


def fig7_app(**options: object) -> RankscopeApp:
    return RankscopeApp(BundleSource(fig7_bundle(), "bundle fig7"), AppOptions(**options))  # type: ignore[arg-type]


async def test_bundle_opens_on_the_verdict_with_suspect_machines_and_diverging_frame() -> None:
    app = fig7_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, app.loaded.is_set)
        await pilot.pause()
        text = screen_text(app)
        assert "HUNG since" in text
        assert "16/16 machines" in text
        assert "TP=2 PP=4 DP=4" in text
        # The PP group of ranks 24-31 on machines 12-15 is named, and where it leaves the healthy path.
        assert "node12..15" in text
        assert "ranks 24-31" in text
        assert "diverges at forward_step" in text
        view = app.state.stacks
        assert view is not None
        assert [len(g.ranks) for g in view.groups] == [24, 4, 2, 2]
        assert view.groups[0].ranks == tuple(range(24))
        # The rank map: dominant A on machines 0-11, outlier letters on 12-15.
        assert "node00 AA" in text
        assert "node12 BB" in text
        assert "node15 DD" in text
        pp = [s for s in view.verdict.suspects if s.kind.value == "pp"]
        assert pp and set(pp[0].machines) == {"node12", "node13", "node14", "node15"}


async def test_views_switch_with_number_keys_and_enter_opens_a_rank() -> None:
    app = fig7_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, app.loaded.is_set)
        await pilot.press("2")
        await pilot.pause()
        assert app.main.active_view == "stacks"
        text = screen_text(app)
        assert "irecv" in text and "24-27" in text
        # The root's group is selected: the comparison marks where it diverges.
        assert "group D diverges at forward_step" in text  # the root (rank 30) group, not a victim one
        await pilot.press("up")  # group C (isend, ranks 28-29), above the root's group D
        await pilot.pause()
        assert "28-29" in screen_text(app)
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, RankScreen))
        await pilot.pause()
        text = screen_text(app)
        assert "rank 28" in text and "node14" in text
        assert "isend" in text and "dataloader" in text  # the subprocess is shown too
        await pilot.press("n")
        await pilot.pause()
        assert "rank 29" in screen_text(app)
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, RankScreen))
        for key, view in (("3", "ccl"), ("4", "metrics"), ("5", "events"), ("1", "overview")):
            await pilot.press(key)
            await pilot.pause()
            assert app.main.active_view == view


async def test_rank_map_cursor_moves_with_vim_keys_and_opens_the_rank_under_it() -> None:
    app = fig7_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, app.loaded.is_set)
        app.main.query_one("#rank-map").focus()
        for key in ("j",) * 12 + ("l",):
            await pilot.press(key)
        await pilot.pause()
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, RankScreen))
        screen = app.screen
        assert isinstance(screen, RankScreen)
        assert screen.rank == 25  # machine 12, second slot
        assert "irecv" in screen.text


async def test_filter_by_machine_rank_range_and_frame_text() -> None:
    app = fig7_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, app.loaded.is_set)
        await pilot.press("slash")
        await pilot.press(*"node15")
        await pilot.press("enter")
        await pilot.pause()
        assert app.state.filter.ranks == frozenset({30, 31})
        text = screen_text(app)
        assert "filter 'node15': 2 ranks (30-31)" in text
        assert "node00 ··" in text  # ranks outside the filter are dimmed dots
        await pilot.press("2")
        await pilot.pause()
        text = screen_text(app)
        assert "all_gather_into_tensor" in text
        assert "_single_tensor_adam" not in text.split("all ranks")[0]  # the healthy group is filtered out
        app.set_filter("isend")
        assert app.state.filter.ranks == frozenset({28, 29})
        app.set_filter("8-11, 30")
        assert app.state.filter.ranks == frozenset({8, 9, 10, 11, 30})
        await pilot.press("escape")
        await pilot.pause()
        assert not app.state.filter.active


async def test_copy_verdict_and_rank_stack_and_write_a_bundle(tmp_path: Path) -> None:
    app = fig7_app(bundle_dir=tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, app.loaded.is_set)
        await pilot.press("y")
        await pilot.pause()
        assert app.last_copied is not None
        assert app.clipboard == app.last_copied
        assert "ranks 24-31" in app.last_copied and "node12" in app.last_copied
        assert "diverges at: forward_step" in app.last_copied
        await pilot.press("2", "enter")
        await until(pilot, lambda: isinstance(app.screen, RankScreen))
        await pilot.press("y")
        await pilot.pause()
        assert app.last_copied.startswith("rank 30")  # the root's group is the one selected
        assert "gather_output" in app.last_copied
        await pilot.press("escape", "w")
        await until(pilot, lambda: app.last_written is not None)
        assert app.last_written is not None
        saved = read_bundle(app.last_written)
        assert len(saved.snapshots) == len(fig7_bundle().snapshots)
        assert saved.latest.all_stacks()[30].main.threads is not None


async def test_ccl_view_opens_a_communicator_and_marks_the_laggard() -> None:
    app = fig7_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, app.loaded.is_set)
        await pilot.press("3")
        await until(pilot, lambda: "with mismatches" in screen_text(app))
        text = screen_text(app)
        assert "1 with mismatches" in text
        assert text.index("pp24") < text.index("pp0 ")  # mismatched communicators sort first
        app.main.query_one("#ccl-table").focus()
        await pilot.press("enter")
        await until(pilot, lambda: "CL lags" in screen_text(app))  # rank 30 never launched its last send
        text = screen_text(app)
        assert "2 open" not in text or "1 open" in text
        rows = [line for line in text.splitlines() if line.strip().startswith("30 ")]
        assert rows and "CL lags" in rows[0]
        await pilot.press("o")
        await pilot.press("escape")
        await until(pilot, lambda: "communicators" in screen_text(app))


async def test_help_lists_keys_and_read_only_has_no_action_keys() -> None:
    app = fig7_app(read_only=True)
    async with app.run_test(size=(100, 40)) as pilot:
        await until(pilot, app.loaded.is_set)
        assert "[read-only]" in screen_text(app)
        await pilot.press("question_mark")
        await until(pilot, lambda: isinstance(app.screen, HelpScreen))
        text = screen_text(app)
        assert "capture stacks now" in text and "read-only: no keys change the job" in text
        assert "evict the suspect" not in text
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, HelpScreen))
        bound = {key for b in app.BINDINGS for key in getattr(b, "key", "").split(",")}
        assert not bound & {"e", "u", "b"}  # bound per app, only when the session may act
        assert not set(app.active_bindings) & {"e", "u", "b"}


async def test_agent_lost_then_regained_shows_and_logs_both() -> None:
    first, lost, back = lost_series()
    source = QueueSource("script", initial=(first,))
    app = RankscopeApp(source, AppOptions(poll_interval_s=0.01, capture_on_start=False), clock=lambda: T0 + 5)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, app.loaded.is_set)
        assert app.state.lost == ()
        source.push_poll(lost)
        await until(pilot, lambda: app.state.lost == ("node05",))
        await pilot.pause()
        text = screen_text(app)
        assert "15/16 machines 1 lost" in text
        assert "node05 ××" in text  # its ranks stay on the map, marked lost
        source.push_poll(back)
        await until(pilot, lambda: app.state.lost == ())
        await pilot.press("5")
        await pilot.pause()
        text = screen_text(app)
        assert "agent node05 (127.0.0.1:50105) lost" in text
        assert "agent node05 (127.0.0.1:50105) is back" in text
        kinds = [e.kind for e in app.state.events]
        assert kinds.index("lost") < kinds.index("found")


async def test_stopped_progress_triggers_one_automatic_capture() -> None:
    source = QueueSource("script", initial=(job(T0, stacks=False, step=5, hung=False),))
    app = RankscopeApp(source, AppOptions(poll_interval_s=0.01, hang_after_s=10, capture_on_start=False),
                       clock=lambda: T0)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, app.loaded.is_set)
        source.push_capture(job(T0 + 20, stacks=True, step=5, hung=True))
        source.push_poll(job(T0 + 5, stacks=False, step=5, hung=False))
        await until(pilot, lambda: app.state.polls == 2)
        assert source.captures_started == 0  # stopped 5 s: not yet
        source.push_poll(job(T0 + 15, stacks=False, step=5, hung=False))
        await until(pilot, lambda: app.state.stacks is not None)
        assert source.captures_started == 1
        source.push_poll(job(T0 + 16, stacks=False, step=5, hung=False))
        await until(pilot, lambda: app.state.polls >= 5)
        assert source.captures_started == 1  # once per stop, not on every poll


async def test_an_empty_state_draws_without_data() -> None:
    source = QueueSource("script")
    app = RankscopeApp(source, AppOptions(capture_on_start=False))
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, app.loaded.is_set)
        await pilot.pause()
        text = screen_text(app)
        assert "waiting for the first poll" in text
        assert "no capture yet" in text
        assert isinstance(app.state, AppState)
        for key in ("2", "3", "4", "5", "y"):
            await pilot.press(key)
        await pilot.pause()
        assert app.last_copied == "no capture yet"


def test_fig7_layout_is_the_papers() -> None:
    assert (FIG7_LAYOUT.tp, FIG7_LAYOUT.pp, FIG7_LAYOUT.dp, FIG7_LAYOUT.ranks_per_machine) == (2, 4, 4, 2)


async def test_command_palette_runs_a_capture() -> None:
    source = QueueSource("script", initial=(job(T0, stacks=False, step=5, hung=False),))
    source.push_capture(job(T0 + 1, stacks=True, step=5, hung=True))
    app = RankscopeApp(source, AppOptions(capture_on_start=False, poll_interval_s=3600), clock=lambda: T0 + 1)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, app.loaded.is_set)
        await pilot.press("ctrl+p")
        await until(pilot, lambda: isinstance(app.screen, CommandPalette))
        await pilot.press(*"Capture stacks")

        def capture_offered() -> bool:  # the palette searches in a worker: wait for its first hit
            hits = app.screen.query(CommandList)
            return bool(hits) and hits.first().option_count > 0 and \
                "Capture stacks" in str(hits.first().get_option_at_index(0).prompt)

        await until(pilot, capture_offered)
        await pilot.press("enter")
        await until(pilot, lambda: app.state.stacks is not None)
        assert source.captures_started == 1
        assert "node12..15" in screen_text(app)


def test_attach_cli_names_the_fix_for_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rankscope.cli.main import main as cli_main

    assert cli_main(["attach", "--bundle", str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert cli_main(["attach", "--bundle", str(bad)]) == 2
    assert "not a rankscope bundle" in capsys.readouterr().err
    assert cli_main(["attach", "--bundle", str(bad), "--agents", "127.0.0.1:1"]) == 2
    assert "cannot be combined" in capsys.readouterr().err
    assert cli_main(["attach"]) == 2
    assert "fix:" in capsys.readouterr().err


async def test_a_bundle_given_by_path_is_read_by_the_app_and_a_bad_one_exits_with_the_fix(tmp_path: Path) -> None:
    from rankscope.contract.bundle import write_bundle

    path = write_bundle(fig7_bundle(), tmp_path / "fig7.json")
    source = BundleSource(label="bundle fig7.json", path=path)
    assert source.label.startswith("loading")
    app = RankscopeApp(source, AppOptions())
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, app.loaded.is_set)
        await pilot.pause()
        assert "bundle fig7.json │" in screen_text(app)
        assert app.state.stacks is not None and len(app.state.stacks.groups) == 4
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "rankscope.bundle", "version": 99}')
    app = RankscopeApp(BundleSource(label="bad", path=bad), AppOptions())
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.return_code is not None)
    assert app.return_code == 2


async def select_rank_25(pilot: Any, app: RankscopeApp) -> None:
    """Fig. 7's app loaded, its map's cursor moved by keys onto rank 25 (node12), and the line below naming it."""
    await until(pilot, app.loaded.is_set)
    app.main.query_one("#rank-map").focus()
    for key in ("j",) * 12 + ("l",):
        await pilot.press(key)
    await until(pilot, lambda: "▸ rank 25 · node12" in screen_text(app), 10, "the rank's line")


async def test_the_selected_rank_line_follows_the_capture_on_screen() -> None:
    # It kept "group A: all_reduce" for a rank a later capture showed in another group (recv).
    from dataclasses import replace

    from rankscope.tui import digest as dg
    from rankscope.tui import state as st
    from rankscope.tui.analysis import build_stack_view
    from tui_bundles import T0, job

    app = fig7_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await select_rank_25(pilot, app)
        await until(pilot, lambda: "▸ rank 25 · node12 · group B: irecv" in screen_text(app), 10, "its group")
        healthy = job(T0 + 60, stacks=True, step=103, hung=False)  # every rank in the optimizer: one group, A
        app.state = st.apply_capture(replace(app.state, verdict=None), dg.digest(healthy),
                                     build_stack_view(healthy, healthy.layout), T0 + 60)
        app.redraw()
        await until(pilot, lambda: "▸ rank 25 · node12 · group A: _single_tensor_adam" in screen_text(app), 10,
                    "the line redrawn from the new capture")


async def test_a_long_event_goes_on_in_the_rows_below_at_80_columns() -> None:
    from rankscope.tui import state as st

    text = ("the job resumed from step 20 (the newest checkpoint every rank saved) on machine-0 machine-1 standby-0 "
            "(standby-0 joined) after evicting machine-2, code git:v2 (bbbb)")
    app = fig7_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, app.loaded.is_set)
        app.state = st.apply_info(app.state, text, app.state.now_wall + 1)
        await pilot.press("5")
        app.redraw()
        await until(pilot, lambda: "(bbbb)" in screen_text(app), 10, "the event's end")
        shown = " ".join(line.split("info", 1)[-1].strip() if "info" in line else line.strip()
                         for line in screen_text(app).splitlines()[5:9])
        assert text in shown, shown


async def test_the_ccl_view_keeps_every_column_at_80_columns() -> None:
    # Long communicator names ("pp24 PIPELINE_MODEL_PARALLEL_GROUP") cut the header to "op" and hid "progress".
    app = fig7_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, app.loaded.is_set)
        await pilot.press("3")
        await until(pilot, lambda: "CL min-max" in screen_text(app), 10, "the CCL table")
        lines = screen_text(app).splitlines()
        head = next(line for line in lines if "CL min-max" in line)
        assert head.split()[-4:] == ["WR", "WC", "open", "progress"], head
        row = next(line for line in lines if "pp24" in line)
        assert "PIPELINE_MODEL_PARALLEL_GROUP" not in row and "…" in row  # the name gave up its width
        app.main.query_one("#ccl-table").focus()
        await pilot.press("enter")  # opened, the communicator's own table has no name column to give up
        await until(pilot, lambda: "CL lags" in screen_text(app), 10, "the opened communicator")


async def test_the_selected_rank_line_names_the_rank_under_the_cursor_after_ranks_move() -> None:
    # After a restart the cell under the cursor held another rank; the line kept the one the cursor was moved to.
    from dataclasses import replace

    app = fig7_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await select_rank_25(pilot, app)
        # The restarted job put its ranks in the other order on node12: rank 24 sits under the cursor now.
        machines = tuple(replace(m, ranks=(25, 24)) if m.name == "node12" else m for m in app.state.machines)
        app.state = replace(app.state, machines=machines)
        app.redraw()
        await until(pilot, lambda: "▸ rank 24 · node12" in screen_text(app), 10, "the line of the rank under it")
        assert "▸ rank 25" not in screen_text(app)
