"""Which agents to contact: ``--agents`` lists, hostfiles and Slurm-style ranges.

Accepted forms (mixed freely, comma-separated):

- ``host:port`` and ``10.0.0.7:50051``; ``[::1]:50051`` for IPv6 literals;
- ``host`` alone, when a default port is given (``--port``);
- Slurm hostlist ranges, ``node[01-04,07]:50051`` (zero padding kept), more
  than one range per name (``rack[1-2]-gpu[1-8]``) and a range in the port
  (``127.0.0.1:[50051-50054]``, handy for several agents on one machine);
- ``@FILE``: a hostfile, one entry per line (blank lines and ``#`` comments
  ignored; only the first word of a line is used, so MPI-style
  ``node01 slots=8`` lines work). A line whose later words include
  ``evicted`` names an agent taken out of the job (``127.0.0.1:50053
  evicted``, with ``machine=NAME`` when its machine's name is known): it is
  not contacted, and the TUI shows its machine as evicted, by that name
  (``hostfile_members``). The TUI re-reads its hostfile while attached, so
  adding or marking a line changes whom it asks.

Duplicates are dropped, first occurrence kept, so the order of the output is
the order the user wrote.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import NamedTuple

from rankscope.contract.errors import RankscopeError

DEFAULT_PORT = 50051
EVICTED_MARK = "evicted"  # a hostfile line's later word: this agent's machine was taken out of the job
MACHINE_WORD = "machine="  # on an evicted line, the machine's name (a view that attaches later has never polled it)
MAX_EXPANSION = 65536  # a typo like node[1-9999999] must not eat the memory
_FORMS = "write agents as host:port, node[01-04]:50051 or @hostfile (comma-separated)"


class AgentSpecError(RankscopeError):
    def __init__(self, message: str, fix: str = _FORMS) -> None:
        super().__init__(message, fix)


def split_outside_brackets(text: str, sep: str = ",") -> list[str]:
    """Split on ``sep`` except inside ``[...]`` (where commas list range parts)."""
    parts: list[str] = []
    depth = 0
    current: list[str] = []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise AgentSpecError(f"{text!r}: ']' without a matching '['")
        if ch == sep and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth != 0:
        raise AgentSpecError(f"{text!r}: '[' without a matching ']'")
    parts.append("".join(current))
    return parts


def _digits(text: str) -> bool:
    """ASCII digits only (str.isdigit also takes superscripts such as '¹', which int() refuses)."""
    return text.isascii() and text.isdigit()


def _expand_range_body(body: str, where: str) -> list[str]:
    out: list[str] = []
    for part in body.split(","):
        part = part.strip()
        lo, dash, hi = part.partition("-")
        if not _digits(lo) or (dash and not _digits(hi)):
            raise AgentSpecError(
                f"{where}: range part {part!r} is not a number or a range like 01-04",
                "write ranges as node[01-04,07]: numbers and low-high pairs, comma-separated",
            )
        if not dash:
            out.append(lo)
            continue
        start, stop = int(lo), int(hi)
        if stop < start:
            raise AgentSpecError(f"{where}: range {part!r} runs backwards", f"write it as {hi}-{lo}")
        if stop - start + 1 > MAX_EXPANSION:
            raise AgentSpecError(f"{where}: range {part!r} has more than {MAX_EXPANSION} entries", "check the range bounds")
        width = len(lo) if lo.startswith("0") else 0
        out.extend(str(n).zfill(width) for n in range(start, stop + 1))
    return out


def expand_hostlist(expr: str) -> list[str]:
    """Expand every ``[...]`` group in a Slurm-style name: ``n[1-2]x[3,5]`` -> n1x3, n1x5, n2x3, n2x5."""
    open_at = expr.find("[")
    if open_at < 0:
        if "]" in expr:
            raise AgentSpecError(f"{expr!r}: ']' without a matching '['")
        return [expr]
    close_at = expr.find("]", open_at)
    if close_at < 0:
        raise AgentSpecError(f"{expr!r}: '[' without a matching ']'")
    body = expr[open_at + 1 : close_at]
    if "[" in body:
        raise AgentSpecError(f"{expr!r}: ranges cannot be nested")
    heads = [expr[:open_at] + v for v in _expand_range_body(body, expr)]
    tails = expand_hostlist(expr[close_at + 1 :])
    if len(heads) * len(tails) > MAX_EXPANSION:
        raise AgentSpecError(f"{expr!r} expands to more than {MAX_EXPANSION} names", "check the range bounds")
    return [h + t for h in heads for t in tails]


def _last_colon_outside_brackets(text: str) -> int:
    depth = 0
    for i in range(len(text) - 1, -1, -1):
        ch = text[i]
        if ch == "]":
            depth += 1
        elif ch == "[":
            depth -= 1
        elif ch == ":" and depth == 0:
            return i
    return -1


def _check_port(text: str, where: str) -> int:
    if not _digits(text) or not 0 < int(text) < 65536:
        raise AgentSpecError(f"{where}: port {text!r} is not a number from 1 to 65535")
    return int(text)


def parse_entry(entry: str, *, default_port: int | None = None) -> list[str]:
    """One entry -> its ``host:port`` addresses."""
    text = entry.strip()
    if not text:
        raise AgentSpecError("an empty agent entry (two commas in a row, or a trailing comma?)")
    if any(c.isspace() for c in text):
        raise AgentSpecError(f"{text!r}: an agent address has no spaces")
    # IPv6 literal: [::1]:50051 (brackets that hold colons are not a range)
    if text.startswith("[") and ":" in text[1 : text.find("]")]:
        close = text.find("]")
        host_part, rest = text[: close + 1], text[close + 1 :]
        if rest and not rest.startswith(":"):
            raise AgentSpecError(f"{text!r}: expected [ipv6]:port")
        hosts = [host_part]
        port_text = rest[1:] if rest else ""
    else:
        colon = _last_colon_outside_brackets(text)
        host_expr, port_text = (text[:colon], text[colon + 1 :]) if colon >= 0 else (text, "")
        if not host_expr:
            raise AgentSpecError(f"{text!r}: the host name is missing")
        hosts = expand_hostlist(host_expr)
    if port_text:
        ports = [_check_port(p, text) for p in expand_hostlist(port_text)]
    elif default_port is not None:
        ports = [default_port]
    else:
        raise AgentSpecError(f"{text!r}: no port given", f"write it as {text}:{DEFAULT_PORT} (the port the agent listens on)")
    return [f"{h}:{p}" for h in hosts for p in ports]


def read_hostfile(path: str | Path, *, default_port: int | None = None) -> list[str]:
    """The agents a hostfile lists, in order (lines marked ``evicted`` left out)."""
    return hostfile_members(path, default_port=default_port)[0]


class Hostfile(NamedTuple):
    members: list[str]  # the agents to contact, in order
    evicted: list[str]  # the agents marked evicted
    names: dict[str, str]  # an evicted agent's machine name, where its line gives one


def hostfile_members(path: str | Path, *, default_port: int | None = None) -> Hostfile:
    """The agents to contact, the agents marked ``evicted`` and those machines' names, of a hostfile."""
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise AgentSpecError(f"hostfile {p} does not exist", "check the path given to --hostfile or @FILE") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise AgentSpecError(f"cannot read hostfile {p}: {exc}", "check the path and its permissions") from None
    out: list[str] = []
    evicted: list[str] = []
    names: dict[str, str] = {}
    for number, line in enumerate(lines, start=1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        gone = EVICTED_MARK in words[1:]
        into = evicted if gone else out
        try:
            entries = [a for item in split_outside_brackets(words[0]) for a in parse_entry(item, default_port=default_port)]
        except AgentSpecError as exc:
            raise AgentSpecError(f"{p}:{number}: {exc.message}", exc.fix) from None
        into.extend(entries)
        name = next((w[len(MACHINE_WORD):] for w in words[1:] if w.startswith(MACHINE_WORD)), "")
        if gone and name and len(entries) == 1:  # a name belongs to one agent, not to a range
            names[entries[0]] = name
    return Hostfile(out, evicted, names)


def write_hostfile(path: str | Path, agents: Iterable[str], evicted: Iterable[str] = (),
                   names: Mapping[str, str] | None = None) -> None:
    """One agent per line, evicted ones marked (with their machine's name from ``names``); replaced atomically so
    a reader never sees half a file."""
    p = Path(path)
    gone = set(evicted)
    names = names or {}

    def line(a: str) -> str:
        if a not in gone:
            return f"{a}\n"
        name = names.get(a, "")
        # Only a name the reader gives back as it was: one printable word, no comment sign (else the line is unnamed).
        if name and name.isprintable() and not any(c.isspace() or c == "#" for c in name):
            return f"{a} {EVICTED_MARK} {MACHINE_WORD}{name}\n"
        return f"{a} {EVICTED_MARK}\n"

    text = "".join(line(a) for a in dedupe([*agents, *evicted]))
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(p)


def parse_agents(spec: str, *, default_port: int | None = None) -> list[str]:
    """A ``--agents`` value -> addresses, in order, duplicates dropped."""
    out: list[str] = []
    for item in split_outside_brackets(spec.strip()):
        if item.strip().startswith("@"):
            out.extend(read_hostfile(item.strip()[1:], default_port=default_port))
        else:
            out.extend(parse_entry(item, default_port=default_port))
    return dedupe(out)


def resolve_agents(agents: str | None, hostfile: str | Path | None, *, default_port: int | None = None) -> list[str]:
    """What the CLI was told (``--agents`` and/or ``--hostfile``) -> addresses; at least one."""
    out: list[str] = []
    if agents:
        out.extend(parse_agents(agents, default_port=default_port))
    if hostfile is not None:
        out.extend(read_hostfile(hostfile, default_port=default_port))
    out = dedupe(out)
    if not out:
        raise AgentSpecError("no agents to contact", "pass --agents host:port,... or --hostfile FILE")
    return out


def dedupe(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))
