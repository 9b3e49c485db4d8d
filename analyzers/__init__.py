"""Pure analyses over snapshots: no I/O, no clock, standard library and numpy only.

The same functions serve the live TUI, the headless CLI, bundle replays and the tests.
"""
