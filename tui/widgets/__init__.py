"""The panels of the TUI; each draws from ``AppState`` and a ``Filter`` only."""
