"""The logs a crashed job leaves on every rank and machine, read as ``analyzers.crash_cascade.CrashEvent``.

A file is told by its content (``looks_like_crash``), and a folder may hold
every rank's log, each machine's kernel log and the launcher's output, mixed,
one level of sub-folders deep (a folder per machine names its host). Lines:

- NCCL's ``host:pid:tid [dev] ... NCCL WARN`` lines: ``NET/IB : Got completion
  from peer ADDR<port> with error N ...`` (older) or ``... with status=N
  opcode=...`` (newer), socket errors (``Call to recv from ADDR<port> failed :
  Connection reset by peer``, ``Connection closed by remote peer ADDR``),
  ``Cuda failure 'TEXT'``; its INFO lines ``Bootstrap : Using IF:ADDR<0>`` and
  ``NET/IB : Using ...; OOB IF:ADDR<0>`` tie an address to its host;
- PyTorch: ``DistBackendError``, ``ncclRemoteError``/``ncclSystemError``/
  ``NCCL error in: ...``, the watchdog's ``Watchdog caught collective
  operation timeout``, ``CUDA error: ...``, ``CUDA out of memory``;
- torchelastic's summary (``Failures:`` and ``Root Cause (first observed
  failure):`` records with ``time``, ``host``, ``rank``, ``exitcode``,
  ``traceback`` fields);
- kernel logs (dmesg, ``dmesg -T``, syslog, journalctl): ``NVRM: Xid
  (PCI:ADDR): CODE, ...``, ``GPU has fallen off the bus``, uncorrectable ECC,
  PCIe AER uncorrected errors, a NIC's link down.

Times are read from the line (ISO, torchelastic's ``2024-05-02_10:11:12``,
glog's ``E0502 10:11:12.345``, syslog's and ``dmesg -T``'s) and compared as
written; a year the line lacks is taken from the others. Each file's errors
are kept once per kind and peer (a traceback repeats its error); what was
read and what was not is said per file in the notes.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from rankscope.contract.crash_records import CrashEvent, CrashEvidence, CrashKind
from rankscope.formats.log_names import file_rank

_MAX_BYTES = 4 * 1024 * 1024  # read of each end of a longer file
_MAX_EVENTS_PER_FILE = 200
# Every error line below but a watchdog timeout holds one of these: a file with none holds no crash's error. (Few
# and short, as every log of a folder is checked: "Error" stands for DistBackendError, ncclRemoteError, ...)
_MARKERS = ("NCCL WARN", "Error", "Xid", "fallen off", "first observed failure", "by peer", "remote peer",
            "Cuda failure", "CUDA error", "Uncorrected", "SIGABRT", "ECC", "double bit", "of memory", "illegal memory",
            "Call to ", "terminate called", "NCCL error")
# Xid codes of a failed GPU, NVLink or memory (NVIDIA's Xid catalogue): the GPU, not the program, is at fault.
_CRITICAL_XID = frozenset({48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 121, 123, 140, 143, 154})
_MONTHS = {m: i for i, m in enumerate(("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov",
                                       "Dec"), 1)}

_NCCL_PREFIX = re.compile(r"(?:^|[\]:\s])([A-Za-z0-9][\w.-]*):(\d+):(\d+) \[(\d+)\] ")
_RANK_PREFIX = re.compile(r"\[rank(\d+)\]:")
_ISO = re.compile(r"(\d{4})-(\d\d)-(\d\d)[T _](\d\d):(\d\d):(\d\d)(?:[.,](\d+))?")
_DMESG_T = re.compile(r"\[(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) (\w{3}) +(\d+) (\d\d):(\d\d):(\d\d) (\d{4})\]")
_SYSLOG = re.compile(r"^(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) +(\d+) (\d\d):(\d\d):(\d\d)(?:\.(\d+))? "
                     r"(\S+) ")
_GLOG = re.compile(r"\[?[EWIF](\d{3,4}) (\d\d):(\d\d):(\d\d)\.(\d+)")
_XID = re.compile(r"NVRM: Xid \(([^)]*)\): (\d+)")
_PEER = re.compile(r"(?:peer|from|to) ([\w.:-]+?)<\d+>")
_OWN_GID = re.compile(r"localGid (?:::ffff:)?([\d.]+)")
_ADDR_INFO = re.compile(r"(?:OOB|Bootstrap : Using|NET/Socket : Using \[\d+\])\s*[\w.-]+:([0-9a-fA-F.:]+?)<\d+>")
_NIC_DOWN = re.compile(r"(?:mlx\d_core|mlx\d|\bib\d|\bNIC\b|bnxt|\bice\b|ixgbe|i40e).*(?:[Ll]ink (?:is )?[Dd]own|"
                       r"[Ll]ost carrier|port .*[Dd]own)")
# A line is looked at only when it holds one of these (every shape below does; most of a log holds none).
_LINE_KEYS = ("NCCL WARN", "NCCL INFO Bootstrap", "NCCL INFO NET/", "NVRM", "Xid", "fallen off", "AER", "ECC",
              "double bit", "down", "Down", "carrier", "Connection", "Call to", "CUDA error", "Cuda failure",
              "illegal memory", "out of memory", "OutOfMemory", "DistBackendError", "ncclRemoteError",
              "ncclSystemError", "ncclInternalError", "ncclUnhandledCudaError", "NCCL error", "Watchdog caught",
              "Timeout at", "SIGABRT", "terminate called", "observed failure", "Failures:", " : ")
_ELASTIC_FIELD = re.compile(r"^\s*(time|host|rank|exitcode|traceback|error_file)\s*:\s*(.*)$")
_HOST_WORDS = re.compile(r"(?i)\b(?:dmesg|kern(?:el)?|syslog|messages|journal(?:ctl)?|nccl|train(?:ing)?|log|logs|"
                         r"out|err|stdout|stderr|txt|rank[_-]?\d+|torchrun|elastic|launcher)\b")


@dataclass(slots=True)
class _Line:
    """One error as read, before times and addresses are settled across the files."""

    event: CrashEvent
    stamp: tuple[int | None, int, int, int, int, int, float] | None


def looks_like_crash(head: str) -> bool:
    """Whether a file's first (and last) bytes hold an error line of a crash this module reads."""
    return any(m in head for m in _MARKERS) or (("own" in head or "carrier" in head)  # (down, Down)
                                                and _NIC_DOWN.search(head) is not None)


def any_crash_file(path: Path) -> bool:
    """Whether a folder's per-machine folders hold a crash log (stops at the first; the folder's own files are
    ``incident_logs.any_log_file``'s)."""
    return any(looks_like_crash(head_of(p)) for p in machine_files(path))


def head_of(path: Path) -> str:
    """A file's first 64 KiB as text ("" when unreadable or binary)."""
    return _read(path, 64 * 1024, whole=False)[0] or ""


def crash_files(path: Path) -> list[Path]:
    """The files of ``path`` (a file, a folder, or a folder of per-machine folders) this module reads."""
    if path.is_file():
        return [path]
    return [path / n for n in _names(path, dirs=False)] + machine_files(path)


def machine_files(path: Path) -> list[Path]:
    """The files of a folder's sub-folders (a folder per machine), one level deep."""
    return [path / d / n for d in _names(path, dirs=True) for n in _names(path / d, dirs=False)]


def _names(path: Path, *, dirs: bool) -> list[str]:
    """A folder's entry names, sorted: its sub-folders, or its files but notes (.md); none when it is unreadable."""
    try:
        with os.scandir(path) as it:  # the entries' types come with the listing: no stat per file
            return sorted(e.name for e in it if not e.name.startswith(".")
                          and (e.is_dir() if dirs else e.is_file() and not e.name.lower().endswith(".md")))
    except OSError:
        return []


def read_crash_logs(items: Iterable[Path | tuple[Path, str | None]], root: Path | None = None) -> CrashEvidence:
    """Every file given (a path, or a path with its text already read) → one CrashEvidence. ``root``: the folder
    given, whose sub-folders name hosts."""
    lines: list[_Line] = []
    addrs: dict[str, str] = {}
    notes: list[str] = []
    for item in items:
        path, text = item if isinstance(item, tuple) else (item, None)
        if text is None:
            text, cut = _read(path)
            if text is None:
                notes.append(f"{path.name}: not readable, skipped")
                continue
            if cut:
                notes.append(f"{path.name}: larger than {2 * _MAX_BYTES // 2**20} MiB: its first and last "
                             f"{_MAX_BYTES // 2**20} MiB read")
        deeper = root is not None and path.parent != root
        found, file_notes = read_crash_text(text, f"{path.parent.name}/{path.name}" if deeper else path.name,
                                            path.parent.name if deeper else None, addrs)
        lines.extend(found)
        notes.extend(file_notes)
    return CrashEvidence(tuple(_settle(lines, addrs)), tuple(_digest(notes)))


def _digest(notes: list[str], keep: int = 8) -> list[str]:
    """Per-file notes as they are for a few files; for many, those that say something was not read, and one line
    for the files read whole."""
    read = [n for n in notes if ": read " in n and "error(s) of a crash" in n]
    if len(read) <= keep:
        return notes
    said = set(read)
    rest = [n for n in notes if n not in said]
    names = ", ".join(n.split(":", 1)[0] for n in read[:3])
    return [f"crash logs: errors read from {len(read)} files ({names}, ...)", *rest]


def _read(path: Path, limit: int = _MAX_BYTES, whole: bool = True) -> tuple[str | None, bool]:
    """The text of a file (its first and last ``limit`` bytes when longer than twice that; only the first when not
    ``whole``), and whether a middle part was left out."""
    try:
        with path.open("rb") as f:
            raw = f.read(limit)
            cut = False
            if whole and len(raw) == limit:
                f.seek(0, 2)
                if f.tell() > 2 * limit:
                    cut = True
                    f.seek(f.tell() - limit)
                else:
                    f.seek(limit)
                raw += b"\n" + f.read()
    except OSError:
        return None, False
    if b"\0" in raw[:4096]:
        return None, False
    return raw.decode("utf-8", errors="replace"), cut


def _host_of_name(name: str) -> str | None:
    """A host a file's name gives (``node3-dmesg.txt``, ``dmesg_gpu-b07.log``), when a word is left that is not a
    log's usual name."""
    stem = name.rsplit(".", 1)[0]
    left = [w for w in re.split(r"[_\s]+|(?<=\D)-(?=\d*\D)|\.", _HOST_WORDS.sub(" ", stem)) if w.strip("-")]
    words = [w.strip("-") for w in left if re.search(r"[A-Za-z]", w) and re.search(r"\d", w)]
    return words[0] if len(words) == 1 else None


def read_crash_text(text: str, name: str, host_hint: str | None = None,
                    addrs: dict[str, str] | None = None) -> tuple[list[_Line], list[str]]:
    """One file's errors (times not yet settled) and notes on what was read and what was not."""
    addrs = addrs if addrs is not None else {}
    out: list[_Line] = []
    seen: set[tuple[CrashKind, str | None, int | None, str]] = set()
    rank_of_file = file_rank(name.rsplit("/", 1)[-1])
    file_host: str | None = None
    elastic: dict[str, str] | None = None
    elastic_root = False
    elastic_where = ""
    dropped = 0
    unknown_lines = 0

    def add(ev: CrashEvent, stamp: tuple[int | None, int, int, int, int, int, float] | None) -> None:
        nonlocal dropped
        key = (ev.kind, ev.peer, ev.rank, ev.text[:60] if ev.kind is not CrashKind.EXIT else ev.where)
        if key in seen:
            return
        seen.add(key)
        if len(out) >= _MAX_EVENTS_PER_FILE:
            dropped += 1
            return
        out.append(_Line(ev, stamp))

    def close_elastic() -> None:
        nonlocal elastic
        if elastic is not None and ("exitcode" in elastic or "rank" in elastic):
            rank = re.match(r"\s*(\d+)", elastic.get("rank", ""))
            code = re.match(r"\s*(-?\d+)", elastic.get("exitcode", ""))
            tb = elastic.get("traceback", "").strip()
            text_ = f"exit code {code.group(1) if code else '?'}" + (f", {tb[:100]}" if tb else "")
            add(CrashEvent(elastic_where, CrashKind.EXIT, text_, host=elastic.get("host", "").strip() or None,
                           rank=int(rank.group(1)) if rank else None, root_claim=elastic_root,
                           exitcode=int(code.group(1)) if code else None), _stamp(elastic.get("time", "")))
        elastic = None

    keys = tuple(k for k in _LINE_KEYS if k in text)  # (most files hold few of them: a line is checked for those)
    if not keys:
        return [], []
    for no, line in enumerate(text.split("\n"), 1):
        if not any(k in line for k in keys) and not line.rstrip().endswith("]:"):
            if elastic is not None:
                close_elastic()
            continue
        stripped = line.strip()
        if "first observed failure" in line:
            close_elastic()
            elastic_root = True
            continue
        if stripped.startswith("Failures:"):
            close_elastic()
            elastic_root = False
            continue
        if re.match(r"^\[\d+\]:\s*$", stripped):
            close_elastic()
            elastic = {}
            elastic_where = f"{name}:{no}"
            continue
        if elastic is not None:
            f = _ELASTIC_FIELD.match(line)
            if f is not None:
                elastic[f.group(1)] = f.group(2)
                continue
            close_elastic()
        m = _NCCL_PREFIX.search(line) if "NCCL" in line else None
        host = m.group(1) if m is not None else None
        if host is not None and file_host is None:
            file_host = host
        if "NCCL INFO" in line and host is not None:
            a = _ADDR_INFO.search(line)
            if a is not None:
                addrs.setdefault(a.group(1), host)
            continue
        kind, what, peer, gpu = _classify(line)
        if kind is None:
            if any(k in line for k in ("NCCL WARN", "NVRM:")):
                unknown_lines += 1
            continue
        if host is None and line[:1].isalpha():
            s = _SYSLOG.match(line)
            host = s.group(7) if s is not None else None
        if kind is CrashKind.NETWORK and host is not None and (own := _OWN_GID.search(line)) is not None:
            addrs.setdefault(own.group(1), host)
        if gpu is None and m is not None:
            gpu = m.group(4)
        pr = _RANK_PREFIX.search(line)
        rank = int(pr.group(1)) if pr is not None else rank_of_file
        add(CrashEvent(f"{name}:{no}", kind, what, host=host, rank=rank, gpu=gpu, peer=peer), _stamp(line))
    close_elastic()
    # A rank's log lives on one host: a line that names none is tied to the host its file's NCCL lines name, else
    # to the host the file's name (or folder) gives.
    fill = file_host or host_hint
    if fill is None and any(x.event.host is None for x in out):
        fill = _host_of_name(name.rsplit("/", 1)[-1])
    if fill is not None:
        out = [_Line(replace(x.event, host=fill), x.stamp) if x.event.host is None else x for x in out]
    notes = []
    if out:
        kinds = Counter(x.event.kind for x in out)
        notes.append(f"{name}: read {len(out)} error(s) of a crash ("
                     + ", ".join(f"{n} {k}" for k, n in kinds.most_common()) + ")")
    if dropped:
        notes.append(f"{name}: {dropped} more distinct error line(s) beyond the first {_MAX_EVENTS_PER_FILE}, "
                     "counted, not read")
    if unknown_lines:
        notes.append(f"{name}: {unknown_lines} NCCL WARN / NVRM line(s) not in a shape this reader knows, skipped")
    return out, notes


def _classify(line: str) -> tuple[CrashKind | None, str, str | None, str | None]:
    """What an error line says: kind, a short text, the peer it names, the GPU it names."""
    if "Xid" in line and (x := _XID.search(line)) is not None:
        code = int(x.group(2))
        rest = line[x.end():].split(",")
        said = next((p.strip() for p in rest[1:] if p.strip() and "=" not in p), "")
        return (CrashKind.HARDWARE if code in _CRITICAL_XID else CrashKind.GPU,
                f"Xid {code}" + (f" ({said[:80]})" if said else ""), None, x.group(1))
    if "fallen off the bus" in line:
        pci = re.search(r"PCI:[0-9a-fA-F:.]+", line)
        return CrashKind.HARDWARE, "GPU has fallen off the bus", None, pci.group(0) if pci else None
    if "AER: Uncorrected" in line or "severity=Uncorrected" in line:
        return CrashKind.HARDWARE, "PCIe uncorrected error (AER)", None, None
    if "uncorrectable ECC" in line or "double bit error" in line:
        return CrashKind.HARDWARE, "uncorrectable ECC error", None, None
    if ("own" in line or "carrier" in line) and _NIC_DOWN.search(line) is not None:  # down, Down
        return CrashKind.HARDWARE, "NIC link down: " + _tail(line, ("mlx", "ib", "NIC", "bnxt", "ice", "ixgbe", "i40e")),\
            None, None
    if "Got completion from peer" in line:
        peer = _PEER.search(line)
        status = re.search(r"(?:with error|status=)\s*(\d+)", line)
        return (CrashKind.NETWORK, "NCCL NET/IB completion error" + (f" {status.group(1)}" if status else "")
                + (f" from peer {peer.group(1)}" if peer else ""), peer.group(1) if peer else None, None)
    if "Connection reset by peer" in line or "Connection closed by remote peer" in line or \
            re.search(r"Call to (?:recv|send|connect) (?:from|to) \S+ failed", line):
        peer = _PEER.search(line) or re.search(r"remote peer ([\w.:-]+)", line)
        what = "connection reset by peer" if "reset" in line else "connection closed by remote peer" \
            if "closed" in line else "socket call failed"
        return CrashKind.NETWORK, what + (f" {peer.group(1)}" if peer else ""), peer.group(1) if peer else None, None
    if "Cuda failure" in line or "CUDA error: " in line or "illegal memory access" in line:
        m = re.search(r"(?:Cuda failure\s*(?:\d+\s*)?'([^']*)'|CUDA error: ([^.\n]*))", line)
        said = (m.group(1) or m.group(2)) if m else "illegal memory access"
        return CrashKind.GPU, f"CUDA failure: {said[:80]}", None, None
    if "CUDA out of memory" in line or "OutOfMemoryError" in line:
        return CrashKind.PROGRAM, "CUDA out of memory", None, None
    if "DistBackendError" in line or "ncclRemoteError" in line or "ncclSystemError" in line or \
            "ncclInternalError" in line or "ncclUnhandledCudaError" in line or "NCCL error in:" in line or \
            "NCCL error:" in line:
        peer = _PEER.search(line)
        word = next(w for w in ("DistBackendError", "ncclRemoteError", "ncclSystemError", "ncclInternalError",
                                "ncclUnhandledCudaError", "NCCL error") if w in line)
        return CrashKind.DIST, f"{word}: a collective failed", peer.group(1) if peer else None, None
    if "Watchdog caught collective operation timeout" in line or "Timeout at NCCL work" in line:
        seq = re.search(r"SeqNum=(\d+)", line)
        return CrashKind.TIMEOUT, "watchdog timeout" + (f" in work {seq.group(1)}" if seq else ""), None, None
    if "(SIGABRT)" in line or "terminate called after throwing" in line:
        return CrashKind.ABORT, "aborted (SIGABRT)", None, None
    return None, "", None, None


def _tail(line: str, keys: Sequence[str]) -> str:
    at = min((i for i in (line.find(k) for k in keys) if i >= 0), default=0)
    return line[at:at + 80].strip()


def _stamp(line: str) -> tuple[int | None, int, int, int, int, int, float] | None:
    """A line's clock time as (year or None, month, day, hour, minute, second, fraction)."""
    if (m := _ISO.search(line)) is not None:
        return (int(m.group(1)), int(m.group(2)), int(m.group(3)), int(m.group(4)), int(m.group(5)),
                int(m.group(6)), float("0." + m.group(7)) if m.group(7) else 0.0)
    if (m := _DMESG_T.search(line)) is not None and m.group(1) in _MONTHS:
        return (int(m.group(6)), _MONTHS[m.group(1)], int(m.group(2)), int(m.group(3)), int(m.group(4)),
                int(m.group(5)), 0.0)
    if (m := _SYSLOG.match(line)) is not None:
        return (None, _MONTHS[m.group(1)], int(m.group(2)), int(m.group(3)), int(m.group(4)), int(m.group(5)),
                float("0." + m.group(6)) if m.group(6) else 0.0)
    if (m := _GLOG.search(line)) is not None:
        md = m.group(1).rjust(4, "0")
        return (None, int(md[:2]), int(md[2:]), int(m.group(2)), int(m.group(3)), int(m.group(4)),
                float("0." + m.group(5)))
    return None


def _settle(lines: Sequence[_Line], addrs: dict[str, str]) -> list[CrashEvent]:
    """Times on one scale (a year the line lacks taken from the others) and peers by host name where an address
    is tied to one."""
    years = Counter(s[0] for x in lines if (s := x.stamp) is not None and s[0] is not None)
    year = years.most_common(1)[0][0] if years else 2000
    out = []
    for x in lines:
        e = x.event
        t = None
        if x.stamp is not None:
            y, mo, d, h, mi, sec, frac = x.stamp
            try:
                t = datetime(y if y is not None else year or 2000, mo, d, h, mi, sec, tzinfo=UTC).timestamp() + frac
            except ValueError:
                t = None
        peer = e.peer
        if peer is not None:
            bare = peer.split("<", 1)[0]
            peer = addrs.get(bare, addrs.get(bare.removeprefix("::ffff:"), bare))
        out.append(replace(e, time=t, peer=peer))
    return out


__all__ = ["crash_files", "looks_like_crash", "read_crash_logs", "read_crash_text"]
