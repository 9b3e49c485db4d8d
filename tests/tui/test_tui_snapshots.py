"""SVG snapshots of every view at 80x24 and 160x48, from the recorded Fig. 7 bundle.

The bundle's own times are used for "now", so the screens are the same on
every run. Update after a deliberate change with
`pytest tests/tui/test_tui_snapshots.py --snapshot-update` and look at the SVGs.
"""

from __future__ import annotations

from typing import Any

import pytest
from rankscope.tui.app import AppOptions, RankscopeApp
from rankscope.tui.sources import BundleSource
from textual.pilot import Pilot
from tui_bundles import fig7_bundle

pytestmark = pytest.mark.timeout(120)

SIZES = {"80x24": (80, 24), "160x48": (160, 48)}
VIEWS = {"overview": (), "stacks": ("2",), "ccl": ("3",), "metrics": ("4",), "events": ("5",),
         "rank": ("2", "enter"), "help": ("question_mark",)}


async def _loaded(pilot: Pilot[Any]) -> None:
    app = pilot.app
    assert isinstance(app, RankscopeApp)
    await app.loaded.wait()
    await pilot.pause()


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("view", VIEWS)
def test_view_snapshot(snap_compare: Any, view: str, size: str) -> None:
    app = RankscopeApp(BundleSource(fig7_bundle(), "bundle fig7"), AppOptions())
    assert snap_compare(app, press=VIEWS[view], terminal_size=SIZES[size], run_before=_loaded)
