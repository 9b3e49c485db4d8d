"""Read what a headless Textual app shows, as plain text lines (for pilot assertions)."""

from __future__ import annotations

from textual.app import App


def screen_text(app: App[object]) -> str:
    strips = app.screen._compositor.render_strips()
    return "\n".join(strip.text for strip in strips)
