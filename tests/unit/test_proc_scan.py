"""The /proc reading that discovery runs in every poll: a stat line whatever a process calls itself, the
environment keys, and the scan of this very machine against psutil's view of it."""

from __future__ import annotations

import os

import psutil
from hypothesis import given
from hypothesis import strategies as st
from rankscope.probes.discovery import _ENV_KEYS, _environment, _scan, parse_stat

_ENV_CHARS = st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00")
# What the kernel writes after the name: state, ppid, and the rest of the 52 fields.
_TAIL = " 0 0 0 0 -1 4194560 100 0 0 0 5 3 0 0 20 0 1 0 12345 1000 200"


@given(pid=st.integers(1, 4_194_304), name=st.text(max_size=64).filter(lambda n: "\x00" not in n),
       state=st.sampled_from("RSDZTtXIPW"), ppid=st.integers(0, 4_194_304))
def test_a_stat_line_is_read_whatever_the_process_calls_itself(pid: int, name: str, state: str, ppid: int) -> None:
    # A name may hold brackets, spaces and newlines ("(sd-pam)", "a) S 1 (b"): the last ")" ends it.
    assert parse_stat(f"{pid} ({name}) {state} {ppid}{_TAIL}") == (name, state, ppid)


@given(st.text(max_size=200))
def test_anything_else_is_no_stat_line_and_never_raises(raw: str) -> None:
    parsed = parse_stat(raw)
    if parsed is not None:
        name, _state, ppid = parsed
        assert f"({name})" in raw and ppid >= 0


@given(st.dictionaries(st.text(_ENV_CHARS.filter(lambda c: c != "="), min_size=1, max_size=12),
                       st.text(_ENV_CHARS, max_size=20), max_size=8),
       st.dictionaries(st.sampled_from(_ENV_KEYS), st.text(_ENV_CHARS, max_size=20)))
def test_the_environment_keeps_exactly_the_keys_read(noise: dict[str, str], wanted: dict[str, str]) -> None:
    entries = {**noise, **wanted}
    raw = b"\0".join(f"{k}={v}".encode() for k, v in entries.items()) + b"\0"
    kept = {k: v for k, v in entries.items() if k in _ENV_KEYS}
    if any("RANK" in k for k in kept):  # a rank's variables or a declared role: every key read is kept
        assert _environment(raw) == kept
    if "RANK" not in "".join(f"{k}={v}" for k, v in entries.items()):
        assert _environment(raw) == {}  # nothing of a rank (MASTER_ADDR alone makes none): not even parsed


@given(st.binary(max_size=300))
def test_any_environment_bytes_are_read_without_raising(raw: bytes) -> None:
    assert set(_environment(raw)) <= set(_ENV_KEYS)


def test_the_scan_sees_this_machine_as_psutil_does() -> None:
    child = psutil.Popen(["sleep", "30"], env={**os.environ, "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8",
                                               "RANKSCOPE_ROLE": "checkpoint"})
    try:
        procs, _skipped = _scan()
        seen = procs[child.pid]
        assert (seen.ppid, seen.name, seen.uid) == (os.getpid(), "sleep", os.geteuid())
        assert seen.cmdline == ("sleep", "30")
        assert seen.env == {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "RANKSCOPE_ROLE": "checkpoint"}
        assert seen.rank == 5 and seen.is_rank_candidate
        assert procs[os.getpid()].env == {}  # rankscope itself is never a rank
        for pid in (1, os.getpid(), child.pid):  # long-lived: psutil reads the same of them
            known = psutil.Process(pid)
            assert (procs[pid].ppid, procs[pid].name) == (known.ppid(), known.name()[:15])
        # The owner and command line are read of what claims a rank and of its parent (the claim check reads
        # them), not of every process of the machine.
        assert procs[os.getpid()].uid == os.geteuid() and procs[os.getpid()].cmdline == tuple(psutil.Process().cmdline())
        if not any("RANK" in q.env for q in procs.values() if q.pid != child.pid and q.ppid in (0, 1)):
            assert procs[1].uid == -1 and procs[1].cmdline == ()
    finally:
        child.kill()
        child.wait()
