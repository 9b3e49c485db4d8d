"""Fail-slow view (key 7): a recorded series replayed through the detectors, live polls fed as they come.

The series are built here from contract dataclasses: four machines of two
ranks, one snapshot a second, each rank reporting its step counter and last
step duration (what the CCL plugin reports), host and GPU metrics with a
small fixed wobble. In the slow series machine m2 takes 1.5x longer per step
(and runs hotter and busier, as a throttled machine does) from second 10 on.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
from queue_source import QueueSource
from rankscope.contract.bundle import Bundle
from rankscope.contract.snapshot import (
    GpuMetrics,
    GpuStatus,
    HostMetrics,
    Instant,
    JobSnapshot,
    MachineSnapshot,
    ProcessInfo,
    ProcessRole,
    RankCounters,
    RankInfo,
)
from rankscope.tui import state as st
from rankscope.tui.app import AppOptions, RankscopeApp
from rankscope.tui.failslow_state import FailSlowTracker
from rankscope.tui.sources import BundleSource
from rankscope.tui.widgets.failslow import FailSlowPanel, heat_text, history_text
from textual.pilot import Pilot
from textual.widgets import Static

pytestmark = pytest.mark.timeout(120)

MACHINES = ("m0", "m1", "m2", "m3")
RPM = 2
WALL0 = 1_790_000_000.0
MONO0 = 100.0
SLOW_FROM = 10


def _wobble(t: int, i: int) -> float:
    """Deterministic ±3% noise, different per machine and time."""
    return 1.0 + 0.03 * math.sin(1.7 * t + 2.3 * i)


def fs_series(n: int, slow: str | None = "m2", slow_from: int = SLOW_FROM, factor: float = 1.5) -> list[JobSnapshot]:
    steps = {r: 0 for r in range(len(MACHINES) * RPM)}
    world = len(MACHINES) * RPM
    out = []
    for t in range(n):
        ms = []
        for i, m in enumerate(MACHINES):
            hot = m == slow and t >= slow_from
            w = _wobble(t, i)
            step = 0.5 * w * (factor if hot else 1.0)
            infos, counters = [], []
            for r in range(i * RPM, (i + 1) * RPM):
                steps[r] += 1
                infos.append(RankInfo(r, r % RPM, world, 1000 + r, group_rank=i,
                                      process=ProcessInfo(1000 + r, 1, ProcessRole.MAIN, "python",
                                                          cpu_percent=60.0 * w * (1.3 if hot else 1.0))))
                counters.append(RankCounters(r, 1000 + r, world, "fs", WALL0 + t, steps=steps[r],
                                             last_step_duration_s=step))
            gpus = GpuStatus(True, tuple(GpuMetrics(g, util_percent=80.0 * w, temperature_c=60.0 * w * (1.25 if hot else 1.0),
                                                    power_w=250.0 * w, sm_clock_mhz=1400.0) for g in range(RPM)))
            ms.append(MachineSnapshot(m, f"127.0.0.1:{5000 + i}", True, Instant(WALL0 + t, MONO0 + t), m,
                                      tuple(infos), (), HostMetrics(40.0 * w, 8, 16 << 30, 8 << 30, 1.0), gpus,
                                      tuple(counters)))
        out.append(JobSnapshot(Instant(WALL0 + t, MONO0 + t), tuple(ms), job_id="fs"))
    return out


def fs_bundle(n: int = 70, slow: str | None = "m2") -> Bundle:
    snaps = tuple(fs_series(n, slow))
    return Bundle(snaps, WALL0 + n, ground_truth={"fault": "fail-slow", "machines": [slow] if slow else []})


async def _replayed(pilot: Pilot[Any]) -> None:
    app = pilot.app
    assert isinstance(app, RankscopeApp)
    await app.loaded.wait()
    await app.failslow.idle.wait()
    await pilot.pause()


def _text(app: RankscopeApp, selector: str) -> str:
    return str(app.main.query_one(selector, Static).render())


# ---- the tracker, without the app ----------------------------------------------


def test_tracker_names_the_slow_machine_and_marks_its_ranks() -> None:
    tracker = FailSlowTracker()
    view = tracker.feed_series((s, None) for s in fs_series(70))
    v = view.verdict
    assert v is not None and v.confident and v.machine == "m2"
    assert view.suspect == "m2"
    heat = {h.machine: h for h in view.heat}
    assert heat["m2"].ranks == (4, 5)
    assert all(r is not None and 1.4 < r < 1.6 for r in heat["m2"].ratios)
    assert all(r is not None and r < 1.1 for m in ("m0", "m1", "m3") for r in heat[m].ratios)
    # slow since: measured in the snapshots' time, from when the evidence began
    assert v.slow_since_mono is not None and MONO0 + SLOW_FROM <= v.slow_since_mono <= MONO0 + SLOW_FROM + 2
    assert view.slow_for_s == pytest.approx(MONO0 + 69 - v.slow_since_mono)
    assert len(view.rounds) == 60 and view.updates == 70
    assert view.rounds[-1].suspect == "m2" and view.rounds[-1].confident
    # the oldest round kept is the slowdown's first second: flagged, not alarmed, no suspect yet
    first = view.rounds[0]
    assert first.at_mono == MONO0 + SLOW_FROM and first.suspect is None
    assert ("step_time", "m2", False) in first.flags and not any(alarmed for _, _, alarmed in first.flags)
    # the sparklines: the suspect's step time stays ~1.5x its peers' median once slow
    assert view.suspect_steps[-1] / view.peer_steps[-1] == pytest.approx(1.5, rel=0.08)
    plain = heat_text(view, 80, 10, ("m2",)).plain
    m2_line = next(line for line in plain.splitlines() if line.startswith("m2"))
    assert m2_line.endswith("▲▲") and "▲" not in plain.split("m2")[0]
    hist = history_text(view.rounds, 40).plain
    assert "A=m2" in hist and "step_time" in hist


def test_tracker_on_a_healthy_series_flags_nothing_confidently() -> None:
    view = FailSlowTracker().feed_series((s, None) for s in fs_series(70, slow=None))
    assert view.verdict is not None and not view.verdict.confident
    assert not view.verdict.verdict.suspects
    assert view.slow_for_s is None
    assert all(r is not None and r < 1.1 for h in view.heat for r in h.ratios)


def test_tracker_ignores_a_repeated_snapshot() -> None:
    snaps = fs_series(5)
    tracker = FailSlowTracker()
    tracker.feed_series([(snaps[0], None)])
    tracker.feed_series([(snaps[1], None)])
    view = tracker.feed_series([(snaps[1], None)])
    assert view.updates == 2 and len(view.rounds) == 2


def test_heat_map_packs_ranks_and_keeps_the_slowest_machines() -> None:
    """300 ranks a machine do not fit 80 columns: cells hold several ranks and show the slowest of them."""
    from rankscope.tui.failslow_state import EMPTY, HeatRow

    def row(i: int, slow_rank: int | None) -> HeatRow:
        ranks = tuple(range(i * 300, (i + 1) * 300))
        ratios = tuple(1.6 if r == slow_rank else 1.0 for r in ranks)
        return HeatRow(f"n{i:02d}", ranks, ratios, 1.0, 0.5, True)

    rows = tuple(row(i, 5 * 300 + 123 if i == 5 else None) for i in range(12))
    view = replace(EMPTY, heat=rows)
    lines = heat_text(view, 80, 4, ()).plain.splitlines()
    assert "per cell, slowest shown" in lines[0]
    shown = [line for line in lines[1:] if line.startswith("n")]
    assert len(shown) == 4  # in machine order, the one with a straggling rank among them
    n05 = next(line for line in shown if line.startswith("n05"))
    cells = n05.split()[-1]
    assert cells.count("▲") == 1 and len(cells) <= 80 and set(cells) == {"■", "▲"}
    assert "8 more machines" in lines[-2]


# ---- the app -------------------------------------------------------------------


async def test_key_7_shows_the_slow_machine_of_a_recorded_series() -> None:
    app = RankscopeApp(BundleSource(fs_bundle(), "bundle fs"), AppOptions())
    async with app.run_test(size=(160, 48)) as pilot:
        await _replayed(pilot)
        await pilot.press("7")
        await pilot.pause()
        assert app.main.active_view == "failslow"
        assert isinstance(app.focused, FailSlowPanel)
        view = app.state.failslow
        assert view is not None and view.verdict is not None and view.verdict.confident
        assert view.verdict.machine == "m2"
        summary = _text(app, "#fs-summary")
        assert "m2" in summary and "(confident)" in summary
        assert "slow for" in summary and "job time" not in summary
        slow_for = view.slow_for_s
        assert slow_for is not None and f"slow for {slow_for:.0f} s" in summary
        heat = _text(app, "#fs-heat")
        lines = {line.split()[0]: line for line in heat.splitlines()[1:5]}
        assert lines["m2"].rstrip().endswith("▲▲")
        assert all("▲" not in lines[m] for m in ("m0", "m1", "m3"))
        flags = _text(app, "#fs-flags")
        assert "● step_time" in flags and "m2" in flags
        assert "A=m2" in _text(app, "#fs-history")
        assert _text(app, "#fs-spark").splitlines()[1].startswith("m2")


async def test_healthy_series_shows_no_confident_flag() -> None:
    app = RankscopeApp(BundleSource(fs_bundle(slow=None), "bundle ok"), AppOptions())
    async with app.run_test(size=(120, 40)) as pilot:
        await _replayed(pilot)
        await pilot.press("7")
        await pilot.pause()
        view = app.state.failslow
        assert view is not None and view.verdict is not None and not view.verdict.confident
        summary = _text(app, "#fs-summary")
        assert summary.startswith("no fail-slow") and "slow for" not in summary
        assert "none: no detector flags a machine" in _text(app, "#fs-flags")
        rows = _text(app, "#fs-heat").splitlines()[1:-1]  # the last line is the legend
        assert len(rows) == 4 and all("▲" not in row and row.rstrip().endswith("■■") for row in rows)


async def test_ranks_whose_sampling_failed_are_named_with_the_fix() -> None:
    from rankscope.contract.snapshot import CaptureError, CaptureErrorKind, StackSampleWindow

    refused = CaptureError(CaptureErrorKind.PERMISSION, "ptrace refused", "run the agent as root")
    snaps = fs_series(12, slow=None)
    last = snaps[-1]
    m3 = replace(last.machines[3], samples=tuple(StackSampleWindow(r, 1000 + r, WALL0 + 8, WALL0 + 11, error=refused)
                                                 for r in (6, 7)))
    snaps[-1] = replace(last, machines=(*last.machines[:3], m3))
    app = RankscopeApp(BundleSource(Bundle(tuple(snaps), WALL0 + 12), "bundle sampling"), AppOptions())
    async with app.run_test(size=(120, 40)) as pilot:
        await _replayed(pilot)
        await pilot.press("7")
        await pilot.pause()
        summary = _text(app, "#fs-summary")
        assert "sampling failed on ranks 6-7: ptrace refused (and 1 more alike) (fix: run the agent as root)" in summary, \
            summary
        assert "step time" not in summary.split("\n", 2)[-1], "the trend note is not repeated under the job step"


async def test_live_polls_feed_the_detectors_until_the_slow_machine_is_named() -> None:
    snaps = fs_series(50)  # confident from about 40 s of the series on
    source = QueueSource("live", initial=snaps[:1])
    app = RankscopeApp(source, AppOptions(capture_on_start=False, poll_interval_s=0.0))
    async with app.run_test(size=(120, 40)) as pilot:
        await app.loaded.wait()
        await pilot.press("7")
        detector = app.failslow.tracker.detector
        for s in snaps[1:]:  # one poll at a time, each taken in before the next comes (none skipped)
            source.push_poll(s)
            for _ in range(500):
                await pilot.pause()
                if detector.latest is not None and detector.latest.at_mono == s.captured.mono:
                    break
            else:
                pytest.fail(f"poll at {s.captured.mono} never reached the detectors")
        await app.failslow.idle.wait()
        await pilot.pause()
        view = app.state.failslow
        # the first snapshot, alone at the start, is not judged (one point says nothing of slowness)
        assert view is not None and view.updates == 49 and view.skipped == 0
        assert view.verdict is not None and view.verdict.confident and view.verdict.machine == "m2"
        assert "slow for" in _text(app, "#fs-summary")
        # The job restarts (every rank under a new pid, as after an eviction or a hot-update): the detectors start
        # a new series, so the old verdict (an evicted machine's, above all) is not judged again on the new job.
        old_tracker = app.failslow.tracker
        last = fs_series(51)[-1]
        source.push_poll(replace(last, machines=tuple(
            replace(m, ranks=tuple(replace(r, pid=r.pid + 100_000) for r in m.ranks)) for m in last.machines)))
        for _ in range(500):
            await pilot.pause()
            if app.state.restarts == 1 and app.failslow.tracker is not old_tracker:
                break
        else:
            pytest.fail("the restart never reached the view")
        await app.failslow.idle.wait()
        await pilot.pause()
        assert st.slow_machines(app.state.failslow) == ()
        view = app.state.failslow
        # A new series of one snapshot (the restarted job's): no rounds of the old one, nobody named.
        assert view is not None and view.updates == 1 and len(view.rounds) <= 1
        assert view.verdict is None or (not view.verdict.verdict.suspects and not view.verdict.confident)


async def test_live_polls_that_pile_up_are_skipped_but_captures_never() -> None:
    """While the detectors work, only the newest of the waiting polls is taken in; captures all are."""
    snaps = fs_series(6)
    app = RankscopeApp(BundleSource(fs_bundle(2), "bundle"), AppOptions())
    async with app.run_test(size=(100, 30)):
        await app.loaded.wait()
        await app.failslow.idle.wait()
        feeder = app.failslow
        feeder.feed(snaps[2])
        feeder.feed(snaps[3])
        marker = object()  # stands for a capture's stack analysis
        feeder.feed(snaps[4], stack_analysis=marker)
        feeder.feed(snaps[5])
        kept = feeder._take()
        assert [s.captured.mono for s, _ in kept] == [MONO0 + 4, MONO0 + 5]
        assert kept[0][1] is marker and feeder.skipped == 2


async def test_a_one_snapshot_bundle_says_the_detectors_need_a_series() -> None:
    app = RankscopeApp(BundleSource(fs_bundle(1), "bundle one"), AppOptions())
    async with app.run_test(size=(120, 30)) as pilot:
        await _replayed(pilot)
        await pilot.press("7")
        await pilot.pause()
        assert app.state.failslow is None and app.failslow.tracker.detector.latest is None
        assert "need a series of snapshots" in _text(app, "#fs-summary")
        assert "no step times yet" in _text(app, "#fs-heat")


# ---- screenshots ------------------------------------------------------------------

SIZES = {"80x24": (80, 24), "160x48": (160, 48)}


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("series", ["slow", "healthy"])
def test_failslow_view_snapshot(snap_compare: Any, series: str, size: str) -> None:
    """The view after a replay; its times are the series' own, so the screen is the same on every run."""
    app = RankscopeApp(BundleSource(fs_bundle(slow="m2" if series == "slow" else None), f"bundle {series}"),
                       AppOptions())
    assert snap_compare(app, press=("7",), terminal_size=SIZES[size], run_before=_replayed)


def test_captures_analysed_by_the_tui_count_as_stack_rounds() -> None:
    """The StackView a capture produces is what the app hands the detectors: its verdict makes a stack round."""
    from rankscope.tui.analysis import build_stack_view
    from tui_bundles import FIG7_LAYOUT, T0, job

    tracker = FailSlowTracker()
    for i in range(6):
        snap = job(T0 + 10 * i, stacks=True, step=100 + i, hung=True)
        view = tracker.feed_series([(snap, build_stack_view(snap, FIG7_LAYOUT))])
    stack_flags = [f for f in view.verdict.flags if f.detector == "stacks"] if view.verdict else []
    assert stack_flags, [r.flags for r in view.rounds]
    assert set(stack_flags[0].ranks) <= set(range(24, 32))
    assert any(d == "stacks" for r in view.rounds for d, _, _ in r.flags)
    stacks_row = next(line for line in history_text(view.rounds, 40).plain.splitlines() if line.startswith("stacks"))
    assert set(stacks_row.split()[1]) - {"·"}, stacks_row  # the rounds that flagged a machine show its letter


def test_during_a_hang_the_step_figures_say_they_are_the_time_since_the_last_step() -> None:
    # "the figures below are of the steps before it" stood over "job step 67.7 s": the hang's age.
    from rankscope.tui.widgets.failslow import summary_text

    tracker = FailSlowTracker()
    view = tracker.feed_series((s, None) for s in fs_series(20))
    assert view.job_step_s is not None
    hung = summary_text(view, "HUNG since 12:00:00").plain
    assert "the step times below are the time since each rank's last step" in hung
    assert f"time since the last step {view.job_step_s:.3g} s" in hung and "job step" not in hung
    assert "steps before it" not in hung
    assert f"job step {view.job_step_s:.3g} s" in summary_text(view).plain
    # The heat map's column says so too: "machine-1 1.00 67.7" stood under "step".
    assert heat_text(view, 80, 10, (), hung=True).plain.splitlines()[0].split()[:3] == ["machine", "×med", "stuck"]
    assert heat_text(view, 80, 10, ()).plain.splitlines()[0].split()[:3] == ["machine", "×med", "step"]


def test_a_suspect_whose_step_is_the_jobs_says_why() -> None:
    """Synchronous training: the slow machine's step is every rank's. "slow: machine-2" stood beside
    "machine-2 ×med 0.98" with no word on why."""
    from rankscope.tui.failslow_state import EMPTY, HeatRow

    rows = tuple(HeatRow(f"machine-{i}", (2 * i, 2 * i + 1), (0.98, 0.99), 0.98 + 0.01 * i, 1.2, True)
                 for i in range(4))
    plain = heat_text(replace(EMPTY, heat=rows), 80, 10, ("machine-2",)).plain
    assert plain.splitlines()[-1].startswith("machine-2: its step takes as long as every rank's")
    assert "who arrives last and who is waited on" in " ".join(plain.split())
    assert "its step takes" not in heat_text(replace(EMPTY, heat=rows), 80, 10, ()).plain
    slow = tuple(replace(h, ratio=1.5) if h.machine == "machine-2" else h for h in rows)
    assert "its step takes" not in heat_text(replace(EMPTY, heat=slow), 80, 10, ("machine-2",)).plain
