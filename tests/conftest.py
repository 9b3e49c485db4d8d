"""Fixtures shared by the test files (pytest finds them here; import nothing from this file)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_helpers import Processes


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    """Processes a test starts (agents, fake ranks), all stopped when it ends, pass or fail."""
    p = Processes(tmp_path)
    try:
        yield p
    finally:
        p.close()
