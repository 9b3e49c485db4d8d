"""`rankscope snapshot`: one capture of every agent, saved as a bundle."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from rankscope.cli.commands.target import add_slurm_args, add_tls_args, open_target

if TYPE_CHECKING:
    from rankscope.contract.snapshot import JobSnapshot

DESCRIPTION = """\
Ask every agent for a capture at once (each with its own deadline) and save
the result as a bundle for `rankscope analyze`, `rankscope attach --bundle` or
a ticket. An agent that cannot be reached is reported and marked in the bundle;
the others are still captured.

Agents: --agents host:port,host2:port, Slurm ranges such as
'node[01-04,07]:50051' or '127.0.0.1:[50051-50054]', @FILE, or --hostfile FILE;
or --slurm JOBID: agents started inside the running job for this capture
only (over TLS, with a token made for it) and stopped afterwards.
Exit status: 0 when every agent answered, 1 when some did not (the bundle is
written anyway), 2 on bad input.
"""


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "snapshot", help="capture stacks, metrics and counters from all agents into a bundle",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--agents", help="comma-separated host:port list, Slurm range or @hostfile")
    p.add_argument("--hostfile", type=Path, help="file with one agent (host:port or range) per line")
    p.add_argument("--port", type=int, default=None,
                   help="port for entries written without one (default: a port is required in each entry)")
    p.add_argument("--token-file", type=Path, help="file with the token to send; default: $RANKSCOPE_TOKEN")
    p.add_argument("--deadline", type=float, default=10.0, help="seconds each agent has to answer (default 10)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds each py-spy call may take on the agent (default 5)")
    p.add_argument("--native", action="store_true", help="include native (C/C++) frames in the stacks")
    p.add_argument("--no-subprocesses", action="store_true", help="skip the ranks' worker subprocesses")
    p.add_argument("-o", "--output", type=Path, help="write the bundle to this file")
    p.add_argument("--json", action="store_true", help="print the bundle as JSON on stdout (the summary goes to stderr)")
    add_tls_args(p)
    add_slurm_args(p)
    p.set_defaults(func=run)


def summary_lines(snap: JobSnapshot) -> list[str]:
    """What a person reads after a capture: who answered, who did not and why, what was captured."""
    from rankscope.contract.ranks import compact_ranks

    lines: list[str] = []
    reachable = [m for m in snap.machines if m.reachable]
    lines.append(f"machines: {len(reachable)} of {len(snap.machines)} answered")
    for m in snap.machines:
        if m.reachable:
            stacks_ok = sum(1 for s in m.stacks if s.main.threads is not None)
            ranks = ",".join(str(r.rank) for r in sorted(m.ranks, key=lambda r: r.rank)) or "none"
            lines.append(f"  {m.machine} ({m.address}): ranks {ranks}; stacks {stacks_ok}/{len(m.stacks)}")
            for s in m.stacks:
                for proc in (s.main, *s.subprocesses):
                    if proc.error is not None:
                        lines.append(f"    rank {s.rank} pid {proc.pid} ({proc.role.value}): {proc.error.message}")
        else:
            err = m.error
            # The error's own first words say which failure it is (token refused, nothing listening, ...).
            lines.append(f"  {m.address}: {err.message if err else 'no answer, no reason recorded'}")
            if err and err.fix:
                lines.append(f"    fix: {err.fix}")
    world = snap.world_size
    seen = sorted(snap.rank_to_machine())
    if world is not None:
        missing = sorted(set(range(world)) - set(seen))
        lines.append(f"ranks: {len(seen)} of {world} seen" + (f"; missing {compact_ranks(missing)}" if missing else ""))
    else:
        lines.append(f"ranks: {len(seen)} seen")
    stacks = snap.all_stacks()
    failed = sorted(r for r, s in stacks.items() if s.main.threads is None)
    lines.append(f"stacks: {len(stacks) - len(failed)} captured, {len(failed)} failed"
                 + (f" (ranks {compact_ranks(failed)})" if failed else ""))
    return lines


def run(args: argparse.Namespace) -> int:
    from rankscope import __version__
    from rankscope.contract.bundle import Bundle, dumps, write_bundle
    from rankscope.contract.errors import RankscopeError
    from rankscope.contract.heap import settle_in_this_process
    from rankscope.wire.client import capture_once
    from rankscope.wire.slurm import missing_lines

    if args.deadline <= 0 or args.timeout <= 0:
        raise RankscopeError("--deadline and --timeout must be positive", "e.g. --deadline 10 --timeout 5")
    settle_in_this_process()  # the capture lives until the bundle is written: the collector need not walk it
    with open_target(args) as target:
        snap = capture_once(
            target.agents, target.token, deadline_s=args.deadline, tls=target.tls,
            native=args.native, subprocesses=not args.no_subprocesses, timeout_s=args.timeout,
        )
    agents, missing = target.agents, target.missing
    meta: dict[str, Any] = {"command": "snapshot", "rankscope_version": __version__, "agents": list(agents),
                            "deadline_s": args.deadline, "native": args.native}
    if target.slurm_job is not None:
        meta["slurm_job"] = target.slurm_job
        meta["slurm_nodes_without_agent"] = {m.node: m.reason for m in missing}
    bundle = Bundle(snapshots=(snap,), created_wall=time.time(), meta=meta)
    out: TextIO = sys.stderr if args.json else sys.stdout
    written: Path | None = None
    # Encoded once, for the file and for stdout alike (at 16k ranks a second, indented encoding cost a minute).
    text = dumps(bundle)
    if args.output is not None:
        written = write_bundle(bundle, args.output, text)
    elif not args.json:
        # Never throw a capture away: with neither -o nor --json, keep it in a file.
        written = write_bundle(bundle, Path(time.strftime("rankscope-snapshot-%Y%m%d-%H%M%S.json")), text)
    if args.json:
        sys.stdout.write(text)
        sys.stdout.write("\n")
    del text
    for line in summary_lines(snap) + missing_lines(missing):
        print(line, file=out)
    if written is not None:
        print(f"bundle written to {written}", file=out)
    return 0 if all(m.reachable for m in snap.machines) and not missing else 1
