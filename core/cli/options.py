"""Option groups more than one verb takes, each defined once: the parallel layout and the fail-slow detectors' knobs.

Registering them imports nothing heavy (``rankscope agent`` builds the same
parser on a training node): the layout and the detectors' config are made
only when a verb runs.
"""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING

from rankscope.contract.errors import RankscopeError
from rankscope.contract.snapshot import DEFAULT_ORDER, DIM_WORDS, Layout

if TYPE_CHECKING:
    from rankscope.analyzers.failslow_config import FailSlowConfig

_SIZES = (*Layout.SIZES, "ranks_per_machine")
LAYOUT_FIX = "pass sizes whose product is the job's world size, e.g. --tp 2 --pp 4 --dp 4, and --order tp-pp-dp"


def add_layout_args(p: argparse.ArgumentParser, title: str = "parallel layout (to name parallel groups)") -> None:
    """--tp/--pp/--dp/--cp/--ep, --order and --ranks-per-machine; ``layout_from_args`` reads them."""
    lay = p.add_argument_group(title)
    for dim in Layout.SIZES:
        lay.add_argument(f"--{dim}", type=int, metavar="N", help=f"{DIM_WORDS[dim]}-parallel size (default 1)")
    lay.add_argument("--order", help=f"rank order, fastest-varying first: {DEFAULT_ORDER} (Megatron's default), "
                                     "tp-cp-ep-pp-dp, tp-pp-dp, ...")
    lay.add_argument("--ranks-per-machine", type=int, metavar="N", help="consecutive ranks per machine")


def layout_from_args(args: argparse.Namespace, base: Layout | None = None) -> Layout | None:
    """The layout typed on the command line over ``base`` (a bundle's recorded one; None: the defaults), or
    ``base`` when none of these options is given. A size below 1 is refused with the fix."""
    keys = (*_SIZES, "order")
    given = {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}
    if not given:
        return base
    start = base if base is not None else Layout()
    fields = {k: getattr(start, k) for k in keys}
    fields.update(given)
    layout = Layout(**fields)
    problems = layout.size_problems(lambda k: f"--{k.replace('_', '-')}")
    if problems:
        raise RankscopeError(problems, LAYOUT_FIX)
    return layout


def add_failslow_args(p: argparse.ArgumentParser) -> None:
    """Aegis' window, Minder's continuity and ByteRobust's rounds; unset ones are the detectors' own defaults
    (``FailSlowConfig``, drill-sized), read by ``failslow_config``."""
    p.add_argument("--window", type=float, metavar="S",
                   help="fail-slow: Aegis window T in seconds (default: the detectors' config, drill-sized; "
                        "production uses 600)")
    p.add_argument("--continuity", type=float, metavar="S",
                   help="fail-slow: Minder continuity in seconds (default: the detectors' config, drill-sized; "
                        "production uses 240)")
    p.add_argument("--rounds", type=int, metavar="N",
                   help="fail-slow: stack rounds before naming the degrader (default: the detectors' config)")


def failslow_config(args: argparse.Namespace) -> FailSlowConfig:
    """The detectors' config from --window/--continuity/--rounds, each left out read from ``FailSlowConfig``."""
    from rankscope.analyzers.failslow_config import FailSlowConfig, config_for

    default = FailSlowConfig()
    window = default.window_s if args.window is None else args.window
    continuity = default.continuity_s if args.continuity is None else args.continuity
    rounds = default.rounds_needed if args.rounds is None else args.rounds
    if window <= 0 or continuity <= 0 or rounds < 1:
        raise RankscopeError("--window and --continuity must be positive and --rounds at least 1",
                             "e.g. --window 30 --continuity 20 --rounds 5 (production: 600, 240, 5)")
    return config_for(window, continuity, rounds)


def seconds(text: str) -> float:
    """An argparse type for a number of seconds: finite and above 0 (nan would make a loop never end or spin)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds; fix: give a number, e.g. 2 or 0.5") \
            from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0 (nor are nan and inf); "
                                         "fix: give a positive number, e.g. 2 or 0.5")
    return value


def job_users(names: list[str]) -> frozenset[int]:
    """The uids of ``--job-user`` names or numbers (empty: none given); an unknown user is refused with the fix."""
    import pwd

    uids: set[int] = set()
    for name in names:
        if name.isdigit():
            uids.add(int(name))
            continue
        try:
            uids.add(pwd.getpwnam(name).pw_uid)
        except KeyError:
            raise RankscopeError(f"--job-user {name!r} is no user on this machine",
                                 "give the job's user name or uid (see `id`)") from None
    return frozenset(uids)
