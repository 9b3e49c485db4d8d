"""`rankscope backup-plan`: not built yet."""

from __future__ import annotations

import argparse
from typing import Any

from rankscope.errors import RankscopeError


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("backup-plan", help="(not built yet)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    raise RankscopeError("'rankscope backup-plan' is not built yet", "see README.md for what works today")
