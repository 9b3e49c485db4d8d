"""The TUI's screens: the main views, one rank's stack, the help."""
