"""The sparklines' history: the last ``HISTORY`` readings of many keys (machines, GPUs, communicators) as one array."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

HISTORY = 60  # points kept for sparklines (one per poll, about a minute at 1 Hz)


@dataclass(frozen=True, slots=True, eq=False)
class Series:
    """The last ``HISTORY`` readings of many keys (machines, GPUs, communicators) as one array.

    A 2,048-machine job has 16k GPU keys; one array shifted per poll costs a
    copy, where a tuple per key cost 16k Python objects a second. Each push
    returns a new Series, so older states stay valid (compared by identity).
    """

    keys: tuple[str, ...] = ()
    index: Mapping[str, int] = field(default_factory=dict)
    values: np.ndarray = field(default_factory=lambda: np.empty((0, HISTORY)))

    def get(self, key: str) -> tuple[float, ...]:
        i = self.index.get(key)
        if i is None:
            return ()
        row = self.values[i]
        return tuple(float(x) for x in row[~np.isnan(row)])

    def __contains__(self, key: str) -> bool:
        return key in self.index

    def pushed(self, keys_in: tuple[str, ...], readings: Sequence[float] | np.ndarray) -> Series:
        keys, index = self.keys, self.index
        values = self.values
        if keys_in is keys or keys_in == keys:  # the usual case: the same machines as last time, in the same order
            column = np.asarray(readings, dtype=float)
        else:
            new_keys = [k for k in keys_in if k not in index]
            if new_keys:
                keys = (*keys, *new_keys)
                index = {k: i for i, k in enumerate(keys)}
                values = np.vstack([values, np.full((len(new_keys), HISTORY), np.nan)])
            column = np.full(len(keys), np.nan)
            column[[index[k] for k in keys_in]] = readings
        shifted = np.empty_like(values)
        shifted[:, :-1] = values[:, 1:]
        shifted[:, -1] = column
        return Series(keys, index, shifted)
