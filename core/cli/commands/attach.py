"""`rankscope attach`: the live TUI on a job's agents, or a saved bundle offline.

    rankscope attach --agents 'node[01-16]:50051' --token-file ~/.rankscope/token --tp 2 --pp 4 --dp 4
    rankscope attach --hostfile agents.txt --read-only
    rankscope attach --bundle incident.json
    rankscope attach --slurm 12345 --tp 2 --pp 4
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rankscope.cli.commands.target import add_slurm_args, add_tls_args, open_target
from rankscope.cli.options import add_failslow_args, add_layout_args, failslow_config, layout_from_args, seconds
from rankscope.contract.errors import RankscopeError

if TYPE_CHECKING:
    from rankscope.contract.bundle import Bundle
    from rankscope.contract.snapshot import Layout


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "attach", help="inspect a job live in the terminal UI (or a saved bundle with --bundle)",
        description="Attach the terminal UI to a job's agents, or open a saved bundle offline with the same views.",
    )
    src = p.add_argument_group("what to open")
    src.add_argument("--agents", help="comma-separated host:port list, Slurm-style range (node[01-16]:50051) or @hostfile")
    src.add_argument("--hostfile", type=Path, help="file with one agent (host:port or range) per line")
    src.add_argument("--port", type=int, default=None, help="port for entries written without one")
    src.add_argument("--bundle", type=Path,
                     help="open a saved bundle or recorded series offline, or the py-spy dumps saved in an incident "
                          "(a folder of rank<R>.txt|json or per-node files, as `rankscope analyze DUMPS` reads them)")
    p.add_argument("--token-file", type=Path, help="file with the token to send; default: $RANKSCOPE_TOKEN")
    p.add_argument("--read-only", action="store_true", help="no actions that change the job (evict, update, backup)")
    p.add_argument("--interval", type=seconds, default=1.0, help="seconds between polls of metrics and counters (default 1)")
    p.add_argument("--deadline", type=float, default=5.0, help="seconds each agent has to answer (default 5)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds each py-spy call may take (default 5)")
    p.add_argument("--native", action="store_true", help="include native frames in stack captures")
    p.add_argument("--hang-after", type=float, default=30.0,
                   help="capture stacks automatically when progress stops this long (default 30 s)")
    p.add_argument("--fail-slow", action="store_true",
                   help="capture stacks every 10 s (fail-slow rounds) and sample every rank's main thread "
                        "--sample-hz times a second (the sampled-stack straggler test; no counters needed)")
    p.add_argument("--sample-hz", type=float, default=5.0,
                   help="fail-slow: non-blocking stack samples per second per rank (default 5; 0 turns them off)")
    add_failslow_args(p)
    p.add_argument("--no-initial-capture", action="store_true", help="do not capture stacks on attach")
    p.add_argument("--bundle-dir", type=Path, default=Path("."), help="where `w` writes bundles (default: here)")
    add_layout_args(p)
    p.add_argument("--slurm-state-dir", default="~/.rankscope/slurm/%j/%n",
                   help="with --slurm: where each node's agent keeps its audit log and blocklist "
                        "(%%j: job id, %%n: node; default ~/.rankscope/slurm/%%j/%%n)")
    p.add_argument("--standby-partition",
                   help="with --slurm: evicted nodes are replaced by idle nodes of this partition")
    p.add_argument("--standby-reservation",
                   help="with --slurm: evicted nodes are replaced by idle nodes of this reservation")
    add_tls_args(p)
    add_slurm_args(p)
    p.set_defaults(func=run)


def saved_dumps(path: Path, layout: Layout | None) -> Bundle | None:
    """py-spy dumps saved during an incident (a folder, or one pasted file) as a one-capture bundle; None for a
    bundle. An op trace or flight recorder dumps are refused with the command that reads them."""
    from rankscope.contract.bundle import Bundle
    from rankscope.formats import sniff
    from rankscope.formats.pyspy_dir import load_pyspy_dir

    kind = sniff.what_is(path, stacks_only=True)  # the dumps beside logs are shown; `rankscope analyze` reads both
    if kind == sniff.BUNDLE:
        return None
    if kind == sniff.FLIGHT_RECORDER_RANK:
        raise RankscopeError(f"{path} is one rank's PyTorch flight recorder dump, which the terminal UI does not show",
                             f"rankscope analyze {path.parent}")
    if kind != sniff.PYSPY:
        what = {sniff.OP_TRACE: "an op trace", sniff.LOGS: "NCCL/PyTorch logs"}.get(kind, "PyTorch flight recorder dumps")
        raise RankscopeError(f"{path} holds {what}, which the terminal UI does not show",
                             f"rankscope analyze {path}")
    snapshot = load_pyspy_dir(path, layout)
    return Bundle((snapshot,), created_wall=snapshot.captured.wall, meta={"source": "py-spy dumps", "path": str(path)})


def run(args: argparse.Namespace) -> int:
    try:
        from rankscope.tui import app as tui_app
    except ImportError as exc:
        raise RankscopeError(f"the terminal UI is not installed ({exc})", "pip install 'rankscope[tui]'") from None
    layout = layout_from_args(args)
    options = tui_app.AppOptions(
        poll_interval_s=args.interval, hang_after_s=args.hang_after, fail_slow=args.fail_slow,
        capture_on_start=not args.no_initial_capture, bundle_dir=args.bundle_dir, layout=layout,
        read_only=args.read_only, failslow_config=failslow_config(args))
    if args.bundle is not None:
        if args.agents or args.hostfile or args.slurm:
            raise RankscopeError("--bundle opens a saved file; it cannot be combined with --agents/--hostfile/--slurm",
                                 "drop --bundle to attach live, or drop --agents to open the bundle")
        dumps = saved_dumps(args.bundle, layout)
        if dumps is not None:
            return tui_app.run_loaded(dumps, f"dumps {args.bundle.name}", options)
        return tui_app.run_bundle(args.bundle, options)
    from rankscope.wire.tokens import Role

    reach = tui_app.AttachOptions(deadline_s=args.deadline, capture_timeout_s=args.timeout, native=args.native)
    if args.hostfile is not None:
        from rankscope.wire.agents_spec import hostfile_members

        # Followed while attached: agents added to it are asked, ones marked evicted are shown as such.
        hostfile = hostfile_members(args.hostfile, default_port=args.port)
        reach = replace(reach, hostfile=args.hostfile, evicted=tuple(hostfile.evicted),
                        machine_names=hostfile.names)
    role = Role.READ
    if not args.read_only and not args.slurm:
        # A session that may act sends a token of the 'act' role; with only a read token it still
        # attaches, and the action keys say why they cannot act instead of failing at the agents.
        from rankscope.wire.tokens import load_client_token

        try:
            load_client_token(args.token_file, role=Role.ACT)
            role = Role.ACT
        except RankscopeError as exc:
            reach = replace(reach, act_problem=(exc.message, exc.fix))
    if not 0 <= args.sample_hz <= 20:
        raise RankscopeError("--sample-hz must be between 0 (off) and 20", "e.g. --sample-hz 5")
    state_dir = None
    if args.slurm and not args.read_only:
        state_dir = str(args.slurm_state_dir).replace("%j", str(args.slurm))
        if state_dir.startswith("~"):
            state_dir = str(Path(state_dir).expanduser())
    extra: list[str] = []
    if args.standby_partition:
        extra += ["--slurm-standby-partition", args.standby_partition]
    if args.standby_reservation:
        extra += ["--slurm-standby-reservation", args.standby_reservation]
    with open_target(args, role=role, state_dir=state_dir, agent_args=extra, follow=True) as target:
        if target.hostfile is not None:
            reach = replace(reach, hostfile=target.hostfile)  # the agents of the job's new nodes after a requeue
        if not target.agents:
            raise RankscopeError("no agents given", "pass --agents host:port[,...], --hostfile FILE, or --bundle FILE")
        from rankscope.wire.slurm import missing_lines

        for line in missing_lines(target.missing):
            print(f"rankscope attach: {line.strip()}", file=sys.stderr)
        reach = replace(reach, tls=target.tls, sample_hz=args.sample_hz if args.fail_slow else 0.0)
        return tui_app.run_attach(target.agents, target.token, options, reach)
