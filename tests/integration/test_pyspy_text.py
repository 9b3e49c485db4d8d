"""py-spy's text output read for real: captures of live processes by the real py-spy, each way it prints.

The same parked processes are dumped as text (plain, --native, --locals,
both, several concatenated like `xargs -n1 py-spy dump --pid`) and as JSON
through the agent's own path, and the text reader must give the frames the
JSON reader gives. Failures (a stopped process, a gone pid, a non-Python
process) are py-spy's real words.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from agent_helpers import wait_ready_file
from rankscope.cli.main import main
from rankscope.contract.errors import RankscopeError
from rankscope.contract.snapshot import CaptureErrorKind, JobSnapshot, ProcessRole, ProcessStack
from rankscope.formats.pyspy_dir import load_pyspy_dir
from rankscope.probes.pyspy import dump_process, pyspy_binary
from rankscope.probes.pyspy_text import parse_pyspy_text
from repo_paths import FIG7, external

TARGET = """
import os, sys, threading, time
def helper_waits(event):
    event.wait()
def hold_in_named_function(release, payload):
    while not os.path.exists(release):
        time.sleep(0.05)
event = threading.Event()
threading.Thread(target=helper_waits, args=(event,), name="helper thread", daemon=True).start()
open(sys.argv[2], "w").close()
hold_in_named_function(sys.argv[1], {"k": 1})
"""


@dataclass
class Captures:
    pids: list[int]
    text: dict[str, str]  # mode -> py-spy's stdout for pids[0]
    concatenated: str  # `xargs -n1 py-spy dump --pid` over all pids
    json_stacks: ProcessStack  # the agent's JSON capture of pids[0]


def _spy(*args: str) -> subprocess.CompletedProcess[str]:
    binary = pyspy_binary()
    assert binary is not None, "py-spy is part of the test environment"
    return subprocess.run([binary, "dump", *args], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, RUST_BACKTRACE="0"))


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Three parked Python processes whose command lines carry --local_rank 2, 0, 1."""
    tmp = tmp_path_factory.mktemp("targets")
    procs = []
    try:
        for local in (2, 0, 1):
            ready = tmp / f"ready{local}"
            proc = subprocess.Popen([sys.executable, "-c", TARGET, str(tmp / "release"), str(ready),
                                     f"--local_rank={local}"])
            procs.append(proc)
            wait_ready_file(ready, proc, 60)
        yield procs
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def captures(targets: list[subprocess.Popen[bytes]]) -> Captures:
    pid = targets[0].pid
    text = {}
    for mode, flags in (("plain", ()), ("native", ("--native",)), ("locals", ("--locals",)),
                        ("native+locals", ("--native", "--locals"))):
        out = _spy("--pid", str(pid), *flags)
        assert out.returncode == 0, out.stderr
        text[mode] = out.stdout
    pids = "\n".join(str(t.pid) for t in targets)
    binary = pyspy_binary()
    concatenated = subprocess.run(f"xargs -n1 {binary} dump --pid", shell=True, input=pids, capture_output=True,
                                  text=True, timeout=120, check=True).stdout
    json_stacks = asyncio.run(dump_process(pid, ProcessRole.MAIN, timeout_s=60))
    return Captures([t.pid for t in targets], text, concatenated, json_stacks)


def _python_frames(stack: ProcessStack, thread: str) -> list[tuple[str, str, int | None]]:
    assert stack.threads is not None
    frames = next(t.frames for t in stack.threads if t.thread_name == thread)
    return [(f.name, f.filename.rsplit("/", 1)[-1], f.line) for f in frames if not f.native]


@pytest.mark.parametrize("mode", ["plain", "native", "locals", "native+locals"])
def test_text_gives_the_frames_the_json_capture_gives(captures: Captures, mode: str) -> None:
    parsed = parse_pyspy_text(captures.text[mode])
    assert parsed.problems == ()
    [proc] = parsed.processes
    stack = proc.stack
    assert stack.pid == captures.pids[0] and stack.error is None and stack.truncated is None
    assert proc.cmdline is not None and proc.cmdline.endswith("--local_rank=2")
    assert proc.python is not None and proc.python.startswith(f"{sys.version_info.major}.{sys.version_info.minor}")
    for thread in ("MainThread", "helper thread"):
        assert _python_frames(stack, thread) == _python_frames(captures.json_stacks, thread)
    main = next(t for t in stack.threads or () if t.thread_name == "MainThread")
    assert main.os_thread_id == captures.pids[0] and main.thread_id == captures.pids[0]
    assert [f.name for f in main.frames if not f.native][:2] == ["hold_in_named_function", "<module>"]
    # --locals values (`release: "..."`, `payload: {"k": 1}`) are never taken for frames
    assert not any("payload" in f.name or "release" in f.name for t in stack.threads or () for f in t.frames)
    native = [f for t in stack.threads or () for f in t.frames if f.native]
    if "native" in mode:
        assert native and all(f.module and f.line is None for f in native)
        assert not any(f.name.startswith("0x") for f in native)  # addresses are not kept
    else:
        assert native == []


def test_concatenated_processes_are_each_read_with_their_header(captures: Captures) -> None:
    parsed = parse_pyspy_text(captures.concatenated)
    assert parsed.problems == ()
    assert [p.stack.pid for p in parsed.processes] == captures.pids
    assert [p.cmdline.rsplit(" ", 1)[-1] for p in parsed.processes if p.cmdline] == [
        "--local_rank=2", "--local_rank=0", "--local_rank=1"]
    assert all(p.stack.error is None and len(p.stack.threads or ()) == 2 for p in parsed.processes)


def test_a_dump_cut_mid_line_keeps_what_it_holds_and_is_flagged(captures: Captures) -> None:
    text = captures.text["plain"]
    cut = text[: text.index("<module>") + 3]  # ends inside the main thread's last frame
    [proc] = parse_pyspy_text(cut).processes
    assert proc.stack.truncated is not None and "mid-line" in proc.stack.truncated
    assert _python_frames(proc.stack, "MainThread")[0][0] == "hold_in_named_function"
    # the same dump cut at a line end, above the program's entry: flagged from the main thread's stack
    lines = text.splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if "<module>" in line)
    [proc] = parse_pyspy_text("".join(lines[:at])).processes
    assert proc.stack.truncated is not None and "hold_in_named_function" in proc.stack.truncated


def test_a_header_cut_inside_its_pid_is_not_read_as_another_process() -> None:
    # Found by hypothesis: "Process 10: python train.py" cut after "Process 1" read as a process with pid 1.
    whole = 'Process 10: python train.py\nPython v3.11.7 (/usr/bin/python3.11)\n\nThread 10 (idle): "MainThread"\n'
    assert [p.stack.pid for p in parse_pyspy_text(whole).processes] == [10]
    assert [p.stack.pid for p in parse_pyspy_text(whole[:len("Process 1")]).processes] == []


def test_stopped_process_is_a_gap_with_pyspys_words(targets: list[subprocess.Popen[bytes]]) -> None:
    pid = targets[2].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        out = _spy("--pid", str(pid))
    finally:
        os.kill(pid, signal.SIGCONT)
    assert out.returncode != 0
    [both] = parse_pyspy_text(out.stdout + out.stderr).processes  # `2>&1`: header, then the error
    assert both.stack.pid == pid and both.stack.threads is None and both.stack.error is not None
    assert both.stack.error.kind is CaptureErrorKind.FAILED
    assert "Failed to suspend process" in both.stack.error.message and f"kill -CONT {pid}" in both.stack.error.fix
    [header_only] = parse_pyspy_text(out.stdout).processes  # stdout alone: the error went to stderr
    assert header_only.stack.pid == pid and header_only.stack.threads is None
    assert header_only.stack.error is not None and "stderr" in header_only.stack.error.message


def test_gone_and_non_python_processes_are_classified() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    gone = _spy("--pid", str(proc.pid))
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        native = _spy("--pid", str(sleeper.pid))
    finally:
        sleeper.kill()
        sleeper.wait(timeout=30)
    text = f"$ py-spy dump --pid {proc.pid}\n{gone.stderr}$ py-spy dump --pid {sleeper.pid}\n{native.stderr}"
    parsed = parse_pyspy_text(text)
    assert parsed.problems == ()
    assert [(p.stack.pid, p.stack.error.kind if p.stack.error else None) for p in parsed.processes] == [
        (proc.pid, CaptureErrorKind.GONE), (sleeper.pid, CaptureErrorKind.NOT_PYTHON)]
    assert parsed.processes[1].stack.error is not None
    assert parsed.processes[1].stack.error.message == "Error: Failed to find python version from target process"


def test_rust_backtrace_is_skipped_not_reported() -> None:
    stderr = ("Error: Failed to find python version from target process\n\nStack backtrace:\n"
              "   0: anyhow::error::<impl anyhow::Error>::msg\n   1: py_spy::main\n"
              "             at /rustc/src/main.rs:12:5\n")
    parsed = parse_pyspy_text(stderr)
    assert parsed.problems == () and len(parsed.processes) == 1


@pytest.mark.parametrize(("line", "tid", "os_tid", "active", "gil", "name"), [
    ('Thread 688510 (active): "MainThread"', 688510, 688510, True, False, "MainThread"),
    ('Thread 0x7F2B9A0A4740 (active+gil): "MainThread"', 0x7F2B9A0A4740, None, True, True, "MainThread"),
    ('Thread 0x0 (idle): "MainThread"', 0, None, False, False, "MainThread"),
    ("Thread 12 (idle)", 12, 12, False, False, None),
])
def test_thread_lines(line: str, tid: int, os_tid: int | None, active: bool, gil: bool, name: str | None) -> None:
    [proc] = parse_pyspy_text(f"{line}\n    f (a.py:1)\n    <module> (a.py:2)\n").processes
    [thread] = proc.stack.threads or ()
    assert (thread.thread_id, thread.os_thread_id, thread.active, thread.owns_gil, thread.thread_name) == (
        tid, os_tid, active, gil, name)
    assert [f.name for f in thread.frames] == ["f", "<module>"]


def test_a_paste_without_headers_splits_at_each_main_thread() -> None:
    text = ('Thread 11 (active): "MainThread"\n    a (x.py:1)\n    <module> (x.py:2)\n'
            'Thread 14 (idle): "helper"\n    b (x.py:3)\n'
            'Thread 21 (active): "MainThread"\n    c (x.py:4)\n    <module> (x.py:5)\n')
    procs = parse_pyspy_text(text).processes
    assert [p.stack.pid for p in procs] == [11, 21]  # a main thread's OS id is its process id
    assert [len(p.stack.threads or ()) for p in procs] == [2, 1]


def test_garbage_lines_are_quoted_not_dropped() -> None:
    parsed = parse_pyspy_text('hello\nThread 5 (idle): "MainThread"\n    f (a.py:1)\n\tzzz\n    <module> (a.py:2)\n')
    assert parsed.problems == ("line 1 is not py-spy output: 'hello'", "line 4 is not py-spy output: 'zzz'")
    assert [f.name for f in (parsed.processes[0].stack.threads or ())[0].frames] == ["f", "<module>"]


# --------------------------------------------------------------------------
# The loader: folders and pasted files of saved dumps, through `rankscope analyze`
# --------------------------------------------------------------------------

# The public incidents sit in ../shared/external beside the repository (a worktree: a level further up).
EXTERNAL = external() or Path("../shared/external")


def _ranks(snapshot: JobSnapshot) -> dict[int, tuple[str, int, str | None]]:
    """rank -> (machine, pid, rank_source)"""
    return {r.rank: (m.machine, r.pid, r.rank_source) for m in snapshot.machines for r in m.ranks}


def test_node_file_numbers_ranks_from_the_command_line(captures: Captures, tmp_path: Path) -> None:
    (tmp_path / "node0.txt").write_text(captures.concatenated)
    snap = load_pyspy_dir(tmp_path)
    ranks = _ranks(snap)
    assert {r: v[1] for r, v in ranks.items()} == {2: captures.pids[0], 0: captures.pids[1], 1: captures.pids[2]}
    assert {v[0] for v in ranks.values()} == {"node0"}  # one file per node = one machine
    assert ranks[2][2] == "cmdline: --local_rank=2 in node0.txt, node #0 by file-name order (first rank 0)"


def test_node_files_without_local_rank_go_by_pid_order_and_node_order(captures: Captures, tmp_path: Path) -> None:
    text = captures.concatenated.replace("--local_rank=", "--seed=")
    (tmp_path / "b-node.txt").write_text(text)
    (tmp_path / "a-node.txt").write_text(text.replace("Process ", "Process 9"))  # other pids, same order
    snap = load_pyspy_dir(tmp_path, node_order=["b-node", "a-node.txt"])
    ranks = _ranks(snap)
    ordered = sorted(captures.pids)
    assert [ranks[r][:2] for r in range(3)] == [("b-node", pid) for pid in ordered]
    assert [ranks[r][1] for r in range(3, 6)] == [int(f"9{pid}") for pid in ordered]
    assert all(ranks[r][2].startswith("pid-order: ") and "by --node-order" in ranks[r][2] for r in range(6))
    with pytest.raises(RankscopeError, match="--node-order names c-node"):
        load_pyspy_dir(tmp_path, node_order=["c-node"])


def test_headerless_paste_goes_by_file_order(tmp_path: Path) -> None:
    text = "".join(f'Thread 0x0 (active): "MainThread"\n    f{i} (a.py:1)\n    <module> (a.py:2)\n' for i in range(3))
    (tmp_path / "paste.txt").write_text(text)
    ranks = _ranks(load_pyspy_dir(tmp_path / "paste.txt"))  # a single pasted file
    assert sorted(ranks) == [0, 1, 2] and all(v[2] and v[2].startswith("file-order: ") for v in ranks.values())


def test_mixed_folder_json_and_text_garbage_named(captures: Captures, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    for f in FIG7.glob("rank*.json"):
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "rank5.json").unlink()
    (tmp_path / "rank5.txt").write_text(captures.text["plain"])
    (tmp_path / "rank7.json").unlink()
    (tmp_path / "rank7.txt").write_text("Process 77: python train.py\nPython v3.11.7 (/usr/bin/python3)\n\n"
                                        "Error: Failed to suspend process\nReason: EPERM: Operation not permitted\n")
    (tmp_path / "notes.md").write_text("# what we saw\nthe job hung at step 40\n")
    (tmp_path / "core").write_bytes(b"\x7fELF\0\0\0binary")
    code = main(["analyze", str(tmp_path), "--tp", "2", "--pp", "4", "--dp", "4", "--order", "tp-pp-dp",
                 "--ranks-per-machine", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["world_size"] == 32
    assert out["missing_ranks"] == [7]
    assert {a["rank"]: a["pid"] for a in out["rank_assignment"]}[5] == captures.pids[0]
    assert all(a["rule"] == "file-name" for a in out["rank_assignment"])
    notes = "\n".join(out["notes"])
    assert "notes.md: not a py-spy dump" in notes and "core: not a py-spy dump (binary content)" in notes
    assert "could not be seen: 7 — permission: Error: Failed to suspend process" in notes


@pytest.mark.parametrize(("folder", "world", "unreadable"), [
    ("bloom176b-eval-hang-2022-04-30", 16, []),
    ("m4-64gpu-rank0-unresponsive-2023-03-04", 64, [0]),
    ("biom3-aurora-ddp-extra-batch-2026-04", 12, []),
])
def test_public_incidents_are_read_as_they_are(folder: str, world: int, unreadable: list[int],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["analyze", str(EXTERNAL / folder)])
    text = capsys.readouterr().out
    assert code == 0
    assert f"rank(s) 0-{world - 1}: file-name (rank 0, pid " in text
    assert "note: SOURCE.md: not a py-spy dump" in text
    snap = load_pyspy_dir(EXTERNAL / folder)
    assert snap.world_size == world
    stacks = {s.rank: s.main for m in snap.machines for s in m.stacks}
    assert [r for r, s in stacks.items() if s.threads is None] == unreadable
    if folder.startswith("m4"):
        err = stacks[0].error
        assert err is not None and err.kind is CaptureErrorKind.PERMISSION and stacks[0].pid == 280058
        assert err.message.startswith("Error: Failed to suspend process Reason: EPERM")
        assert "could not see ranks: 0" in text
        # the posted stacks are the top 3 frames only: read for what they hold, and flagged
        assert all(s.truncated and "wait_for_everyone" in s.truncated for r, s in stacks.items() if r)
        assert [f.name for f in (stacks[9].threads or ())[0].frames] == ["barrier", "wait_for_everyone",
                                                                         "wait_for_everyone"]
    if folder.startswith("bloom"):
        assert stacks[0].pid == 688510 and all(s.truncated is None for s in stacks.values())
        assert len((stacks[0].threads or ())[0].frames) == 10


def test_dataloader_workers_in_a_node_file_join_their_rank_and_shift_nothing(tmp_path: Path) -> None:
    def proc(pid: int, local: int, frames: str) -> str:
        return (f"Process {pid}: python train.py --local_rank={local}\nPython v3.11.7 (/usr/bin/python3)\n\n"
                f'Thread {pid} (active): "MainThread"\n{frames}    <module> (train.py:9)\n')
    worker = "    select (selectors.py:415)\n    _worker_loop (torch/utils/data/_utils/worker.py:308)\n"
    rank = "    all_reduce (torch/distributed/distributed_c10d.py:2050)\n"
    # pgrep order: rank 1's worker (forked, so the same command line) sits between the ranks
    text = proc(100, 0, rank) + proc(105, 1, worker) + proc(101, 1, rank) + proc(107, 9, worker)
    (tmp_path / "node0.txt").write_text(text)
    snap = load_pyspy_dir(tmp_path)
    stacks = {s.rank: s for m in snap.machines for s in m.stacks}
    assert sorted(stacks) == [0, 1] and (stacks[0].main.pid, stacks[1].main.pid) == (100, 101)
    assert [(p.pid, p.role) for p in stacks[1].subprocesses] == [(105, ProcessRole.DATALOADER)]
    assert stacks[0].subprocesses == ()
    assert any("worker(s) pid 107 not given to any rank" in n for n in snap.notes)
