"""Property and fuzz tests for the py-spy text reader and the dumps loader (hypothesis).

- any text, any bytes: the parser and the loader never raise (the loader's
  only error is "no dumps here", a RankscopeError naming the fix);
- a generated dump, written as py-spy prints it, reads back to the same
  threads and frames, one process or several one after another;
- a dump cut at any character keeps a prefix of what it held.
"""

from __future__ import annotations

import string
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rankscope.contract.errors import RankscopeError
from rankscope.contract.snapshot import Frame, ProcessRole, ProcessStack, ThreadStack
from rankscope.formats.pyspy_dir import load_pyspy_dir
from rankscope.probes.pyspy_text import format_pyspy_text, parse_pyspy_text

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

_word = st.text(string.ascii_letters + string.digits + "_", min_size=1, max_size=12)
_func = st.one_of(
    st.just("<module>"), st.just("<lambda>"),
    st.builds(lambda a, b: f"{a}.{b}", _word, _word),
    _word,
    st.builds(lambda a: f"at::native::{a}(at::Tensor const&)", _word),  # a C++ name with parentheses
)
_path = st.builds(lambda parts: "/".join(parts), st.lists(_word, min_size=1, max_size=4))
_py_frame = st.builds(lambda name, path, line: Frame(name=name, filename=f"{path}.py", line=line),
                      _func, _path, st.integers(1, 100_000))
_native_frame = st.builds(lambda name, lib: Frame(name=name, filename=f"lib{lib}.so", module=f"lib{lib}.so",
                                                  native=True), _func, _word)
_thread_name = st.text(string.ascii_letters + string.digits + ' -_."()', min_size=1, max_size=20)


@st.composite
def _thread(draw: st.DrawFn, main: bool) -> ThreadStack:
    decimal = draw(st.booleans())
    tid = draw(st.integers(1, 2**22)) if decimal else draw(st.integers(0, 2**48))
    active = draw(st.booleans())
    frames = draw(st.lists(st.one_of(_py_frame, _native_frame), max_size=40))
    if main:
        frames.append(Frame(name="<module>", filename="train.py", line=1))
    return ThreadStack(thread_id=tid, frames=tuple(frames), os_thread_id=tid if decimal else None,
                       thread_name="MainThread" if main else draw(st.one_of(st.none(), _thread_name)),
                       active=active, owns_gil=active and draw(st.booleans()))


@st.composite
def _process(draw: st.DrawFn) -> ProcessStack:
    threads = [draw(_thread(main=True)), *draw(st.lists(_thread(main=False), max_size=4))]
    return ProcessStack(pid=draw(st.integers(1, 2**22)), role=ProcessRole.MAIN, threads=tuple(threads))


@SETTINGS
@given(st.text())
def test_any_text_is_read_without_raising(text: str) -> None:
    parsed = parse_pyspy_text(text)
    assert all(isinstance(p, str) for p in parsed.problems)
    for proc in parsed.processes:
        assert proc.stack.threads is not None or proc.stack.error is not None


@SETTINGS
@given(st.lists(st.sampled_from([
    "Process 12: python x.py", "Python v3.11.7 (/usr/bin/python)", 'Thread 12 (idle): "MainThread"',
    "Thread 0x0 (active)", "    f (a.py:1)", "    g (libc.so.6)", "        Arguments:", "            x: 1",
    "Error: Failed to suspend process", "Reason: EPERM", "Caused by:", "    0: boom", "Stack backtrace:",
    "   1: py_spy::main", "$ py-spy dump --pid 9", "", "garbage (", "    <module> (a.py:",
]), max_size=40))
def test_shuffled_pyspy_lines_are_read_without_raising(lines: list[str]) -> None:
    parsed = parse_pyspy_text("\n".join(lines))
    assert len(parsed.problems) <= 4  # quoted up to 3, then counted on one line


@SETTINGS
@given(st.lists(_process(), min_size=1, max_size=4))
def test_generated_dumps_read_back_to_the_same_stacks(procs: list[ProcessStack]) -> None:
    text = "".join(format_pyspy_text(p, cmdline=f"python train.py --local_rank={i}") for i, p in enumerate(procs))
    parsed = parse_pyspy_text(text)
    assert parsed.problems == ()
    assert [p.stack.pid for p in parsed.processes] == [p.pid for p in procs]
    assert [p.cmdline for p in parsed.processes] == [f"python train.py --local_rank={i}" for i in range(len(procs))]
    for got, want in zip(parsed.processes, procs, strict=True):
        assert got.stack.threads == want.threads
        assert got.stack.truncated is None and got.stack.error is None


@SETTINGS
@given(_process(), st.data())
def test_a_dump_cut_anywhere_keeps_a_prefix_of_its_frames(proc: ProcessStack, data: st.DataObject) -> None:
    text = format_pyspy_text(proc)
    cut = data.draw(st.integers(0, len(text)))
    parsed = parse_pyspy_text(text[:cut])
    assert proc.threads is not None
    for got in parsed.processes:
        assert got.stack.pid == proc.pid
        for i, thread in enumerate(got.stack.threads or ()):
            want = proc.threads[i]
            # the last frame read may be a cut line's start: all but it are exactly the originals
            assert thread.frames[:-1] == want.frames[: max(len(thread.frames) - 1, 0)]
    if 0 < cut < len(text) and parsed.processes and parsed.processes[0].stack.threads:
        main = parsed.processes[0].stack.threads[0]
        # A cut main thread is flagged. Three cuts at a line's end cannot be told from a whole
        # stack: right after the thread line (a main thread with no Python frames, a real state
        # the analyzer reports), after a native frame (--native stacks end in native code), and
        # after an entry frame that is not the last (a script run by runpy or exec has several
        # <module> frames; a saved dump's last line often has no line end). A cut in the next line's
        # indent is such a line end too: a pasted dump may end in blanks.
        at_line_end = text[cut] == "\n" or text[:cut].rstrip(" ").endswith("\n")
        if main.frames and main.frames != proc.threads[0].frames and not main.frames[-1].native \
                and not (main.frames[-1].name in ("<module>", "_run_module_as_main", "_run_code") and at_line_end):
            assert parsed.processes[0].stack.truncated is not None


@SETTINGS
@given(st.dictionaries(st.sampled_from(["rank0.txt", "rank1.json", "rank2.log", "node-a.txt", "node_b", "x.md",
                                        "rank3.dataloader0.txt", "rank_4.out"]),
                       st.one_of(st.binary(max_size=300), st.text(max_size=300).map(str.encode),
                                 _process().map(lambda p: format_pyspy_text(p).encode())),
                       min_size=1, max_size=5))
def test_any_folder_is_loaded_or_refused_with_a_fix(tmp_path_factory: object, files: dict[str, bytes]) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for name, content in files.items():
            (Path(tmp) / name).write_bytes(content)
        try:
            snap = load_pyspy_dir(tmp)
        except RankscopeError as exc:
            assert "no py-spy dumps" in str(exc) and exc.fix
            return
        ranks = [r.rank for m in snap.machines for r in m.ranks]
        assert len(ranks) == len(set(ranks)) and all(r >= 0 for r in ranks)
        assert all(r.rank_source for m in snap.machines for r in m.ranks
                   if any(s.rank == r.rank and s.main.pid for s in m.stacks))
