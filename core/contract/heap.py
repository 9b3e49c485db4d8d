"""The cyclic garbage collector around work that makes hundreds of thousands of long-lived objects and no cycles.

A capture or a bundle of 16,384 ranks is ~400,000 frozen contract objects. Made
with the collector running, they were walked again and again as they piled up
(a third of the time it took to read them); and once it ran again, their number
(more than a quarter of what it tracked) made its next collection walk every
object of the process: 0.25 s after every capture at 16,384 ranks, a second in
a TUI holding several. So the work runs with the collector paused
(``collector_paused``), and a process that is rankscope's own (the TUI,
``rankscope snapshot``: ``settle_in_this_process``) then sets what lives aside
(``gc.freeze``): reference counting still frees it, the collector no longer
walks it. A process that embeds rankscope (the tests) does not: there it would
keep that process's cyclic garbage for as long as the process lives.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_PAUSED = [0, False]  # pauses under way (fan-outs overlap); whether the collector ran before the first
_SETTLES = [False]  # set by settle_in_this_process
_PAUSING = threading.Lock()  # the TUI pauses in its analysis worker while its fan-out pauses in the event loop


def settle_in_this_process(on: bool = True) -> None:
    """Whether ``settle`` (and the end of every pause) sets what lives aside, for the rest of this process."""
    _SETTLES[0] = on


def settle() -> None:
    """Set everything alive now aside from the cyclic collector, in a process that asked for it."""
    if _SETTLES[0]:
        gc.freeze()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic collection inside; overlapping pauses share one, and the last to end restores the collector as
    the first found it (settling first, so no collection runs between the end and the settling)."""
    with _PAUSING:
        if _PAUSED[0] == 0:
            _PAUSED[1] = gc.isenabled()
            gc.disable()
        _PAUSED[0] += 1
    try:
        yield
    finally:
        with _PAUSING:
            _PAUSED[0] -= 1
            if _PAUSED[0] == 0 and _PAUSED[1]:
                settle()
                gc.enable()
