"""Fan-out at scale: N real agent servers over synthetic ranks, the client timed beside the code before #16.

    python benchmarks/bench_fanout.py [--sizes 16,64,256,2048] [--base-max 256] [--ranks-per-machine 8]
                                      [--processes 8] [--relay-fanout 0] [--bundle] [--captures 1]

For each N, starts N real gRPC agent servers (``rankscope.wire.agent.start_agent``)
spread over ``--processes`` processes, each serving ``--ranks-per-machine``
synthetic ranks of one job (benchmarks/fanout_source.py: ~40-frame stacks,
two subprocesses per rank, six communicators per rank with the world group
among them). Then, in a fresh client process each (so its peak RSS is its own):

- ``new``: this checkout (compact wire form, compiled decoder);
- ``base``: the code at ``--base-ref`` (default: where this branch started,
  ``git merge-base HEAD main``), unpacked into a temporary folder, agents and
  client both, for N up to ``--base-max`` (the code before #16 needs minutes
  and gigabytes beyond that);

and prints, per N: capture wall and client CPU seconds (a capture after a
poll that opens the channels; with ``--captures N``, N captures one after
another, each whole, the median one and every one's CPU in order), client peak RSS, bytes of the
replies (a capture, a whole poll, a steady poll: a delta against the last
one where the code has deltas), the wall time of the first poll after the
capture (sent whole) and the wall and client CPU time of a steady poll
cycle of the unchanged job (median of 3), and beside it ``bare cpu``: the
client CPU of the same poll's gRPC calls made bare (replies not decoded),
the least any direct poll from one Python process costs.
``--hung``: the agents read the same ranks and counters every time, as in a
hung job, so a capture after a poll is a delta whose only new part is the
stacks (the incident case); by default every reading differs from the last
(a job whose every counter moved), so a capture is decoded whole.
``--relay-fanout K`` (new, and a base from after #15): agents relay in groups of K, the client
talks to N/K relays. ``--bundle``: at the largest N, also write the capture
as a bundle and time opening it (beside the same capture as a version-3
bundle, whose number columns are JSON lists) and ``rankscope analyze`` on it.

The machine's load average is printed with the figures: on a shared machine
they move with it.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
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
from base_code import BASE_NAMES, REPO, base_root, same_names  # noqa: E402 (the benchmarks folder is not a package)

TOKEN = "b" * 32


# ---- the base code (before #16) --------------------------------------------------------------


def use_impl(impl: str, base: str | None) -> None:
    if impl == "base":
        assert base is not None
        sys.path.insert(0, base)
        if not same_names(base):
            # The base's modules under this checkout's names, so the code below imports one set of names. (Looking
            # them up by the new names would not fail: the editable install's finder serves this checkout's.)
            for name, base_name in BASE_NAMES.items():
                sys.modules[name] = importlib.import_module(base_name)
    sys.path.insert(0, str(HERE))  # fanout_source


# ---- agent servers (one process serves many) --------------------------------------------------


async def serve_many(args: argparse.Namespace) -> None:
    use_impl(args.impl, args.base)
    import fanout_source
    from rankscope.wire.agent import AgentConfig, start_agent
    from rankscope.wire.tokens import parse_tokens

    agent_mod = importlib.import_module("rankscope.wire.agent")  # (not `import a.b as m`: it walks the attributes)

    tokens = parse_tokens(f"read:{TOKEN}\n", "bench")
    world = args.world
    cache: dict[tuple[int, bool, int], Any] = {}
    turns: dict[int, int] = {}

    def source_for(index: int) -> Any:
        async def read(stacks: bool) -> Any:
            # A hung job reads the same ranks and counters every time (a capture adds only the stacks);
            # otherwise every capture differs from the last (two readings taken apart, in turn), as in a job whose
            # every counter moved. Polls read one reading each time (their steady cycle is the delta case).
            turn = 0
            if stacks and not args.hung:
                turn = turns[index] = turns.get(index, -1) + 1
            key = (index, stacks, turn % 2)
            if key not in cache:
                now = started if args.hung else time.time() + turn
                cache[key] = fanout_source.machine(index, args.ranks_per_machine, world, stacks=stacks, now=now)
            return cache[key]

        return read

    started = time.time()
    relays = json.loads(args.relays) if args.relays else {}
    agents = []
    for index in range(args.first, args.first + args.count):
        config = AgentConfig(tokens=tokens, port=0, machine_name=f"node{index:05d}",
                             relay_to=tuple(relays.get(str(index), ())), relay_token=TOKEN) \
            if relays else AgentConfig(tokens=tokens, port=0, machine_name=f"node{index:05d}")
        if args.impl == "base":
            # The base agent has no source hook: its capture is replaced by the same synthetic reading.
            read = source_for(index)

            async def capture(self: Any, *, stacks: bool, _read: Any = read, **_: Any) -> Any:
                return await _read(stacks)

            service_cls = type(f"BenchService{index}", (agent_mod.AgentService,), {"capture": capture})
            original = agent_mod.AgentService
            agent_mod.AgentService = service_cls  # type: ignore[misc]
            try:
                running = await start_agent(config)
            finally:
                agent_mod.AgentService = original  # type: ignore[misc]
        else:
            running = await start_agent(config, source=source_for(index))
        if running.watcher is not None:
            running.watcher.cancel()  # no background readings: they would only add noise to the figures
        agents.append(running)
    print(json.dumps([a.address for a in agents]), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes stdin
    for a in agents:
        await a.stop(0)


class Servers:
    """``count`` agents in ``processes`` processes; addresses in agent order."""

    def __init__(self, impl: str, base: str | None, count: int, processes: int, ranks: int,
                 relays: dict[int, list[str]] | None = None, first: int = 0, world: int | None = None,
                 hung: bool = False) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        per = -(-count // processes)
        for start in range(first, first + count, per):
            n = min(per, first + count - start)
            cmd = [sys.executable, __file__, "serve", "--impl", impl, "--first", str(start), "--count", str(n),
                   "--ranks-per-machine", str(ranks), "--world", str(world or count * ranks)]
            if base:
                cmd += ["--base-pkg", base]
            if hung:
                cmd.append("--hung")
            if relays:
                cmd += ["--relays", json.dumps({str(k): v for k, v in relays.items() if start <= k < start + n})]
            self.procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        self.addresses: list[str] = []
        for p in self.procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            if not line:
                raise SystemExit("an agent process failed to start")
            self.addresses += json.loads(line)

    def stop(self) -> None:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.close()
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()


# ---- the client, in a process of its own -------------------------------------------------------


def client(args: argparse.Namespace) -> None:
    use_impl(args.impl, args.base)
    try:
        from rankscope.contract.heap import settle_in_this_process
    except ImportError:  # a base from before it
        pass
    else:
        settle_in_this_process()  # as `rankscope snapshot` and the TUI run
    from rankscope.wire.client import JobClient
    from rankscope.wire.proto import rankscope_pb2 as pb
    from rankscope.wire.proto import rankscope_pb2_grpc as pb_grpc

    agents = json.loads(Path(args.agents_file).read_text())
    out: dict[str, Any] = {}

    async def go() -> Any:
        async with JobClient(agents, TOKEN, deadline_s=args.deadline) as c:
            await c.poll()  # opens the channels
            captures = []
            for _ in range(args.captures):  # each one whole unless --hung (the agents read anew each time)
                cpu0, t0 = time.process_time(), time.perf_counter()
                snap = await c.capture()
                captures.append((time.process_time() - cpu0, time.perf_counter() - t0))
            out["capture_cpus_s"] = [cpu for cpu, _ in captures]  # in order: the first one is made cold
            out["capture_cpu_s"], out["capture_wall_s"] = sorted(captures)[len(captures) // 2]
            out["answered"] = sum(1 for m in snap.machines if m.reachable)
            out["machines"] = len(snap.machines)
            out["ranks"] = len(snap.all_stacks())
            t0 = time.perf_counter()
            await c.poll()  # what the capture held is not what a poll reads: this one is sent whole
            out["poll_first_s"] = time.perf_counter() - t0
            polls = []
            for _ in range(3):  # a steady poll of a job whose state did not change (deltas, where the code has them)
                cpu0, t0 = time.process_time(), time.perf_counter()
                await c.poll()
                polls.append((time.perf_counter() - t0, time.process_time() - cpu0))
            out["poll_wall_s"], out["poll_cpu_s"] = sorted(polls)[1]
            return snap

    asyncio.run(_keep(go()))
    snap = _RESULT.pop()
    import rankscope

    out["code"] = str(Path(rankscope.__file__).parent)
    out["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.bundle:
        from rankscope.contract.bundle import Bundle, read_bundle, write_bundle

        path = Path(args.bundle)
        cpu0, t0 = time.process_time(), time.perf_counter()
        write_bundle(Bundle(snapshots=(snap,), created_wall=time.time()), path)
        out["bundle_write_s"], out["bundle_write_cpu_s"] = time.perf_counter() - t0, time.process_time() - cpu0
        out["bundle_mb"] = path.stat().st_size / 1e6
        # The same capture as version 3 (number columns as JSON lists), opened beside it as the baseline.
        from rankscope.contract.bundle import dumps

        old = path.with_name(path.stem + ".v3.json")
        old.write_text(dumps(Bundle(snapshots=(snap,), created_wall=time.time()), version=3))
        out["bundle_v3_mb"] = old.stat().st_size / 1e6
        del snap
        cpu0, t0 = time.process_time(), time.perf_counter()
        read_bundle(path)
        out["bundle_open_s"], out["bundle_open_cpu_s"] = time.perf_counter() - t0, time.process_time() - cpu0
        cpu0 = time.process_time()
        read_bundle(old)
        out["bundle_v3_open_cpu_s"] = time.process_time() - cpu0
        old.unlink()
    else:
        del snap

    deltas = "version" in pb.MachineSnapshot.DESCRIPTOR.fields_by_name

    async def wire() -> tuple[int, int, int]:
        """Bytes of one capture's, one whole poll's and one steady (delta) poll's replies, read raw (not timed)."""
        import grpc

        gate = asyncio.Semaphore(64)
        md = (("authorization", f"Bearer {TOKEN}"),)

        async def one(address: str) -> tuple[int, int, int]:
            async with gate, grpc.aio.insecure_channel(
                    address, options=[("grpc.max_receive_message_length", 1 << 30)]) as ch:
                stub = pb_grpc.RankscopeAgentStub(ch)
                capture = await stub.Capture(pb.CaptureRequest(subprocesses=True, timeout_s=5), metadata=md)
                poll = await stub.Describe(pb.DescribeRequest(), metadata=md)
                # A relay is asked with the versions of its children too, as the client asks it.
                steady = await stub.Describe(
                    pb.DescribeRequest(since=poll.version,
                                       relayed_since={c.address: c.version for c in poll.relayed if c.HasField("version")}),
                    metadata=md) if deltas else poll
                return capture.ByteSize(), poll.ByteSize(), steady.ByteSize()

        sizes = await asyncio.gather(*(one(a) for a in agents))
        return sum(c for c, _, _ in sizes), sum(p for _, p, _ in sizes), sum(d for _, _, d in sizes)

    out["capture_bytes"], out["poll_bytes"], out["steady_poll_bytes"] = asyncio.run(wire())

    async def floor() -> float:
        """Client CPU of one steady poll's calls made bare (same channels kept open, replies not decoded),
        median of 3: what gRPC itself costs this process, the least a direct poll can cost."""
        import grpc

        md = (("authorization", f"Bearer {TOKEN}"),)
        channels = [grpc.aio.insecure_channel(a, options=[("grpc.max_receive_message_length", 1 << 30)])
                    for a in agents]
        stubs = [pb_grpc.RankscopeAgentStub(ch) for ch in channels]
        gate = asyncio.Semaphore(256)

        async def one(stub: Any, since: int | None) -> Any:
            async with gate:
                request = pb.DescribeRequest(since=since) if since is not None else pb.DescribeRequest()
                return await stub.Describe(request, metadata=md, timeout=args.deadline)

        whole = await asyncio.gather(*(one(s, None) for s in stubs))
        cpus = []
        for _ in range(3):
            cpu0 = time.process_time()
            await asyncio.gather(*(one(s, w.version if deltas else None) for s, w in zip(stubs, whole, strict=True)))
            cpus.append(time.process_time() - cpu0)
        for ch in channels:
            await ch.close()
        return sorted(cpus)[1]

    out["floor_poll_cpu_s"] = asyncio.run(floor())
    print(json.dumps(out), flush=True)


async def _keep(coro: Any) -> None:
    """Runs ``coro`` and keeps its result out of asyncio.run's return path (see rankscope.wire.client.capture_once)."""
    _RESULT.append(await coro)


_RESULT: list[Any] = []


def run_client(impl: str, base: str | None, agents: list[str], bundle: Path | None, deadline: float,
               captures: int = 1) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(agents, f)
    cmd = [sys.executable, __file__, "client", "--impl", impl, "--agents-file", f.name, "--deadline", str(deadline),
           "--captures", str(captures)]
    if base:
        cmd += ["--base-pkg", base]
    if bundle:
        cmd += ["--bundle", str(bundle)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    os.unlink(f.name)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


# ---- the driver -----------------------------------------------------------------------------


def measure(impl: str, base: str | None, n: int, args: argparse.Namespace, bundle: Path | None) -> dict[str, Any]:
    ranks = args.ranks_per_machine
    relay_k = args.relay_fanout if impl == "new" or (base is not None and same_names(base)) else 0
    if relay_k and n > relay_k:
        leaves = Servers(impl, base, n - n // relay_k, args.processes, ranks, first=n // relay_k, world=n * ranks,
                         hung=args.hung)
        groups: dict[int, list[str]] = {i: [] for i in range(n // relay_k)}
        for j, address in enumerate(leaves.addresses):
            groups[j % len(groups)].append(address)
        relays = Servers(impl, base, len(groups), min(args.processes, len(groups)), ranks, relays=groups, first=0,
                         world=n * ranks, hung=args.hung)
        servers = [leaves, relays]
        addresses = relays.addresses
    else:
        s = Servers(impl, base, n, args.processes, ranks, hung=args.hung)
        servers, addresses = [s], s.addresses
    try:
        result = run_client(impl, base, addresses, bundle, args.deadline, args.captures)
    finally:
        for s in reversed(servers):  # relays first: a leaf gone before its relay only adds noise to the log
            s.stop()
    if bundle is not None and "error" not in result:
        t0 = time.perf_counter()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        rc = subprocess.run([str(Path(sys.executable).parent / "rankscope"), "analyze", str(bundle)],
                            capture_output=True, text=True, check=False).returncode
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        result["analyze_s"] = time.perf_counter() - t0
        result["analyze_cpu_s"] = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        result["analyze_rc"] = rc
    result["load_avg"] = os.getloadavg()[0]
    return result


def row(impl: str, n: int, ranks: int, r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{impl:<5} {n:>6} {n * ranks:>7}  failed: {r['error']}"
    extra = ""
    if "bundle_open_s" in r:
        nan = float("nan")
        extra = (f"  bundle {r['bundle_mb']:.0f} MB: write {r['bundle_write_s']:.2f} s "
                 f"(cpu {r.get('bundle_write_cpu_s', nan):.2f}), open {r['bundle_open_s']:.2f} s "
                 f"(cpu {r.get('bundle_open_cpu_s', nan):.2f}; as version 3: {r.get('bundle_v3_mb', nan):.0f} MB, "
                 f"open cpu {r.get('bundle_v3_open_cpu_s', nan):.2f}), analyze {r.get('analyze_s', nan):.2f} s "
                 f"(cpu {r.get('analyze_cpu_s', nan):.2f}, rc {r.get('analyze_rc')})")
    return (f"{impl:<5} {n:>6} {n * ranks:>7} {r['answered']:>5}/{r['machines']:<5} {r['capture_wall_s']:>8.2f} "
            f"{r['capture_cpu_s']:>8.2f} {r['rss_mb']:>8.0f} {r['capture_bytes'] / 1e6:>9.1f} "
            f"{r['poll_bytes'] / 1e6:>8.2f} {r['steady_poll_bytes'] / 1e6:>8.2f} {r['poll_first_s']:>8.3f} "
            f"{r['poll_wall_s']:>8.3f} {r['poll_cpu_s']:>8.3f} {r.get('floor_poll_cpu_s', float('nan')):>8.3f} "
            f"{r['load_avg']:>6.1f}{extra}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    sub = ap.add_subparsers(dest="cmd")
    s = sub.add_parser("serve")
    s.add_argument("--impl", default="new")
    s.add_argument("--base-pkg", dest="base")
    s.add_argument("--first", type=int, required=True)
    s.add_argument("--count", type=int, required=True)
    s.add_argument("--ranks-per-machine", type=int, default=8)
    s.add_argument("--world", type=int, required=True)
    s.add_argument("--hung", action="store_true")
    s.add_argument("--relays")
    c = sub.add_parser("client")
    c.add_argument("--impl", default="new")
    c.add_argument("--base-pkg", dest="base")
    c.add_argument("--agents-file", required=True)
    c.add_argument("--bundle")
    c.add_argument("--deadline", type=float, default=120.0)
    c.add_argument("--captures", type=int, default=1)
    ap.add_argument("--sizes", default="16,64,256")
    ap.add_argument("--base-max", type=int, default=256, help="largest N to run the base code at")
    ap.add_argument("--base-ref", default="", help="git ref of the base code (default: merge-base of HEAD and main)")
    ap.add_argument("--ranks-per-machine", type=int, default=8)
    ap.add_argument("--processes", type=int, default=8, help="processes the agent servers are spread over")
    ap.add_argument("--relay-fanout", type=int, default=0, help="new code: agents relay in groups of this many")
    ap.add_argument("--bundle", action="store_true", help="at the largest N: bundle write/open and analyze times")
    ap.add_argument("--hung", action="store_true",
                    help="a hung job: polls and captures read the same ranks and counters, a capture adds only the "
                         "stacks (the incident case); default: every reading differs from the last")
    ap.add_argument("--keep-bundle", action="store_true",
                    help="leave that bundle in the temp folder (to profile `rankscope analyze` on it)")
    ap.add_argument("--deadline", type=float, default=300.0)
    ap.add_argument("--captures", type=int, default=1,
                    help="captures per client, one after another (the figures: the median one; its CPU range "
                         "printed after the row)")
    args = ap.parse_args()
    if args.cmd == "serve":
        asyncio.run(serve_many(args))
        return 0
    if args.cmd == "client":
        client(args)
        return 0

    sizes = [int(x) for x in args.sizes.split(",")]
    ref = args.base_ref or subprocess.run(["git", "-C", str(REPO), "merge-base", "HEAD", "main"], capture_output=True,
                                          text=True, check=True).stdout.strip()
    base = str(base_root(ref)) if args.base_max > 0 else None
    print(f"machine: {os.cpu_count()} CPUs, python {sys.version.split()[0]}; base = {ref[:12]}; "
          f"{args.ranks_per_machine} ranks per agent; relay fan-out {args.relay_fanout or 'none'}; "
          f"{'a hung job (captures add only stacks)' if args.hung else 'every reading changes'}", flush=True)
    print(f"{'impl':<5} {'agents':>6} {'ranks':>7} {'answered':>11} {'wall s':>8} {'cpu s':>8} {'rss MB':>8} "
          f"{'capt MB':>9} {'poll MB':>8} {'Δpoll MB':>8} {'poll1 s':>8} {'poll s':>8} {'poll cpu':>8} {'bare cpu':>8} "
          f"{'load':>6}",
          flush=True)
    results: dict[tuple[str, int], dict[str, Any]] = {}
    for n in sizes:
        impls = ["base", "new"] if base and n <= args.base_max else ["new"]
        for impl in impls:
            bundle = Path(tempfile.gettempdir()) / f"bench-fanout-{impl}-{n}.json" \
                if args.bundle and n == max(sizes) else None
            results[impl, n] = r = measure(impl, base, n, args, bundle)
            print(row(impl, n, args.ranks_per_machine, r), flush=True)
            if len(r.get("capture_cpus_s", ())) > 1:
                cpus = r["capture_cpus_s"]
                print(f"      {len(cpus)} captures, client cpu in order: {', '.join(f'{c:.2f}' for c in cpus)} s "
                      f"(median {r['capture_cpu_s']:.2f}; the first with nothing interned yet)", flush=True)
            if bundle is not None and args.keep_bundle:
                print(f"      bundle kept: {bundle}", flush=True)
            elif bundle is not None:
                bundle.unlink(missing_ok=True)
        b, w = results.get(("base", n)), results.get(("new", n))
        if b and w and "error" not in b and "error" not in w:
            print(f"      ratio base/new at {n}: wall {b['capture_wall_s'] / w['capture_wall_s']:.1f}x, "
                  f"cpu {b['capture_cpu_s'] / w['capture_cpu_s']:.1f}x, rss {b['rss_mb'] / w['rss_mb']:.1f}x, "
                  f"bytes {b['capture_bytes'] / w['capture_bytes']:.1f}x, "
                  f"poll {b['poll_wall_s'] / w['poll_wall_s']:.1f}x", flush=True)
    news = sorted((n, r) for (impl, n), r in results.items() if impl == "new" and "error" not in r)
    if len(news) >= 2:
        (n0, r0), (n1, r1) = news[-2], news[-1]
        target = 100_000 / args.ranks_per_machine
        for key in ("capture_wall_s", "capture_cpu_s", "rss_mb", "poll_wall_s", "poll_cpu_s"):
            slope = (r1[key] - r0[key]) / (n1 - n0)
            print(f"projection, linear from N={n0} and N={n1}, 100,000 ranks ({target:.0f} agents): "
                  f"{key} ~ {r1[key] + slope * (target - n1):.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
