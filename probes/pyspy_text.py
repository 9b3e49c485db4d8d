"""py-spy's text output, as printed by ``py-spy dump --pid P`` and pasted into tickets.

One text may hold several processes one after another (``py-spy dump
--subprocesses``, or ``pgrep ... | xargs -n1 py-spy dump --pid``), each
starting at its ``Process N: cmdline`` header, or a bare list of threads
(a paste without the header). What py-spy 0.4 prints, line by line:

    Process 6742: /usr/bin/python train.py --local_rank=3
    Python v3.11.7 (/usr/bin/python3.11)
    <blank>
    Thread 6742 (active+gil): "MainThread"       id decimal (the OS id) or 0x-hex; idle/active/active+gil
        inner (train.py:4)                       a Python frame, innermost first
            Arguments:                           --locals: names and values, never frames
                x: 3
        clock_nanosleep (libc.so.6)              --native: a library without a line
        0x7fa91364524a (libc.so.6)               --native, unsymbolised
    Error: Failed to get stack traces            a process py-spy could not read,
    Caused by:                                   then its causes, and maybe a
        0: Failed to suspend process             Rust backtrace (skipped)
    Reason: EPERM: Operation not permitted

A process py-spy could not read is kept, with its error classified like a
live capture's (``classify_pyspy_error``) and py-spy's words as the message.
Nothing is dropped quietly: lines that are none of the above are counted and
quoted in ``ParsedText.problems``, and a dump that ends mid-way, or whose main
thread stops short of the program's entry, is flagged ``truncated``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rankscope.contract.snapshot import CaptureError, CaptureErrorKind, Frame, ProcessRole, ProcessStack, ThreadStack
from rankscope.probes.pyspy import classify_pyspy_error

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_PROCESS = re.compile(r"^\s*Process (\d+):\s?(.*)$")  # the colon: "Process 1" may be "Process 10:" cut short
_PYTHON = re.compile(r"^\s*Python v(\S+)(?: \((.*)\))?$")
_THREAD = re.compile(r'^\s*Thread (0[xX][0-9a-fA-F]+|\d+)(?: \(([a-z+]*)\))?(?::\s*"(.*)")?\s*$')
_FRAME = re.compile(r"^(\s*)(.+?) \(([^()]*?)(?::(\d+))?\)$")
_ADDRESS = re.compile(r"^0[xX][0-9a-fA-F]+$")
# Hand-abridged pastes: frames prefixed with "..." (the frames above were cut), a note after the frame
# ("<- stuck here", in any language), or a line of dots alone where frames were left out.
_ELIDED = re.compile(r"^(\s*)(?:\.\.\.|\u2026)\s*")
_ANNOTATED = re.compile(r"^(\s*)(.+?) \(([^()\s]*?[./][^()\s]*?)(?::(\d+))?\)\s+\S.*$")
_DOTS = re.compile(r"^\s*(?:\.\.\.|\u2026)+\s*(?:\(.*\)|\[.*\])?\s*$")
_ERROR = re.compile(r"^\s*(Error|Permission Denied):")
_ERROR_MORE = re.compile(r"^\s*(Caused by:|Reason:|\d+: )")
_BACKTRACE = re.compile(r"^\s*Stack backtrace:")
_BACKTRACE_LINE = re.compile(r"^\s*(\d+: |at )")
_COMMAND = re.compile(r"^\s*(?:\S*[$#>]\s*)?(?:sudo\s+)?(?:\S*/)?py-spy\s+dump\b(.*)$")
_COMMAND_PID = re.compile(r"(?:--pid|-p)[=\s]+(\d+)")
_LOCALS = ("Arguments:", "Locals:")
# Where a main thread's stack starts when it was printed whole: the script's
# module, runpy for `python -m`, or native frames below the interpreter.
_ENTRY = frozenset({"<module>", "_run_module_as_main", "_run_code"})
_NATIVE_SOURCE = (".c", ".cc", ".cpp", ".cxx", ".cu", ".h", ".hpp", ".rs", ".S")
_MAX_QUOTED = 3


@dataclass(frozen=True, slots=True)
class TextProcess:
    """One process of a text dump: its stacks (or error) and what the header said of it."""

    stack: ProcessStack
    cmdline: str | None  # from the ``Process N:`` header; None when the paste had none
    python: str | None  # the ``Python vX.Y`` version
    line: int  # where its section starts (1-based), for messages


@dataclass(frozen=True, slots=True)
class ParsedText:
    processes: tuple[TextProcess, ...]
    problems: tuple[str, ...]  # lines that are not py-spy output, quoted with their line number
    recognised: int  # lines that are py-spy output (0: the text is not a dump at all)


class _Section:
    """A process being read."""

    __slots__ = ("cmdline", "cut", "error_lines", "line", "pid", "python", "threads")

    def __init__(self, pid: int | None, cmdline: str | None, line: int) -> None:
        self.pid = pid
        self.cmdline = cmdline
        self.python: str | None = None
        self.line = line
        self.threads: list[tuple[int, int | None, str | None, str, list[Frame]]] = []
        self.error_lines: list[str] = []
        self.cut: str | None = None


def _is_header(stripped: str) -> bool:
    return (stripped.startswith("Thread ") and _THREAD.match(stripped) is not None) or (
        stripped.startswith("Process ") and _PROCESS.match(stripped) is not None)


def _frame(name: str, filename: str, line: str | None) -> Frame:
    if _ADDRESS.match(name):
        name = "??"  # an unsymbolised native frame: addresses differ per process and are not kept
    native = (line is None and not filename.startswith("<")) or filename.endswith(_NATIVE_SOURCE)
    return Frame(name=name, filename=filename, line=int(line) if line and int(line) > 0 else None,
                 module=filename if native else None, native=native)


FrameCache = dict[str, tuple[int, Frame]]


def parse_pyspy_text(text: str, role: ProcessRole = ProcessRole.MAIN, cache: FrameCache | None = None) -> ParsedText:
    """Every process in a py-spy text dump; never raises on any input.

    ``cache`` (frame line -> its indent and Frame), shared across the files of
    one job, reads each distinct frame line once: ranks of one job repeat the
    same lines, and the frozen Frame objects can be shared.
    """
    if cache is None:
        cache = {}
    if "\x1b" in text:
        text = _ANSI.sub("", text)  # colours, when the dump was captured from a terminal
    sections: list[_Section] = []
    problems: list[str] = []
    unknown = 0
    recognised = 0
    cur: _Section | None = None
    frames: list[Frame] | None = None  # the frames of the thread being read
    frame_indent = -1
    in_locals = False
    in_backtrace = False
    command_pid: int | None = None
    lines = text.splitlines()
    ends_mid_line = bool(text) and not text.endswith(("\n", "\r"))

    def new(pid: int | None, cmdline: str | None, at: int) -> _Section:
        sec = _Section(pid, cmdline, at)
        sections.append(sec)
        return sec

    for no, raw in enumerate(lines, 1):
        if frames is not None and not in_locals:
            hit = cache.get(raw)
            if hit is not None and (frame_indent < 0 or hit[0] == frame_indent):
                frame_indent = hit[0]
                frames.append(hit[1])
                recognised += 1
                continue
        line = raw.rstrip()
        if not line:
            continue
        stripped = line.lstrip()
        indent = len(line) - len(stripped)
        if frames is not None and indent > frame_indent >= 0 and (in_locals or stripped in _LOCALS):
            in_locals = True  # --locals: names and values under a frame, never frames themselves
            recognised += 1
            continue
        in_locals = False
        if frames is not None and _DOTS.match(line):
            if cur is not None and cur.cut is None:
                cur.cut = f"frames left out by hand at line {no} ({stripped[:40]!r})"
            recognised += 1
            continue
        if cur is not None and (e := _ELIDED.match(line)) is not None:
            rest = e.group(1) + line[e.end():]
            if _FRAME.match(rest) or _ANNOTATED.match(rest):
                line, stripped = rest, rest.lstrip()  # the frame after the dots is a frame like any other
                if cur.cut is None:
                    cur.cut = f"frames left out by hand before line {no}"
        if frames is None and cur is not None and not cur.threads and not cur.error_lines \
                and (_FRAME.match(line) or _ANNOTATED.match(line)) and not _is_header(stripped) \
                and not _PYTHON.match(line):
            # A header followed by frames with no `Thread` line: an abridged paste of the main thread.
            frames = []
            frame_indent = -1
            cur.threads.append((cur.pid or 0, cur.pid, "MainThread", "", frames))
        if in_backtrace:
            if _BACKTRACE_LINE.match(line):
                recognised += 1
                continue
            in_backtrace = False
        m = (_FRAME.match(line) or _ANNOTATED.match(line)) if frames is not None else None
        if m is not None and (frame_indent < 0 or indent == frame_indent) and not _is_header(stripped):
            assert frames is not None
            frame_indent = indent
            frame = _frame(m.group(2).strip(), m.group(3), m.group(4))
            frames.append(frame)
            cache[raw] = (indent, frame)
            recognised += 1
            continue
        if (p := _PROCESS.match(line)) is not None:
            cur = new(int(p.group(1)), (p.group(2) or "").strip() or None, no)
            frames, frame_indent, command_pid = None, -1, None
            recognised += 1
            continue
        if (t := _THREAD.match(line)) is not None:
            ident, status, name = t.group(1), t.group(2) or "", t.group(3)
            hexa = ident[:2].lower() == "0x"
            tid = int(ident, 16) if hexa else int(ident)
            os_tid = None if hexa else tid
            # A second main thread means a new process whose header was not pasted.
            if cur is None or (cur.error_lines and not cur.threads) or (
                    name == "MainThread" and any(th[2] == "MainThread" for th in cur.threads)):
                cur = new(command_pid, None, no)
                command_pid = None
            frames = []
            frame_indent = -1
            cur.threads.append((tid, os_tid, name, status, frames))
            recognised += 1
            continue
        if _PYTHON.match(line) and cur is not None and cur.python is None:
            cur.python = _PYTHON.match(line).group(1)  # type: ignore[union-attr]
            recognised += 1
            continue
        if _ERROR.match(line) or (cur is not None and cur.error_lines and _ERROR_MORE.match(line)):
            if _ERROR.match(line) and (cur is None or cur.threads or cur.error_lines):
                cur = new(command_pid, None, no)
                command_pid = None
            assert cur is not None
            cur.error_lines.append(stripped)
            frames = None
            recognised += 1
            continue
        if _BACKTRACE.match(line):
            in_backtrace = True
            frames = None
            recognised += 1
            continue
        if (c := _COMMAND.match(line)) is not None:
            pid_m = _COMMAND_PID.search(c.group(1))
            command_pid = int(pid_m.group(1)) if pid_m else None
            frames = None
            if cur is not None and (cur.threads or cur.error_lines):
                cur = None  # the next output belongs to the next command
            recognised += 1
            continue
        if cur is not None and cur.cmdline is not None and cur.python is None and not cur.threads \
                and not cur.error_lines and frames is None:
            cur.cmdline += "\n" + line  # a command line with newlines in it (`python -c "..."`), printed raw
            recognised += 1
            continue
        if no == len(lines) and ends_mid_line and cur is not None:
            cur.cut = f"the dump ends mid-line at line {no} ({stripped[:60]!r})"
            continue
        unknown += 1
        if unknown <= _MAX_QUOTED:
            problems.append(f"line {no} is not py-spy output: {stripped[:80]!r}")
    if unknown > _MAX_QUOTED:
        problems.append(f"{unknown - _MAX_QUOTED} more lines that are not py-spy output")
    return ParsedText(processes=tuple(_finish(s, role) for s in sections), problems=tuple(problems),
                      recognised=recognised)


def _finish(sec: _Section, role: ProcessRole) -> TextProcess:
    pid = sec.pid
    if pid is None:
        # No header: on Linux the main thread's OS id is the process id.
        pid = next((os_tid for _, os_tid, name, _, _ in sec.threads if name == "MainThread" and os_tid), 0)
    if sec.error_lines and not sec.threads:
        message = " ".join(sec.error_lines)[:600]
        kind, _, fix = classify_pyspy_error(message, pid or "<PID>")
        return TextProcess(ProcessStack(pid=pid, role=role, threads=None, error=CaptureError(kind, message, fix),
                                        truncated=sec.cut), sec.cmdline, sec.python, sec.line)
    threads = tuple(
        ThreadStack(thread_id=tid, frames=tuple(frames), thread_name=name, os_thread_id=os_tid,
                    active=status.startswith("active"), owns_gil="gil" in status)
        for tid, os_tid, name, status, frames in sec.threads
    )
    cut = sec.cut
    if not threads:
        # py-spy prints the header on stdout and its error on stderr: a saved
        # stdout holds the header alone when the capture failed.
        message = (f"the dump of pid {pid} has its header but no threads and no error: py-spy's error went "
                   "to stderr (not saved), or the dump was cut")
        return TextProcess(ProcessStack(pid=pid, role=role, threads=None, truncated=cut or message,
                                        error=CaptureError(CaptureErrorKind.FAILED, message,
                                                           f"run `py-spy dump --pid {pid} 2>&1` to see why")),
                           sec.cmdline, sec.python, sec.line)
    if cut is None:
        cut = _stops_short(threads)
    return TextProcess(ProcessStack(pid=pid, role=role, threads=threads, truncated=cut),
                       sec.cmdline, sec.python, sec.line)


def _stops_short(threads: tuple[ThreadStack, ...]) -> str | None:
    """py-spy prints a main thread down to the program's entry; a stack that stops above it was cut."""
    for t in threads:
        if t.thread_name == "MainThread" and t.frames:
            bottom = t.frames[-1]
            if not bottom.native and bottom.name not in _ENTRY:
                return (f"MainThread stops at {bottom.name} ({bottom.filename}), not at the program's entry "
                        "(<module>): only its top frames were kept")
    return None


def format_pyspy_text(stack: ProcessStack, cmdline: str = "python", python: str = "3.11.7") -> str:
    """A process's stacks written as ``py-spy dump`` prints them (the inverse of the parser).

    For handing rankscope's stacks to people and tools that read py-spy's
    text, and for generating dumps in tests and benchmarks.
    """
    out = [f"Process {stack.pid}: {cmdline}", f"Python v{python} (/usr/bin/python3)", ""]
    if stack.threads is None:
        out.append(f"Error: {stack.error.message if stack.error else 'no stacks'}")
    for t in stack.threads or ():
        ident = str(t.os_thread_id) if t.os_thread_id is not None else f"{t.thread_id:#X}".replace("0X", "0x")
        status = ("active+gil" if t.owns_gil else "active") if t.active else "idle"
        name = f': "{t.thread_name}"' if t.thread_name is not None else ""
        out.append(f"Thread {ident} ({status}){name}")
        for f in t.frames:
            out.append(f"    {f.name} ({f.filename}:{f.line})" if f.line is not None else f"    {f.name} ({f.filename})")
    return "\n".join(out) + "\n"
