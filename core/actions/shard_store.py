"""An agent's store of checkpoint shards: in memory and on local disk, each with its checksum (ByteRobust §6.3).

Every rank's shard is kept twice: by its own machine's agent (``origin
"own"``) and by the agent of its backup peer's machine (``origin "peer"``).
Each copy lives in CPU memory for a fast restore and on local disk so an
agent restart does not lose it; no remote storage is involved. Only the
newest ``keep`` steps per rank are kept (two by default: the one being
written and the last complete one, like ByteRobust's dual buffer).

A shard is written to a temporary file and renamed into place after its
checksum file, so a crash mid-write leaves either the old complete shard or
none -- never a torn one that passes as whole. Reading verifies the SHA-256;
a corrupt copy is reported and skipped, so the restore falls back to the
other copy instead of loading garbage.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path

from rankscope.ccl_plugin.backup import shard_path, stored_steps, write_shard_files
from rankscope.contract.errors import RankscopeError

ORIGINS = ("own", "peer")


@dataclass(frozen=True, slots=True)
class ShardInfo:
    rank: int
    step: int
    origin: str  # "own": this machine's rank; "peer": a backup held for a rank on another machine
    size: int
    sha256: str


class ShardCorrupt(RankscopeError):
    """A stored shard whose bytes no longer match its checksum."""


class ShardStore:
    """Shards by (rank, step), in memory and under ``directory``."""

    def __init__(self, directory: str | Path, keep: int = 2, in_memory: bool = True) -> None:
        if keep < 1:
            raise RankscopeError(f"keep must be at least 1, got {keep}", "keep 2 steps (the dual buffer)")
        self.directory = Path(directory)
        self.keep = keep
        self.in_memory = in_memory
        self._memory: dict[tuple[int, int], tuple[ShardInfo, bytes]] = {}
        self._lock = threading.Lock()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RankscopeError(f"cannot use {self.directory} for checkpoint shards: {exc}",
                                 "give the agent a writable --state-dir on local disk") from exc

    def _path(self, rank: int, step: int) -> Path:
        return shard_path(self.directory, rank, step)

    def put(self, rank: int, step: int, data: bytes, origin: str = "own") -> ShardInfo:
        if origin not in ORIGINS:
            raise RankscopeError(f"unknown shard origin {origin!r}", "use 'own' or 'peer'")
        if rank < 0 or step < 0:
            raise RankscopeError(f"bad shard key rank={rank} step={step}", "ranks and steps are non-negative")
        info = ShardInfo(rank, step, origin, len(data), hashlib.sha256(data).hexdigest())
        write_shard_files(self.directory, rank, step, data, origin)
        with self._lock:
            if self.in_memory:
                self._memory[(rank, step)] = (info, bytes(data))
            self._prune(rank)
        return info

    def get(self, rank: int, step: int | None = None) -> tuple[ShardInfo, bytes] | None:
        """The shard of ``rank`` at ``step`` (default: newest), verified; None if this agent has none.

        Raises :class:`ShardCorrupt` when the copy is damaged, so the caller
        takes the peer's copy and says why.
        """
        if step is None:
            steps = self.steps(rank)
            if not steps:
                return None
            step = steps[-1]
        with self._lock:
            cached = self._memory.get((rank, step))
        if cached is not None and hashlib.sha256(cached[1]).hexdigest() == cached[0].sha256:
            return cached
        path = self._path(rank, step)
        meta = path.with_suffix(".json")
        if not path.exists() or not meta.exists():
            return None
        try:
            raw = json.loads(meta.read_text())
            info = ShardInfo(int(raw["rank"]), int(raw["step"]), str(raw["origin"]), int(raw["size"]),
                             str(raw["sha256"]))
            data = path.read_bytes()
        except (OSError, ValueError, KeyError) as exc:
            raise ShardCorrupt(f"shard rank {rank} step {step} is unreadable: {exc}",
                               "restore this rank from its peer's copy") from exc
        if hashlib.sha256(data).hexdigest() != info.sha256 or len(data) != info.size:
            raise ShardCorrupt(f"shard rank {rank} step {step} on disk does not match its checksum",
                               "restore this rank from its peer's copy")
        return info, data

    def steps(self, rank: int) -> tuple[int, ...]:
        """Complete steps stored for ``rank``, oldest first."""
        return tuple(stored_steps(self.directory, rank))

    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(int(p.name[4:]) for p in self.directory.glob("rank*") if p.is_dir()))

    def inventory(self) -> dict[int, tuple[int, ...]]:
        """Rank -> stored steps: what the agent reports so a restore step can be chosen job-wide."""
        return {r: self.steps(r) for r in self.ranks()}

    def _prune(self, rank: int) -> None:
        steps = self.steps(rank)
        for old in steps[:-self.keep] if len(steps) > self.keep else ():
            path = self._path(rank, old)
            for p in (path, path.with_suffix(".json")):
                p.unlink(missing_ok=True)
            self._memory.pop((rank, old), None)
