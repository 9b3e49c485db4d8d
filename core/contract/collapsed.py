"""py-spy's raw samples (``py-spy record --format raw --threads``) read as counts of what the main thread did.

The agent's sampler reads each window with ``parse_collapsed`` and ships the
counts (``StackSampleWindow``); the sampled-wait detector
(``analyzers.stack_samples``) judges them. Stdlib only.
"""

from __future__ import annotations

from rankscope.contract.frames import CLASSES, classify


def parse_collapsed(text: str, pid: int) -> dict[str, int]:
    """Class counts of the main thread's samples in ``py-spy record --format raw --threads`` output.

    Each line is ``thread (TID): NAME;outer frame;...;inner frame COUNT`` (``thread (TID);frames COUNT`` for a
    thread without a name, such as autograd's device threads on a GPU job); the
    main thread is the one whose TID is the process id (or, where py-spy
    prints Python thread ids, the one named MainThread). Raises ValueError
    naming the line for anything else, so a changed format is noticed, not
    silently counted as nothing.
    """
    counts = dict.fromkeys(CLASSES, 0)
    by_tid: dict[str, dict[str, int]] = {}
    names: dict[str, str] = {}
    for i, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        stack, sep, count_text = line.rpartition(" ")
        if not sep or not count_text.isdigit() or not stack.startswith("thread ("):
            raise ValueError(f"line {i} is not 'thread (TID): frames COUNT': {line[:80]!r}")
        close = stack.find(")")
        tid, rest = stack[len("thread ("):close], stack[close + 1:]
        if close < 0 or not tid.isdigit():
            raise ValueError(f"line {i} has no thread id: {line[:80]!r}")
        if rest.startswith(": "):  # a named thread: its name, then its frames
            frames = rest[2:].split(";")
        elif rest.startswith(";"):  # a thread without a name (autograd's device threads on a GPU job)
            frames = ["", *rest[1:].split(";")]
        elif not rest:  # a thread py-spy caught with no Python frames at all
            frames = [""]
        else:
            raise ValueError(f"line {i} is not 'thread (TID): frames COUNT': {line[:80]!r}")
        names.setdefault(tid, frames[0])
        per = by_tid.setdefault(tid, dict.fromkeys(CLASSES, 0))
        per[classify(frames[:0:-1])] += int(count_text)  # innermost first, the thread name left out
    main = str(pid) if str(pid) in by_tid else next((t for t, n in names.items() if n == "MainThread"), None)
    if main is not None:
        counts = by_tid[main]
    return counts


__all__ = ["parse_collapsed"]
