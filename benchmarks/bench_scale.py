"""The largest jobs: 12,500 agents of 8 ranks (100,000 ranks) through merging relays, beside 2,048 agents.

    python benchmarks/bench_scale.py [--sizes 2048,12500] [--relay-fanout 64] [--processes 16]
                                     [--forward-max 2048] [--tui] [--captures 1]

For each N, starts N real gRPC agent servers (``rankscope.wire.agent.start_agent``) spread over
``--processes`` processes, each answering with the synthetic reading of one machine of a hung
Megatron-like job (benchmarks/fanout_source.py, the same reading every time: a recorded capture),
and N / ``--relay-fanout`` relaying agents in front of them (bench_fanout.py's servers). Then, in a
fresh client process each (so its peak RSS is its own), it measures:

- ``first capture to a verdict``: client CPU of the first whole capture through the relays (after a
  poll that opens the channels) plus ``analyze_job`` on it, and the wall time of each;
- the client's peak RSS;
- a steady poll (median of 3, a delta of the unchanged job), wall and CPU;
- with ``--tui``: the capture written as a bundle and opened in the real TUI headless
  (benchmarks/bench_tui.py), the worst refresh over its views.

``merge``: the relays fold what they relay into one reply (``rankscope.wire.merge``); ``forward``
(the baseline, for N up to ``--forward-max``): each relayed reply forwarded as it came, as before.
``--offline``: the client's part alone, no gRPC: each relay's reply built (its fold timed) in one process
(``build``), then read, decoded (``HeldReadings.decode``, what the fan-out runs) and analysed in a fresh one
(``offline``), so the client's CPU and peak RSS are its own.
The last lines print how each figure grows from the smallest N to the largest. Figures only: the
agents share the machine's cores with the client, and its load average is printed beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_fanout import TOKEN, Servers  # noqa: E402  (this folder on sys.path first)


def client(args: argparse.Namespace) -> None:
    from rankscope.contract.heap import settle_in_this_process

    settle_in_this_process()  # as `rankscope snapshot` and the TUI run
    from rankscope.analyzers.analysis import analyze_job
    from rankscope.contract.heap import collector_paused
    from rankscope.wire.client import JobClient

    agents = json.loads(Path(args.agents_file).read_text())
    out: dict[str, Any] = {}
    kept: list[Any] = []

    async def go() -> None:
        async with JobClient(agents, TOKEN, deadline_s=args.deadline, merge=args.merge) as c:
            await c.poll()  # opens the channels
            cpu0, t0 = time.process_time(), time.perf_counter()
            snap = await c.capture()
            out["capture_cpu_s"], out["capture_wall_s"] = time.process_time() - cpu0, time.perf_counter() - t0
            cpu0, t0 = time.process_time(), time.perf_counter()
            with collector_paused():  # as `rankscope analyze` runs it
                analysis = analyze_job(snap)
            out["verdict_cpu_s"], out["verdict_wall_s"] = time.process_time() - cpu0, time.perf_counter() - t0
            out["verdict"] = analysis.verdict.summary
            out["answered"] = sum(1 for m in snap.machines if m.reachable)
            out["machines"] = len(snap.machines)
            out["ranks"] = sum(len(m.stacks) for m in snap.machines)
            await c.poll()  # what the capture held is not what a poll reads: this one is sent whole
            polls = []
            for _ in range(3):
                cpu0, t0 = time.process_time(), time.perf_counter()
                await c.poll()
                polls.append((time.perf_counter() - t0, time.process_time() - cpu0))
            out["poll_wall_s"], out["poll_cpu_s"] = sorted(polls)[1]
            kept.append(snap)

    asyncio.run(go())
    out["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.bundle:
        from rankscope.contract.bundle import Bundle, write_bundle

        write_bundle(Bundle(snapshots=(kept[0],), created_wall=time.time()), Path(args.bundle))
    print(json.dumps(out), flush=True)


def build(args: argparse.Namespace) -> None:
    """The relays' replies of a job of ``--agents`` machines, written to ``--replies`` (each as a 4-byte length and
    the serialised reply), built in a process of their own so the client's peak RSS is the client's alone."""
    import fanout_source
    from rankscope.wire.merge import fold
    from rankscope.wire.proto import rankscope_pb2 as pb
    from rankscope.wire.snapshot_codec import machine_to_proto

    n, k, ranks = args.agents, args.relay_fanout, args.ranks_per_machine
    relay_count = max(1, n // k)
    world = n * ranks
    fold_cpu: list[float] = []
    size = 0
    children: list[list[pb.MachineSnapshot]] = [[] for _ in range(relay_count)]
    for j in range(n - relay_count):
        index = relay_count + j
        children[j % relay_count].append(machine_to_proto(fanout_source.machine(index, ranks, world, stacks=True,
                                                                                 now=1.0)))
    with open(args.replies, "wb") as f:
        for r in range(relay_count):
            msg = machine_to_proto(fanout_source.machine(r, ranks, world, stacks=True, now=1.0))
            cpu0 = time.process_time()
            if args.merge:
                msg.merged.CopyFrom(fold(children[r], {}))
            else:
                msg.relayed.extend(children[r])
            fold_cpu.append(time.process_time() - cpu0)
            children[r] = []
            raw = msg.SerializeToString()
            size += len(raw)
            f.write(len(raw).to_bytes(4, "little") + raw)
    print(json.dumps({"relay_cpu_s": max(fold_cpu), "reply_mb": size / 1e6}), flush=True)


def offline(args: argparse.Namespace) -> None:
    """The client's side alone, without gRPC or agents: the relays' replies (``build``) read from a file, decoded as
    the fan-out decodes each reply (``HeldReadings.decode``) and analysed."""
    from rankscope.analyzers.analysis import analyze_job
    from rankscope.contract.heap import collector_paused, settle_in_this_process
    from rankscope.contract.snapshot import Instant, JobSnapshot
    from rankscope.wire.delta import HeldReadings
    from rankscope.wire.proto import rankscope_pb2 as pb

    settle_in_this_process()
    replies: list[bytes] = []
    with open(args.replies, "rb") as f:
        while head := f.read(4):
            replies.append(f.read(int.from_bytes(head, "little")))
    held = HeldReadings()
    out: dict[str, Any] = {}
    cpu0 = time.process_time()
    with collector_paused():
        machines = [m for i, raw in enumerate(replies)
                    for m in held.decode(pb.MachineSnapshot.FromString(raw), f"relay{i}")]
    snap = JobSnapshot(captured=Instant(1.0, 1.0), machines=tuple(machines))
    out["capture_cpu_s"] = time.process_time() - cpu0
    del replies
    cpu0 = time.process_time()
    with collector_paused():  # as `rankscope analyze` runs it
        out["verdict"] = analyze_job(snap).verdict.summary
    out["verdict_cpu_s"] = time.process_time() - cpu0
    out["machines"], out["ranks"] = len(snap.machines), sum(len(m.stacks) for m in snap.machines)
    out["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out), flush=True)


def measure_offline(n: int, merge: bool, args: argparse.Namespace) -> dict[str, Any]:
    shape = ["--agents", str(n), "--relay-fanout", str(args.relay_fanout), "--ranks-per-machine",
             str(args.ranks_per_machine)] + (["--merge"] if merge else [])
    with tempfile.TemporaryDirectory() as tmp:
        replies = str(Path(tmp) / "replies.bin")
        built = subprocess.run([sys.executable, __file__, "build", "--replies", replies, *shape], capture_output=True,
                               text=True, check=False)
        if built.returncode != 0:
            return {"error": _last_line(built.stderr) or f"build exit {built.returncode}"}
        proc = subprocess.run([sys.executable, __file__, "offline", "--replies", replies], capture_output=True,
                              text=True, check=False)
    if proc.returncode != 0:
        return {"error": _last_line(proc.stderr) or f"exit {proc.returncode}"}
    result: dict[str, Any] = json.loads(built.stdout.strip().splitlines()[-1])
    result.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    result["load_avg"] = os.getloadavg()[0]
    return result


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1] if text.strip() else ""


def offline_row(n: int, mode: str, r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{mode:<8} {n:>6}  failed: {r['error']}"
    return (f"{mode:<8} {n:>6} {r['ranks']:>7} {r['reply_mb']:>8.1f} {r['relay_cpu_s']:>8.3f} {r['capture_cpu_s']:>8.2f} "
            f"{r['verdict_cpu_s']:>8.2f} {r['rss_mb']:>7.0f} {r['load_avg']:>5.1f}   {r['verdict']}")


def measure(n: int, merge: bool, args: argparse.Namespace) -> dict[str, Any]:
    ranks, k = args.ranks_per_machine, args.relay_fanout
    t0 = time.perf_counter()
    relay_count = max(1, n // k)
    leaves = Servers("new", None, n - relay_count, args.processes, ranks, first=relay_count, world=n * ranks, hung=True)
    groups: dict[int, list[str]] = {i: [] for i in range(relay_count)}
    for j, address in enumerate(leaves.addresses):
        groups[j % relay_count].append(address)
    relays = Servers("new", None, relay_count, min(args.processes, relay_count), ranks, relays=groups, first=0,
                     world=n * ranks, hung=True)
    started_s = time.perf_counter() - t0
    bundle = Path(tempfile.gettempdir()) / f"bench-scale-{n}.json" if args.tui and merge else None
    try:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(relays.addresses, f)
        cmd = [sys.executable, __file__, "client", "--agents-file", f.name, "--deadline", str(args.deadline)]
        cmd += ["--merge"] if merge else []
        cmd += ["--bundle", str(bundle)] if bundle is not None else []
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        os.unlink(f.name)
    finally:
        relays.stop()
        leaves.stop()
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["started_s"] = started_s
    result["load_avg"] = os.getloadavg()[0]
    if bundle is not None:
        from bench_tui import measure_in_child

        tui = measure_in_child(bundle, "node00042", 3)
        refresh = [x for key, xs in tui.items() if key.startswith("refresh") for x in xs]
        result["tui_worst_ms"] = max(refresh) * 1000
        result["tui_open_s"] = tui["load"]
        result["tui_rss_mb"] = tui["rss_mb"]
        bundle.unlink(missing_ok=True)
    return result


FIGURES = (("first capture to a verdict, client cpu s", lambda r: r["capture_cpu_s"] + r["verdict_cpu_s"], 2.0),
           ("client peak RSS MB", lambda r: r["rss_mb"], 1024.0),
           ("steady poll wall s", lambda r: r["poll_wall_s"], 0.3),
           ("TUI worst view ms", lambda r: r.get("tui_worst_ms", float("nan")), 50.0))


def row(n: int, mode: str, ranks: int, r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{mode:<8} {n:>6} {n * ranks:>7}  failed: {r['error']}"
    return (f"{mode:<8} {n:>6} {r['ranks']:>7} {r['answered']:>6}/{r['machines']:<6} {r['capture_wall_s']:>7.2f} "
            f"{r['capture_cpu_s']:>7.2f} {r['verdict_cpu_s']:>7.2f} {r['rss_mb']:>7.0f} {r['poll_wall_s']:>7.3f} "
            f"{r['poll_cpu_s']:>7.3f} {r.get('tui_worst_ms', float('nan')):>7.1f} {r['load_avg']:>5.1f}"
            f"   {r['verdict']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    sub = ap.add_subparsers(dest="cmd")
    c = sub.add_parser("client")
    c.add_argument("--agents-file", required=True)
    c.add_argument("--deadline", type=float, default=300.0)
    c.add_argument("--merge", action="store_true")
    c.add_argument("--bundle")
    b = sub.add_parser("build")
    b.add_argument("--replies", required=True)
    b.add_argument("--agents", type=int, required=True)
    b.add_argument("--relay-fanout", type=int, default=64)
    b.add_argument("--ranks-per-machine", type=int, default=8)
    b.add_argument("--merge", action="store_true")
    o = sub.add_parser("offline")
    o.add_argument("--replies", required=True)
    ap.add_argument("--sizes", default="2048,12500")
    ap.add_argument("--ranks-per-machine", type=int, default=8)
    ap.add_argument("--relay-fanout", type=int, default=64)
    ap.add_argument("--processes", type=int, default=16, help="processes the agent servers are spread over")
    ap.add_argument("--forward-max", type=int, default=2048, help="largest N to run the forwarding baseline at")
    ap.add_argument("--tui", action="store_true", help="also open each merged capture in the TUI (bench_tui.py)")
    ap.add_argument("--deadline", type=float, default=300.0)
    ap.add_argument("--offline", action="store_true",
                    help="the client's decode and analysis alone, on relay replies built in process (no agents)")
    args = ap.parse_args()
    if args.cmd == "client":
        client(args)
        return 0
    if args.cmd == "build":
        build(args)
        return 0
    if args.cmd == "offline":
        offline(args)
        return 0
    sizes = [int(x) for x in args.sizes.split(",")]
    if args.offline:
        return main_offline(sizes, args)
    print(f"machine: {os.cpu_count()} CPUs, python {sys.version.split()[0]}; {args.ranks_per_machine} ranks per "
          f"agent; relays of {args.relay_fanout}; a hung job (the same reading each time); agents on the same cores",
          flush=True)
    print(f"{'mode':<8} {'agents':>6} {'ranks':>7} {'answered':>13} {'wall s':>7} {'cpu s':>7} {'verd s':>7} "
          f"{'rss MB':>7} {'poll s':>7} {'poll cpu':>7} {'tui ms':>7} {'load':>5}   verdict", flush=True)
    merged: dict[int, dict[str, Any]] = {}
    for n in sizes:
        modes = [("forward", False), ("merge", True)] if n <= args.forward_max else [("merge", True)]
        got: dict[str, dict[str, Any]] = {}
        for mode, merge in modes:
            got[mode] = r = measure(n, merge, args)
            print(row(n, mode, args.ranks_per_machine, r), flush=True)
        f, m = got.get("forward"), got["merge"]
        if f and "error" not in f and "error" not in m:
            print(f"      ratio forward/merge at {n}: capture cpu {f['capture_cpu_s'] / m['capture_cpu_s']:.2f}x, "
                  f"rss {f['rss_mb'] / m['rss_mb']:.2f}x, poll {f['poll_wall_s'] / m['poll_wall_s']:.2f}x", flush=True)
        if "error" not in m:
            merged[n] = m
    if len(merged) >= 2:
        (n0, r0), (n1, r1) = min(merged.items()), max(merged.items())
        for name, figure, goal in FIGURES:
            a, b = figure(r0), figure(r1)
            print(f"growth {n0} -> {n1} agents ({n1 / n0:.1f}x): {name} {a:.2f} -> {b:.2f} ({b / a:.1f}x); "
                  f"goal < {goal:g}: {'met' if b < goal else 'not met'}", flush=True)
    return 0


def main_offline(sizes: list[int], args: argparse.Namespace) -> int:
    print(f"machine: {os.cpu_count()} CPUs, python {sys.version.split()[0]}; {args.ranks_per_machine} ranks per "
          f"agent; relays of {args.relay_fanout}; the client's decode (HeldReadings.decode of each relay's reply) and "
          "analyze_job, in one process, no gRPC", flush=True)
    print(f"{'mode':<8} {'agents':>6} {'ranks':>7} {'reply MB':>8} {'relay s':>8} {'cpu s':>8} {'verd s':>8} "
          f"{'rss MB':>7} {'load':>5}   verdict", flush=True)
    merged: dict[int, dict[str, Any]] = {}
    for n in sizes:
        modes = [("forward", False), ("merge", True)] if n <= args.forward_max else [("merge", True)]
        got = {}
        for mode, merge in modes:
            got[mode] = r = measure_offline(n, merge, args)
            print(offline_row(n, mode, r), flush=True)
        f, m = got.get("forward"), got["merge"]
        if f and "error" not in f and "error" not in m:
            print(f"      ratio forward/merge at {n}: decode cpu {f['capture_cpu_s'] / m['capture_cpu_s']:.2f}x, "
                  f"bytes {f['reply_mb'] / m['reply_mb']:.2f}x, rss {f['rss_mb'] / m['rss_mb']:.2f}x", flush=True)
        if "error" not in m:
            merged[n] = m
    if len(merged) >= 2:
        (n0, r0), (n1, r1) = min(merged.items()), max(merged.items())
        for name, figure, goal in FIGURES[:2]:
            a, b = figure(r0), figure(r1)
            print(f"growth {n0} -> {n1} agents ({n1 / n0:.1f}x): {name} {a:.2f} -> {b:.2f} ({b / a:.1f}x); "
                  f"goal < {goal:g}: {'met' if b < goal else 'not met'}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
