"""What a log file's name says: the rank it belongs to (``rank3.log``, ``rank_12.txt``, ``train-rank7.out``)."""

from __future__ import annotations

import re

_RANK_FILE = re.compile(r"(?:^|[^a-z])rank[_-]?(\d+)(?:[^0-9]|$)", re.IGNORECASE)


def file_rank(name: str) -> int | None:
    """The rank a file's name gives, or None."""
    m = _RANK_FILE.search(name.rsplit(".", 1)[0])
    return int(m.group(1)) if m else None
