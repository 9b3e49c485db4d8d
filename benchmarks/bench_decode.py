"""The client's decoding of a whole capture, beside another commit's code, run for run, with nothing else on the cores.

    python benchmarks/bench_decode.py [--machines 2048] [--relay-fanout 32] [--base-ref c36dcd6] [--runs 5]

bench_fanout.py times the client among thousands of agent servers that share
its two cores, so its figures move with them. This one isolates what the
client itself does with the replies: in a fresh process per run (alternating
this checkout and ``--base-ref``, each side encoding with its own agent code),
``--machines`` synthetic machines (benchmarks/fanout_source.py: 8 ranks each,
~40-frame stacks, two subprocesses per rank, six communicators per rank) are
encoded as their agents would send them (compact form, grouped into replies
of ``--relay-fanout`` machines as relays forward them) and serialized; then
timed, in CPU seconds with the cyclic collector paused as the client pauses it:
parsing every reply (protobuf) and decoding it into contract objects
(``machines_from_proto``), the first time in the process (nothing interned
yet: ``rankscope snapshot``) and again (the TUI's next capture). Prints each
side's min and median and the ratio of the medians, and the bytes of the replies.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from base_code import base_tree  # noqa: E402 (the benchmarks folder is not a package)
from bench_bundle import _child, _env  # noqa: E402 (the benchmarks folder is not a package)

# Run in the child, from that side's tree: encode, serialize, then time parse + decode twice.
_DECODE = """
import gc, sys, time
sys.path.insert(0, sys.argv[3])
import fanout_source
from rankscope.wire.proto import rankscope_pb2 as pb
try:
    from rankscope.wire.snapshot_codec import machine_to_proto, machines_from_proto
except ImportError:  # a baseline tree from before the codec was split by role
    from rankscope.wire.proto_convert import machine_to_proto, machines_from_proto
n, k = int(sys.argv[1]), int(sys.argv[2])
now = time.time()
replies = []
for first in range(0, n, k):
    top = None
    for i in range(first, min(n, first + k)):
        msg = machine_to_proto(fanout_source.machine(i, 8, n * 8, stacks=True, now=now + i))
        msg.address = f"node{i:05d}:50051"
        if top is None:
            top = msg
        else:
            top.relayed.append(msg)
    replies.append(top.SerializeToString())
gc.collect()
gc.disable()
cpus = []
for _ in range(2):
    t = time.process_time()
    machines = [m for r in replies for m in machines_from_proto(pb.MachineSnapshot.FromString(r))]
    cpus.append(time.process_time() - t)
    assert len(machines) == n
    del machines
print(cpus[0], cpus[1], sum(map(len, replies)))
"""


def _stats(values: list[float]) -> str:
    return f"min {min(values):5.2f}  median {statistics.median(values):5.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--machines", type=int, default=2048)
    ap.add_argument("--relay-fanout", type=int, default=32, help="machines per reply (1: every agent asked directly)")
    ap.add_argument("--base-ref", default="HEAD~1", help="the commit to compare with (default: HEAD~1)")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    sides = {"new": _env(None), "base": _env(base_tree(args.base_ref))}
    argv = [str(args.machines), str(max(1, args.relay_fanout)), str(HERE)]
    cold: dict[str, list[float]] = {s: [] for s in sides}
    warm: dict[str, list[float]] = {s: [] for s in sides}
    size: dict[str, int] = {}
    for _ in range(args.runs):
        for side, env in sides.items():
            first, again, nbytes = _child(_DECODE, argv, env)[2].split()
            cold[side].append(float(first))
            warm[side].append(float(again))
            size[side] = int(nbytes)
    print(f"{args.machines} machines ({args.machines * 8} ranks) in replies of {args.relay_fanout}; base "
          f"{args.base_ref}; {args.runs} runs each, alternating; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    for side in sides:
        print(f"{side:<5} parse + decode cpu: first {_stats(cold[side])}   again {_stats(warm[side])}   "
              f"replies {size[side] / 1e6:.1f} MB")
    print(f"base / new (medians): first {statistics.median(cold['base']) / statistics.median(cold['new']):.2f}x, "
          f"again {statistics.median(warm['base']) / statistics.median(warm['new']):.2f}x, "
          f"bytes {size['base'] / size['new']:.2f}x")
    print(json.dumps({"first_cpu_s": cold, "again_cpu_s": warm, "reply_bytes": size}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
