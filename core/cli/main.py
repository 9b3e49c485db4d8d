"""The one `rankscope` command and its verbs.

Each verb lives in its own module under ``rankscope.cli.commands`` and exposes
``register(subparsers)``; that module imports its heavy dependencies (grpc,
textual, torch) only inside the function that runs the verb, so
``rankscope agent`` on a training node never imports textual and
``rankscope analyze`` never starts gRPC.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from rankscope import __version__
from rankscope.contract.errors import RankscopeError

# Verb name -> module in rankscope.cli.commands. Order is the order of --help.
VERBS: tuple[tuple[str, str], ...] = (
    ("agent", "agent"),
    ("snapshot", "snapshot"),
    ("analyze", "analyze"),
    ("attach", "attach"),
    ("drill", "drill"),
    ("run", "run"),
    ("watch", "watch"),
    ("backup-plan", "backup_plan"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rankscope",
        description="Find the rank, group and machines behind a hung or slow distributed training job.",
    )
    parser.add_argument("--version", action="version", version=f"rankscope {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    for _verb, module in VERBS:
        mod = importlib.import_module(f"rankscope.cli.commands.{module}")
        mod.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except RankscopeError as exc:
        if getattr(args, "json", False):
            # A script asked for JSON: its error is JSON too, on stdout where it reads the answer.
            import json

            print(json.dumps({"error": {"verb": args.verb, "message": exc.message, "fix": exc.fix}}))
            return 2
        print(f"rankscope {args.verb}: error: {exc.message}", file=sys.stderr)
        if exc.fix:
            print(f"  fix: {exc.fix}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"rankscope {args.verb}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
