"""NCCL Inspector output (NCCL's profiler plugin ``plugins/profiler/inspector``): JSON lines, or Prometheus text.

JSON: one object per completed collective per communicator per rank:
``header`` {``id`` (the communicator), ``rank``, ``n_ranks``, ``nnodes``},
``metadata`` {``hostname``, ``pid``, ...}, ``coll_perf`` {``coll``,
``coll_sn``, ``coll_msg_size_bytes``, ``coll_exec_time_us``, ...}. The
objects are written one after another, pretty-printed or one a line; each
rank's are summarised (last sequence number, calls, recent durations) into
``analyzers.log_evidence.InspectorRank``.

Prometheus (``NCCL_INSPECTOR_PROM_DUMP=1``): ``nccl_collective_exec_time_microseconds{node=..,gpu=..,
comm_name=..,collective=..}`` gauges per node and GPU. They carry no rank, so
they are said (the slowest GPU by mean time) and never tied to a rank.
"""

from __future__ import annotations

import json
import re
from collections import deque

from rankscope.contract.log_records import InspectorRank

_KEEP = 256  # durations kept per rank and communicator: enough to tell who arrives last
_PROM = re.compile(r"^nccl_collective_exec_time_microseconds\{([^}]*)\}\s+([0-9.eE+-]+)\s*$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def looks_like_inspector(head: str) -> bool:
    return ('"coll_perf"' in head and '"header"' in head) or "nccl_collective_exec_time_microseconds{" in head


def _objects(text: str) -> tuple[list[object], int]:
    """JSON values one after another (pretty-printed or one a line); how many bytes were not JSON."""
    dec = json.JSONDecoder()
    out: list[object] = []
    i, n, bad = 0, len(text), 0
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n:
            break
        try:
            obj, j = dec.raw_decode(text, i)
        except ValueError:
            nxt = text.find("\n{", i + 1)
            bad += (nxt if nxt >= 0 else n) - i
            i = nxt + 1 if nxt >= 0 else n
            continue
        out.append(obj)
        i = j
    return out, bad


def parse_inspector(text: str, where: str) -> tuple[list[InspectorRank], list[str]]:
    """Inspector JSON or Prometheus text → per-rank summaries, and notes."""
    if "nccl_collective_exec_time_microseconds{" in text and '"coll_perf"' not in text:
        return [], _prometheus(text, where)
    objs, bad = _objects(text)
    notes: list[str] = []
    if bad:
        notes.append(f"{where}: {bad} byte(s) are not Inspector JSON (cut off or other output), skipped")
    acc: dict[tuple[str, int], dict[str, object]] = {}
    skipped = 0
    for o in objs:
        if not isinstance(o, dict):
            skipped += 1
            continue
        h, meta, perf = o.get("header"), o.get("metadata"), o.get("coll_perf")
        if not isinstance(h, dict) or not isinstance(perf, dict):
            skipped += 1
            continue
        rank, sn = h.get("rank"), perf.get("coll_sn")
        if not isinstance(rank, int) or not isinstance(sn, int) or isinstance(rank, bool):
            skipped += 1
            continue
        comm = str(h.get("id", "?"))
        st = acc.setdefault((comm, rank), {"n": 0, "last": -1, "op": "", "d": deque(maxlen=_KEEP),
                                           "n_ranks": h.get("n_ranks"), "meta": meta if isinstance(meta, dict) else {}})
        st["n"] = int(st["n"]) + 1  # type: ignore[call-overload]
        if sn > int(st["last"]):  # type: ignore[call-overload]
            st["last"], st["op"] = sn, str(perf.get("coll", "?"))
        us = perf.get("coll_exec_time_us")
        if isinstance(us, (int, float)) and not isinstance(us, bool):
            st["d"].append((sn, float(us)))  # type: ignore[attr-defined]
    if skipped:
        notes.append(f"{where}: {skipped} JSON object(s) without header.rank and coll_perf.coll_sn, skipped")
    out = []
    for (comm, rank), st in acc.items():
        meta = st["meta"]
        assert isinstance(meta, dict)
        n_ranks = st["n_ranks"]
        host, pid = meta.get("hostname"), meta.get("pid")
        out.append(InspectorRank(comm, rank, n_ranks if isinstance(n_ranks, int) else None,
                                 host if isinstance(host, str) else None, pid if isinstance(pid, int) else None,
                                 int(st["last"]), int(st["n"]), str(st["op"]),  # type: ignore[call-overload]
                                 tuple(st["d"])))  # type: ignore[arg-type]
    return out, notes


def _prometheus(text: str, where: str) -> list[str]:
    gpus: dict[tuple[str, str], list[float]] = {}
    for line in text.splitlines():
        m = _PROM.match(line.strip())
        if m is None:
            continue
        labels = dict(_LABEL.findall(m.group(1)))
        try:
            gpus.setdefault((labels.get("node", "?"), labels.get("gpu", "?")), []).append(float(m.group(2)))
        except ValueError:
            continue
    if not gpus:
        return [f"{where}: Inspector Prometheus text without collective times"]
    means = {k: sum(v) / len(v) for k, v in gpus.items()}
    (node, gpu), worst = max(means.items(), key=lambda kv: kv[1])
    return [f"{where}: NCCL Inspector Prometheus metrics for {len(means)} GPU(s); they carry no rank, so they are "
            f"not tied to one: the longest mean collective time is {worst:.0f} us on node {node} GPU {gpu}"]
