"""WC of async work on host tensors (gloo): learned by the background poll asking ``is_completed()``.

No torch here: the Work is a stand-in class whose ``wait`` the shim must not
wrap (it cost every wait, torch's own included) and whose future must never
be asked for (a future's callback runs on the backend's thread and takes the
GIL from the training thread). The background thread is not started: the
tests call its poll step themselves, so nothing waits on time.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rankscope.ccl_plugin import completion, hook_state, wrappers
from rankscope.ccl_plugin import layout as L
from rankscope.ccl_plugin.hook_state import STATE
from rankscope.ccl_plugin.writer import CounterWriter
from rankscope.probes.ccl_counters import read_counter_file
from shim_paths import PATHS, fast


class Tensor:
    is_cuda = False
    nbytes = 64


class Work:
    def __init__(self) -> None:
        self.done = False

    def wait(self) -> bool:
        self.done = True  # a host Work's wait returns once the work is done
        return True

    def is_completed(self) -> bool:
        return self.done

    def get_future(self) -> Any:
        raise AssertionError("the shim must not complete through a Work's future")


_WAIT = Work.wait


def all_reduce(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> Work | None:
    return Work() if async_op else None


def isend(tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0,
          group_dst: int | None = None) -> Work:
    return Work()


@pytest.fixture(params=PATHS)
def shim(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[CounterWriter]:
    c10d = SimpleNamespace(GroupMember=SimpleNamespace(WORLD=object()), get_process_group_ranks=lambda g: [0, 1],
                           get_backend=lambda g: "gloo", Work=Work)
    saved = {k: getattr(STATE, k) for k in ("writer", "c10d", "disabled", "pending", "polling", "fast", "tls", "ring")}
    hook_state.use_fast(fast(request.param))
    w = CounterWriter(tmp_path, rank=0, world_size=2, job_id="host", fast=STATE.fast)
    STATE.writer, STATE.c10d, STATE.disabled, STATE.pending = w, c10d, False, {}
    STATE.polling = False
    STATE.wake.clear()
    try:
        yield w
    finally:
        if STATE.ring is not None:
            STATE.ring.clear()
        for k, v in saved.items():
            setattr(STATE, k, v)
        w.close()


def counts(w: CounterWriter, op: str) -> tuple[int, int, int]:
    o = next(o for o in read_counter_file(w.path).counters.ops if o.op == op)
    return (o.cl, o.wr, o.wc)


def test_an_async_collective_completes_when_the_poll_sees_it_done(shim: CounterWriter) -> None:
    wrapped = wrappers.make_wrapper("all_reduce", all_reduce)
    work = wrapped(Tensor(), async_op=True)
    assert isinstance(work, Work)
    assert counts(shim, "all_reduce") == (1, 1, 0)
    assert STATE.polling and STATE.wake.is_set()  # the poller was told: it is the one that learns completion
    assert completion.open_works() == 1
    assert completion.poll() is True  # still running: WC stays below WR (a hang inside it shows)
    assert counts(shim, "all_reduce") == (1, 1, 0)
    work.wait()
    assert Work.wait is _WAIT  # the user's wait is torch's own, untouched
    assert counts(shim, "all_reduce") == (1, 1, 0)  # nothing runs on the user's thread after the call
    assert completion.poll() is False
    assert counts(shim, "all_reduce") == (1, 1, 1) and completion.open_works() == 0
    (o,) = read_counter_file(shim.path).counters.ops
    # the poll knows that it finished, not when: no TD, no N
    assert (o.last_duration_s, o.recent_throughput, o.last_completed_seq) == (None, (), 1)
    completion.poll()  # a second look records nothing more
    assert counts(shim, "all_reduce") == (1, 1, 1)


def test_work_completes_in_any_order_through_the_poll(shim: CounterWriter) -> None:
    wrapped = wrappers.make_wrapper("all_reduce", all_reduce)
    first, second, third = (wrapped(Tensor(), async_op=True) for _ in range(3))
    assert completion.poll() is True  # all still running
    assert counts(shim, "all_reduce") == (3, 3, 0)
    second.done = True
    assert completion.poll() is True
    assert counts(shim, "all_reduce") == (3, 3, 1) and completion.open_works() == 2
    first.done = third.done = True
    assert completion.poll() is False  # nothing open: the poller may slow down
    assert counts(shim, "all_reduce") == (3, 3, 3)
    assert wrapped(Tensor()) is None  # a synchronous call is timed at its return, as before
    (o,) = read_counter_file(shim.path).counters.ops
    assert (o.wc, o.last_completed_seq, len(o.recent_throughput)) == (4, 4, 1) and o.last_duration_s is not None


class BrokenWork(Work):
    def is_completed(self) -> bool:
        raise RuntimeError("Connection closed by peer")


def test_a_work_whose_completion_check_fails_is_closed_not_left_open(shim: CounterWriter) -> None:
    wrapped = wrappers.make_wrapper("all_reduce", lambda tensor, op=None, group=None, async_op=False: BrokenWork())
    wrapped(Tensor(), async_op=True)
    assert completion.poll() is False
    assert counts(shim, "all_reduce") == (1, 1, 1) and not STATE.disabled


def test_more_open_works_than_the_ring_holds_are_still_kept(shim: CounterWriter) -> None:
    """Past the native ring's room (a long hang with async work piling up) the Works wait in the Python table."""
    wrapped = wrappers.make_wrapper("all_reduce", all_reduce)
    works = [wrapped(Tensor(), async_op=True) for _ in range(4100)]
    assert completion.open_works() == 4100 and counts(shim, "all_reduce") == (4100, 4100, 0)
    for wk in works[::2]:
        assert wk is not None
        wk.done = True
    completion.poll()
    assert counts(shim, "all_reduce") == (4100, 4100, 2050)
    for wk in works:
        assert wk is not None
        wk.done = True
    assert completion.poll() is False and counts(shim, "all_reduce") == (4100, 4100, 4100)


def test_an_isend_keeps_its_peer_open_until_waited(shim: CounterWriter) -> None:
    work = wrappers.make_wrapper("isend", isend)(Tensor(), dst=1)
    (o,) = read_counter_file(shim.path).counters.ops
    assert (o.op, o.cl, o.wr, o.wc, o.open_peers) == ("send", 1, 1, 0, (1,))
    completion.poll()
    assert read_counter_file(shim.path).counters.ops[0].open_peers == (1,)
    work.wait()
    completion.poll()
    (o,) = read_counter_file(shim.path).counters.ops
    assert (o.wc, o.open_peers) == (1, ())


def test_a_synchronous_call_on_the_host_completes_at_return(shim: CounterWriter) -> None:
    wrapped = wrappers.make_wrapper("all_reduce", all_reduce)
    for _ in range(3):
        assert wrapped(Tensor()) is None
    assert counts(shim, "all_reduce") == (3, 3, 3)
    assert completion.open_works() == 0 and not STATE.polling  # nothing for the background thread to do


class Group:
    """A process group as the shim reads one (hashed by identity, as torch's are)."""

    group_name = "pp"
    group_desc = "PIPELINE"


def test_every_argument_form_counts_on_its_own_group(shim: CounterWriter) -> None:
    """Group, payload and async_op by position or keyword: each call lands on its group's row, sync or async."""
    wrapped = wrappers.make_wrapper("all_reduce", all_reduce)
    pp = Group()
    t = Tensor()
    for _ in range(2):  # the second round goes through the wrappers' caches
        assert wrapped(t) is None
        assert wrapped(t, None, pp) is None
        assert wrapped(t, group=pp) is None
        assert wrapped(tensor=t, group=pp, async_op=False) is None
        work = wrapped(t, None, None, True)
        assert isinstance(work, Work) and not work.done
        work.wait()
        wrapped(t, None, pp, async_op=True).wait()
    completion.poll()
    got = read_counter_file(shim.path).counters
    comm_of = {i: c.comm_id for i, c in enumerate(got.communicators)}
    rows = {(c.comm_id, o.op): (o.cl, o.wr, o.wc, o.bytes_total) for c in got.communicators for o in got.ops
            if o.comm_id == c.comm_id}
    assert sorted(comm_of.values())[-1] == "pp"
    world = next(c for c in comm_of.values() if c != "pp")
    assert rows == {(world, "all_reduce"): (4, 4, 4, 4 * 64), ("pp", "all_reduce"): (8, 8, 8, 8 * 64)}
    assert not STATE.disabled


def broken(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
    raise RuntimeError("Connection closed by peer")


def test_a_failing_call_closes_its_request_and_raises_the_users_error(shim: CounterWriter) -> None:
    wrapped = wrappers.make_wrapper("all_reduce", broken)
    for _ in range(3):
        with pytest.raises(RuntimeError, match="Connection closed by peer"):
            wrapped(Tensor())
    assert counts(shim, "all_reduce") == (3, 3, 3)  # nothing left looking in flight
    assert not STATE.disabled and not STATE.tls.depth


def test_the_poller_completing_while_calls_launch_never_tears_a_slot(shim: CounterWriter) -> None:
    """The background thread's completions and the caller's launches and completions share one slot.

    Both threads store into it at once (a thread switch after every few bytecodes); a store landing inside
    another's would lose an update or leave the seq odd. The reader checks what every reader relies on.
    """
    calls = 600
    wrapped = wrappers.make_wrapper("all_reduce", all_reduce)
    done = threading.Event()

    def poller() -> None:  # the background thread's step, as fast as it can
        while not done.is_set():
            completion.poll()

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=poller)
    thread.start()
    try:
        for i in range(calls):
            work = wrapped(Tensor(), async_op=True)  # left to the poller
            assert work is not None
            work.done = True
            wrapped(Tensor())  # completed by this thread meanwhile
            if i % 50 == 0:
                (o,) = read_counter_file(shim.path).counters.ops
                assert o.cl == o.wr and o.wc <= o.wr and o.bytes_total == 64 * o.cl, o
    finally:
        done.set()
        thread.join()
        sys.setswitchinterval(switch)
    completion.poll()
    (o,) = read_counter_file(shim.path).counters.ops
    assert (o.cl, o.wr, o.wc, o.bytes_total) == (2 * calls, 2 * calls, 2 * calls, 2 * calls * 64)
    assert (o.last_launched_seq, o.last_completed_seq) == (2 * calls, 2 * calls)
    seq = L.SEQ.unpack_from(shim._mm, L.op_offset(0))[0]
    assert seq % 2 == 0 and not STATE.disabled
