"""How the TUI copes with 16,384 ranks on 2,048 machines: `python benchmarks/bench_tui.py`.

Builds and writes (untimed) a bundle of 16,384 ranks (8 per machine, one
machine's ranks stuck elsewhere, one GPU running hot), opens the file in the
real app headless at 160x48, as `rankscope attach --bundle` does, and measures:
- the opening (read, decode, digest, stack analysis: all off the UI thread);
- one refresh per view: folding a new poll into the state and redrawing the
  visible view, until the screen is painted (``Pilot.pause`` runs the
  compositor), median and worst of several;
- a filter (`/node1733`, `/irecv`) applied and drawn;
- a page of scrolling in the rank map;
- the process's resident memory (RSS) after everything.

The same figures for the 32-rank Fig. 7 bundle are printed beside them as the
baseline, with the ratio, so a regression that only shows at scale stands out.
Goals from the issue: a refresh under 50 ms, RSS under 300 MB.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from rankscope.contract.bundle import Bundle, write_bundle
from rankscope.contract.heap import settle_in_this_process
from rankscope.contract.snapshot import JobSnapshot
from rankscope.tui import digest as dg
from rankscope.tui import state as st
from rankscope.tui.app import AppOptions, RankscopeApp
from rankscope.tui.sources import BundleSource
from tui_bundles import big_job, fig7_bundle

VIEWS = (("overview", "1"), ("stacks", "2"), ("ccl", "3"), ("metrics", "4"), ("events", "5"))


def bump(snap: JobSnapshot, seconds: float) -> JobSnapshot:
    """The same job a little later: a new poll without stacks (what arrives every second)."""
    when = dataclasses.replace(snap.captured, wall=snap.captured.wall + seconds, mono=snap.captured.mono + seconds)
    machines = tuple(dataclasses.replace(m, stacks=(), captured=when) for m in snap.machines)
    return dataclasses.replace(snap, captured=when, machines=machines)


def ms(xs: list[float]) -> str:
    return f"median {statistics.median(xs) * 1000:7.1f} ms  worst {max(xs) * 1000:7.1f} ms"


async def measure(path: Path, filters: tuple[str, ...], rounds: int) -> dict[str, Any]:
    """Open the bundle file as `rankscope attach --bundle` does, then refresh, filter and scroll."""
    out: dict[str, Any] = {}
    source = BundleSource(label=path.name, path=path)
    settle_in_this_process()  # as `rankscope attach` runs
    app = RankscopeApp(source, AppOptions(capture_on_start=False))
    t0 = time.perf_counter()
    async with app.run_test(size=(160, 48)) as pilot:
        await app.loaded.wait()
        await pilot.pause()
        out["load"] = time.perf_counter() - t0
        snap = app.state.kept[-1]
        polls = [await asyncio.to_thread(dg.digest, bump(snap, 1.0 + i)) for i in range(2)]
        for view, key in VIEWS:
            await pilot.press(key)
            await pilot.pause()
            times, ours = [], []
            for i in range(rounds):
                d = polls[i % 2]
                t = time.perf_counter()
                app.state = st.apply_poll(app.state, d, d.wall)
                app.redraw()
                ours.append(time.perf_counter() - t)
                await pilot.pause()
                times.append(time.perf_counter() - t)
            out[f"refresh {view}"] = times
            out[f"  state+redraw {view}"] = ours
        await pilot.press("1")
        await pilot.pause()
        for text in filters:
            times = []
            for _ in range(max(3, rounds // 3)):
                t = time.perf_counter()
                app.set_filter(text)
                await pilot.pause()
                times.append(time.perf_counter() - t)
                app.set_filter("")
                await pilot.pause()
            out[f"filter '{text}'"] = times
        app.main.query_one("#rank-map").focus()
        times = []
        for _ in range(rounds):
            t = time.perf_counter()
            await pilot.press("pagedown")
            times.append(time.perf_counter() - t)
        out["scroll (page down)"] = times
        gc.collect()
        out["rss_mb"] = psutil.Process().memory_info().rss / 2**20
    return out


def measure_in_child(path: Path, machine_filter: str, rounds: int) -> dict[str, Any]:
    """Measure in a fresh interpreter, so its memory is the TUI's and not the bundle builder's."""
    proc = subprocess.run([sys.executable, __file__, "--measure", str(path), "--filter", machine_filter,
                           "--rounds", str(rounds)], capture_output=True, text=True, check=False, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"measuring {path.name} failed:\n{proc.stderr}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--machines", type=int, default=2048)
    parser.add_argument("--ranks-per-machine", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)  # child mode: one bundle, JSON out
    parser.add_argument("--filter", default="node15", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure is not None:
        print(json.dumps(asyncio.run(measure(args.measure, (args.filter, "irecv"), args.rounds))))
        return 0

    rss0 = psutil.Process().memory_info().rss / 2**20
    with tempfile.TemporaryDirectory(prefix="bench-tui-") as tmp:
        small = write_bundle(fig7_bundle(), Path(tmp) / "fig7.json")
        t = time.perf_counter()
        big_path = write_bundle(Bundle((big_job(args.machines, args.ranks_per_machine),), 0.0), Path(tmp) / "big.json")
        built = time.perf_counter() - t
        size_mb = big_path.stat().st_size / 2**20
        base = measure_in_child(small, "node15", args.rounds)
        big = measure_in_child(big_path, "node1733", args.rounds)
    world = args.machines * args.ranks_per_machine

    print(f"rankscope TUI benchmark: {world:,} ranks on {args.machines:,} machines vs 32 ranks (Fig. 7), 160x48")
    load = os.getloadavg()
    print(f"  python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {load[0]:.1f} "
          f"(other work on the machine inflates every figure)")
    print(f"  the {size_mb:.0f} MB bundle was built and written in {built:.1f} s (untimed)")
    print("  'refresh' = fold a new poll into the state, redraw the view and paint the screen (Pilot.pause);")
    print("  'state+redraw' = the app's own part of it, before Textual composes and paints")
    print(f"  open the bundle file (read + decode + digest + analysis, all off the UI thread, which shows"
          f" 'loading'): {big['load']:.2f} s   baseline {base['load']:.2f} s")
    keys = [k for k in big if k not in ("load", "rss_mb")]
    for k in keys:
        b, s = big[k], base[k.replace("node1733", "node15")] if "node1733" in k else base[k]
        ratio = statistics.median(b) / max(1e-9, statistics.median(s))
        print(f"  {k:<22} {ms(b)}   baseline {statistics.median(s) * 1000:6.1f} ms   x{ratio:5.1f}")
    refresh = [x for k in keys if k.startswith("refresh") for x in big[k]]
    ours = [x for k in keys if k.startswith("  state+redraw") for x in big[k]]
    print(f"  refresh, all views:    {ms(refresh)}   goal < 50 ms")
    print(f"  state+redraw, all:     {ms(ours)}")
    print(f"  resident memory of the TUI process: {big['rss_mb']:.0f} MB with the big bundle open, "
          f"{base['rss_mb']:.0f} MB with the small one (goal < 300 MB; the parent, same imports, started at {rss0:.0f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
