"""ruff and mypy must be clean; a finding fails the suite."""

from __future__ import annotations

import subprocess
import sys

from repo_paths import ROOT


def test_ruff_and_mypy_are_clean() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "static_checks.py")],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
