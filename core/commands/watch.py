"""`rankscope watch`: not built yet."""

from __future__ import annotations

import argparse
from typing import Any

from rankscope.errors import RankscopeError


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("watch", help="(not built yet)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    raise RankscopeError("'rankscope watch' is not built yet", "see README.md for what works today")
