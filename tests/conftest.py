"""Fixtures shared by the test files in unit/, integration/ and tui/ (pytest finds them here; import nothing from this file).

A test file goes to ``unit/`` when none of its tests starts a process or opens a socket, to ``integration/`` when
one does (agents, py-spy, torch jobs, drills, Slurm, git, compilers, ruff and mypy, fresh interpreters), and to
``tui/`` when it tests the Textual app (state, pilot, SVG snapshots, tmux). Helpers that tests of several folders
import (``agent_helpers``, ``stack_fixtures``, ``repo_paths``, ...) live here in tests/, which pytest puts on the path.
"""

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
