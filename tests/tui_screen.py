"""Drive a headless Textual app: read what it shows as plain text lines, let it run until a condition holds."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from textual.app import App


def screen_text(app: App[object]) -> str:
    strips = app.screen._compositor.render_strips()
    return "\n".join(strip.text for strip in strips)


async def until(pilot: Any, cond: Callable[[], bool], timeout: float = 10.0, what: str = "the condition") -> None:
    """Let the app run until ``cond`` holds; fail naming what never happened at the deadline."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)
