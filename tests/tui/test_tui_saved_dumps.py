"""Saved py-spy dumps of a public incident opened in the TUI (`rankscope attach --bundle DIR`), and the other
incident formats refused with the command that reads them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from rankscope.cli.commands.attach import saved_dumps
from rankscope.contract.errors import RankscopeError
from rankscope.tui.app import AppOptions, RankscopeApp
from rankscope.tui.sources import BundleSource
from repo_paths import shared
from tui_screen import screen_text, until

BLOOM = shared("external", "bloom176b-eval-hang-2022-04-30")
FR = shared("external", "pytorch-fr-test-fixtures", "case4-size-mismatch")
TRACE = shared("external", "bytedance-straggler-traces", "trace-AR.parquet")


@pytest.mark.skipif(BLOOM is None, reason="shared/external/bloom176b-eval-hang-2022-04-30 not found")
async def test_a_folder_of_saved_dumps_opens_on_the_incidents_verdict() -> None:
    assert BLOOM is not None
    bundle = saved_dumps(BLOOM, None)
    assert bundle is not None and len(bundle.snapshots) == 1
    assert sorted(bundle.latest.all_stacks()) == list(range(16))
    app = RankscopeApp(BundleSource(bundle, f"dumps {BLOOM.name}"), AppOptions())
    async with app.run_test(size=(160, 48)) as pilot:
        await until(pilot, app.loaded.is_set, what="the dumps to load")
        await pilot.pause()
        text = screen_text(app)
        # The same verdict `rankscope analyze` gives on these dumps: rank 4's data loading holds the other 15.
        assert "verdict: machine machine-4" in text and "15 ranks wait on it" in text, text
        assert f"dumps {BLOOM.name}" in text and "16/16 machines" in text


def test_a_bundle_is_not_taken_for_dumps(tmp_path: Path) -> None:
    bundle = tmp_path / "b.json"
    bundle.write_text('{"format": "rankscope.bundle"}')
    assert saved_dumps(bundle, None) is None and saved_dumps(bundle.with_name("absent.json"), None) is None


@pytest.mark.parametrize("path", [FR, TRACE], ids=["flight-recorder", "op-trace"])
def test_incident_data_the_tui_does_not_show_is_refused_with_the_command_that_reads_it(path: Path | None) -> None:
    if path is None:
        pytest.skip("shared/external data not found")
    out = subprocess.run([sys.executable, "-m", "rankscope", "attach", "--bundle", str(path)], capture_output=True,
                         text=True, stdin=subprocess.DEVNULL, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "which the terminal UI does not show" in out.stderr and f"fix: rankscope analyze {path}" in out.stderr
    if path == FR:  # one rank's dump alone: the folder is what reads
        with pytest.raises(RankscopeError) as err:
            saved_dumps(path / "dump_file_rank_0.json", None)
        assert err.value.fix == f"rankscope analyze {path}"
