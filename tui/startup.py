"""Start-up classification: whether a rank's stack shows its process still starting (importing, at rendezvous).

Such a stack is no steady state to compare with the others': the digest
counts its rank as starting, and a capture of it names no suspect.
"""

from __future__ import annotations

from rankscope.contract.snapshot import RankStacks, main_thread

# Where a rank's main thread is while its process is still starting: importing modules, or meeting the others.
_STARTUP_FILES = ("<frozen importlib",)
_STARTUP_FUNCTIONS = frozenset({"init_process_group", "rendezvous", "_store_based_barrier", "next_rendezvous",
                                "_rendezvous_helper", "_create_tcp_store", "_init_process_group_helper"})


def starting_stack(stacks: RankStacks) -> bool:
    """Whether a rank's stack shows it still starting (not a steady state to compare with the others')."""
    main = main_thread(stacks.main)
    if main is None:
        return False
    return any(f.filename.startswith(_STARTUP_FILES) or f.name in _STARTUP_FUNCTIONS for f in main.frames)


def importing_stack(stacks: RankStacks) -> bool:
    """Whether a rank's main thread is importing modules (starting, however long imports take on a loaded host)."""
    threads = stacks.main.threads or ()
    main = next((t for t in threads if t.thread_name == "MainThread"), threads[0] if threads else None)
    return main is not None and any(f.filename.startswith(_STARTUP_FILES) for f in main.frames)
