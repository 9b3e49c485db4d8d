"""Errors that carry their fix.

Every failure a person can act on is raised as a ``RankscopeError`` whose
``fix`` says what to run or change. The CLI prints message and fix and exits
with status 2; the TUI shows them in its error view. Nothing else should
reach a user as a traceback.
"""

from __future__ import annotations


class RankscopeError(Exception):
    """A failure with a human-readable message and the fix for it."""

    def __init__(self, message: str, fix: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix

    def __str__(self) -> str:
        return self.message if not self.fix else f"{self.message} (fix: {self.fix})"
