"""Hand-abridged py-spy pastes: a `Process N:` header with no `Thread` line, frames after `...`, a note after a frame,
one stack "identical on all N ranks".

The public incidents show why: the m4 64-GPU hang (../shared/external/m4-64gpu-rank0-unresponsive-2023-03-04,
huggingface/m4-logs) and the BioM3 DDP hang (addison-nm/BioM3-dev post-mortem) posted only the top frames of one
representative stack, said to be what every rank showed.
"""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from rankscope.formats.pyspy_dir import load_pyspy_dir
from rankscope.probes.pyspy_text import parse_pyspy_text

_FRAMES = ["wait (torch/distributed/distributed_c10d.py:2050)", "all_reduce (torch/distributed/distributed_c10d.py:1900)",
           "train_step (train.py:120)", "<module> (train.py:300)"]
_NOTES = ["  ← stuck here", "   # 卡在这里", "  <-- hangs", "\t(hängt hier)", ""]


def test_header_with_frames_is_the_main_thread_and_the_cut_is_flagged() -> None:
    text = ("Process 4242: python train.py --local_rank=1\nPython v3.10.12 (/usr/bin/python3.10)\n\n"
            "    ... wait (torch/distributed/distributed_c10d.py:2050)   ← stuck here\n"
            "    all_reduce (torch/distributed/distributed_c10d.py:1900)  # 卡在这里\n    ...\n"
            "    <module> (train.py:300)\n")
    parsed = parse_pyspy_text(text)
    (proc,) = parsed.processes
    assert proc.stack.error is None and proc.stack.threads is not None
    (thread,) = proc.stack.threads
    assert thread.thread_name == "MainThread" and thread.os_thread_id == 4242
    assert [f.name for f in thread.frames] == ["wait", "all_reduce", "<module>"]
    assert proc.stack.truncated is not None and "left out by hand" in proc.stack.truncated
    assert parsed.problems == ()


def test_one_stack_identical_on_all_ranks_stands_for_each(tmp_path: Path) -> None:
    (tmp_path / "paste.txt").write_text("py-spy dump, identical on all 8 ranks:\nProcess 4242: python train.py\n"
                                        "    ... wait (torch/distributed/distributed_c10d.py:2050)\n"
                                        "    train_step (train.py:120)\n")
    snap = load_pyspy_dir(tmp_path)
    assert sorted(snap.all_stacks()) == list(range(8))
    assert any("stands for all 8 ranks" in n for n in snap.notes)
    (tmp_path / "paste.txt").write_text("identical on all ranks\nProcess 4242: python train.py\n"
                                        "    train_step (train.py:120)\n")
    snap = load_pyspy_dir(tmp_path)
    assert sorted(snap.all_stacks()) == [0] and any("not how many ranks" in n for n in snap.notes)


@settings(max_examples=200, deadline=None)
@given(frames=st.lists(st.tuples(st.sampled_from(_FRAMES), st.sampled_from(_NOTES), st.booleans()), min_size=1,
                       max_size=6),
       header=st.booleans(), dots=st.lists(st.integers(0, 6), max_size=2), cut=st.integers(0, 400))
def test_abridged_pastes_are_read_never_raise(frames: list[tuple[str, str, bool]], header: bool, dots: list[int],
                                              cut: int) -> None:
    lines = [("    ... " if elided else "    ") + f + note for f, note, elided in frames]
    for at in dots:
        lines.insert(min(at, len(lines)), "    ...")
    text = ("Process 77: python train.py\n" if header else "") + "\n".join(lines) + "\n"
    whole = parse_pyspy_text(text)
    if header:
        (proc,) = whole.processes
        assert proc.stack.threads is not None and len(proc.stack.threads[0].frames) == len(frames)
    parse_pyspy_text(text[:cut])  # a paste cut anywhere is read for what it holds
