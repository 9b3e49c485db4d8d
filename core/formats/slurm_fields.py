"""Slurm's one-line records: ``scontrol show <entity> -o`` output read into a dict.

Read by the agents started inside a Slurm job (``rankscope.wire.slurm``) and by
the Slurm eviction backend (``rankscope.actions.evict_backends``), which sit in
different layers; the format lives here, below both.
"""

from __future__ import annotations

import re


def parse_fields(text: str) -> dict[str, str]:
    """``scontrol show -o`` output (``Key=Value Key2=Value two ...``) -> a dict.

    A value may contain spaces (``Command=``, ``Reason=``): it runs up to the
    next `` Key=``. Keys repeat in a few records; the first one wins.
    """
    out: dict[str, str] = {}
    matches = list(re.finditer(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=", text))
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        out.setdefault(m.group(1), text[m.end():end].strip())
    return out
