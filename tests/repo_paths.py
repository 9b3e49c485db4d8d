"""Where the tests find things: the repository, the test data, and the read-only shared folder beside the checkout.

Tests live in tests/unit, tests/integration and tests/tui; they locate files
through these names, never through their own ``__file__``, so a test can move
between folders without its paths changing meaning.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
DATA = TESTS / "data"
JOBS = TESTS / "jobs"
FIG7 = DATA / "fig7"


def shared(*parts: str) -> Path | None:
    """``shared/<parts>`` if it exists: $RANKSCOPE_SHARED, or a ``shared`` folder beside the clone or its parent.

    The clone may be /work/main (shared/ beside it) or a worktree one level further down; CI sets the variable.
    """
    bases = [os.environ["RANKSCOPE_SHARED"]] if os.environ.get("RANKSCOPE_SHARED") else []
    bases += [str(p / "shared") for p in ROOT.parents]
    return next((Path(b).joinpath(*parts) for b in bases if Path(b).joinpath(*parts).exists()), None)


def external(*parts: str) -> Path | None:
    """A folder of public incident data: $RANKSCOPE_EXTERNAL, else ``shared/external``."""
    if os.environ.get("RANKSCOPE_EXTERNAL") and Path(os.environ["RANKSCOPE_EXTERNAL"], *parts).exists():
        return Path(os.environ["RANKSCOPE_EXTERNAL"], *parts)
    return shared("external", *parts)
