"""`rankscope attach`: the live TUI on a job's agents, or a saved bundle offline.

    rankscope attach --agents 'node[01-16]:50051' --token-file ~/.rankscope/token --tp 2 --pp 4 --dp 4
    rankscope attach --hostfile agents.txt --read-only
    rankscope attach --bundle incident.json
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rankscope.errors import RankscopeError


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "attach", help="inspect a job live in the terminal UI (or a saved bundle with --bundle)",
        description="Attach the terminal UI to a job's agents, or open a saved bundle offline with the same views.",
    )
    src = p.add_argument_group("what to open")
    src.add_argument("--agents", help="comma-separated host:port list, Slurm-style range (node[01-16]:50051) or @hostfile")
    src.add_argument("--hostfile", type=Path, help="file with one agent (host:port or range) per line")
    src.add_argument("--port", type=int, default=None, help="port for entries written without one")
    src.add_argument("--bundle", type=Path, help="open a saved bundle or recorded series offline")
    p.add_argument("--token-file", type=Path, help="file with the token to send; default: $RANKSCOPE_TOKEN")
    p.add_argument("--read-only", action="store_true", help="no actions that change the job (evict, update, backup)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between polls of metrics and counters (default 1)")
    p.add_argument("--deadline", type=float, default=5.0, help="seconds each agent has to answer (default 5)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds each py-spy call may take (default 5)")
    p.add_argument("--native", action="store_true", help="include native frames in stack captures")
    p.add_argument("--hang-after", type=float, default=30.0,
                   help="capture stacks automatically when progress stops this long (default 30 s)")
    p.add_argument("--fail-slow", action="store_true", help="capture stacks every 10 s (fail-slow rounds)")
    p.add_argument("--window", type=float, default=30.0,
                   help="fail-slow: Aegis window T in seconds (default 30; production uses 600)")
    p.add_argument("--continuity", type=float, default=20.0,
                   help="fail-slow: Minder continuity in seconds (default 20; production uses 240)")
    p.add_argument("--rounds", type=int, default=5, help="fail-slow: stack rounds before naming the degrader (default 5)")
    p.add_argument("--no-initial-capture", action="store_true", help="do not capture stacks on attach")
    p.add_argument("--bundle-dir", type=Path, default=Path("."), help="where `w` writes bundles (default: here)")
    p.add_argument("--tp", type=int, help="tensor-parallel size (to name parallel groups)")
    p.add_argument("--pp", type=int, help="pipeline-parallel size")
    p.add_argument("--dp", type=int, help="data-parallel size")
    p.add_argument("--order", default="tp-cp-ep-dp-pp", help="rank order of the parallel dimensions")
    p.add_argument("--ranks-per-machine", type=int, help="ranks on each machine")
    p.set_defaults(func=run)


def _layout(args: argparse.Namespace) -> Any:
    from rankscope.snapshot import Layout

    if not any(x is not None for x in (args.tp, args.pp, args.dp, args.ranks_per_machine)):
        return None
    return Layout(tp=args.tp or 1, pp=args.pp or 1, dp=args.dp or 1, order=args.order,
                  ranks_per_machine=args.ranks_per_machine)


def run(args: argparse.Namespace) -> int:
    try:
        from rankscope.tui import app as tui_app
    except ImportError as exc:
        raise RankscopeError(f"the terminal UI is not installed ({exc})", "pip install 'rankscope[tui]'") from None
    layout = _layout(args)
    if args.window <= 0 or args.continuity <= 0 or args.rounds < 1:
        raise RankscopeError("--window and --continuity must be positive and --rounds at least 1",
                             "e.g. --window 30 --continuity 20 --rounds 5 (production: 600, 240, 5)")
    from rankscope.analyzers.failslow import config_for

    options: dict[str, Any] = {
        "poll_interval_s": args.interval, "hang_after_s": args.hang_after, "fail_slow": args.fail_slow,
        "capture_on_start": not args.no_initial_capture, "bundle_dir": args.bundle_dir,
        "failslow_config": config_for(args.window, args.continuity, args.rounds),
    }
    if args.bundle is not None:
        if args.agents or args.hostfile:
            raise RankscopeError("--bundle opens a saved file; it cannot be combined with --agents/--hostfile",
                                 "drop --bundle to attach live, or drop --agents to open the bundle")
        return tui_app.run_bundle(args.bundle, layout=layout, read_only=args.read_only, **options)
    from rankscope.agents_spec import resolve_agents
    from rankscope.tokens import load_client_token

    agents = resolve_agents(args.agents, args.hostfile, default_port=args.port)
    if args.hostfile is not None:
        from rankscope.agents_spec import hostfile_members

        # Followed while attached: agents added to it are asked, ones marked evicted are shown as such.
        options["hostfile"] = args.hostfile
        options["evicted"] = hostfile_members(args.hostfile, default_port=args.port)[1]
    if not agents:
        raise RankscopeError("no agents given", "pass --agents host:port[,...], --hostfile FILE, or --bundle FILE")
    if args.read_only:
        token = load_client_token(args.token_file)
    else:
        # A session that may act sends a token of the 'act' role; with only a read token it still
        # attaches, and the action keys say why they cannot act instead of failing at the agents.
        from rankscope.tokens import Role

        try:
            token = load_client_token(args.token_file, role=Role.ACT)
        except RankscopeError as exc:
            token = load_client_token(args.token_file)
            options["act_problem"] = (exc.message, exc.fix)
    return tui_app.run_attach(agents, token, layout=layout, read_only=args.read_only, deadline_s=args.deadline,
                              capture_timeout_s=args.timeout, native=args.native, **options)
