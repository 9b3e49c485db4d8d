"""WC on CUDA tensors when the device finishes, not when the call returns (NCCL enqueues and returns).

No CUDA here: the tensor, the CUDA event and the Work are stand-ins with the
attributes the shim reads (``is_cuda``, ``Event().record/query``,
``is_current_stream_capturing``, ``Work.is_completed``), behind the module the
shim reaches (``STATE.cuda``), and the wrappers wrap plain functions with
torch's signatures. The background thread is not started: the tests call its
poll step themselves, so nothing waits on time.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
from rankscope.ccl_plugin import call_args, completion, group_hooks, hook_state, torch_hooks, wrappers
from rankscope.ccl_plugin.hook_state import STATE
from rankscope.ccl_plugin.writer import CounterWriter
from rankscope.probes.ccl_counters import read_counter_file
from shim_paths import PATHS, fast


class Tensor:
    def __init__(self, cuda: bool) -> None:
        self.is_cuda = cuda
        self.nbytes = 64


class Event:
    made: ClassVar[list[Event]] = []

    def __init__(self) -> None:
        self.done = False
        self.records = 0
        self.broken = False
        Event.made.append(self)

    def record(self) -> None:
        self.records += 1
        self.done = False

    def query(self) -> bool:
        if self.broken:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self.done


class Cuda:
    Event = Event
    capturing = False

    @classmethod
    def is_current_stream_capturing(cls) -> bool:
        return cls.capturing


class Work:
    def __init__(self) -> None:
        self.done = False
        self.waited = False

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> bool:
        self.waited = True  # NCCL: orders the current stream only; the device is not done
        return True

    def get_future(self) -> Any:
        # a CUDA-aware future is complete at enqueue: its callbacks run at once
        return SimpleNamespace(add_done_callback=lambda fn: fn(None))


def all_reduce(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> Work | None:
    return Work() if async_op else None


def send(tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0, group_dst: int | None = None) -> None:
    return None


def isend(tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0,
          group_dst: int | None = None) -> Work:
    return Work()


@pytest.fixture(params=PATHS)
def shim(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[CounterWriter]:
    world = object()
    c10d = SimpleNamespace(GroupMember=SimpleNamespace(WORLD=world), get_process_group_ranks=lambda g: [0, 1],
                           get_backend=lambda g: "nccl")
    saved = {k: getattr(STATE, k) for k in ("writer", "c10d", "cuda", "disabled", "groups", "device_events",
                                             "pending", "event_pool", "fast", "tls", "ring")}
    hook_state.use_fast(fast(request.param))
    w = CounterWriter(tmp_path, rank=0, world_size=2, job_id="dev", fast=STATE.fast)
    STATE.writer, STATE.c10d, STATE.cuda, STATE.disabled = w, c10d, Cuda, False
    STATE.groups, STATE.pending, STATE.event_pool = {}, {}, []
    STATE.device_events = type(STATE.device_events)()
    Cuda.capturing = False
    Event.made = []
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


def test_a_synchronous_collective_on_cuda_stays_open_until_its_event_completes(shim: CounterWriter) -> None:
    wrapped = wrappers.make_wrapper("all_reduce", all_reduce)
    wrapped(Tensor(cuda=True))
    completion.poll_device()
    assert counts(shim, "all_reduce") == (1, 1, 0)  # returned, enqueued, not finished on the device
    (ev,) = Event.made
    assert ev.records == 1
    ev.done = True
    completion.poll_device()
    assert counts(shim, "all_reduce") == (1, 1, 1)
    wrapped(Tensor(cuda=True))
    assert Event.made == [ev] and ev.records == 2  # the finished event is reused, not a new one per call
    assert counts(shim, "all_reduce") == (2, 2, 1)


def test_events_complete_in_launch_order_and_a_failed_device_closes_them(shim: CounterWriter) -> None:
    wrapped = wrappers.make_wrapper("all_reduce", all_reduce)
    for _ in range(3):
        wrapped(Tensor(cuda=True))
    first, second, third = Event.made
    second.done = third.done = True
    completion.poll_device()
    assert counts(shim, "all_reduce") == (3, 3, 0)  # the oldest is still running on the stream
    first.broken = True  # the query fails: nothing runs any more, the requests close, nothing raises
    completion.poll_device()
    assert counts(shim, "all_reduce") == (3, 3, 3)


def test_an_async_collective_on_cuda_waits_for_is_completed_not_wait_or_its_future(shim: CounterWriter) -> None:
    wrapped = wrappers.make_wrapper("all_reduce", all_reduce)
    work = wrapped(Tensor(cuda=True), async_op=True)
    assert isinstance(work, Work)
    work.wait()
    completion.poll()
    assert counts(shim, "all_reduce") == (1, 1, 0)
    work.done = True
    completion.poll()
    assert counts(shim, "all_reduce") == (1, 1, 1)
    assert completion.open_works() == 0


def test_p2p_on_cuda_keeps_its_peer_open_until_the_device_is_done(shim: CounterWriter) -> None:
    wrappers.make_wrapper("send", send)(Tensor(cuda=True), 1)
    work = wrappers.make_wrapper("isend", isend)(Tensor(cuda=True), dst=1)
    completion.poll()
    (o,) = read_counter_file(shim.path).counters.ops
    assert (o.op, o.cl, o.wr, o.wc, o.open_peers) == ("send", 2, 2, 0, (1,))
    Event.made[0].done = True
    work.done = True
    completion.poll()
    (o,) = read_counter_file(shim.path).counters.ops
    assert (o.wc, o.open_peers) == (2, ())


def test_cpu_tensors_and_graph_capture_complete_at_return(shim: CounterWriter) -> None:
    wrapped = wrappers.make_wrapper("all_reduce", all_reduce)
    wrapped(Tensor(cuda=False))
    assert counts(shim, "all_reduce") == (1, 1, 1)
    Cuda.capturing = True  # captured into a CUDA graph: nothing was launched at the call
    wrapped(Tensor(cuda=True))
    assert counts(shim, "all_reduce") == (2, 2, 2)
    assert Event.made == []


def test_the_group_records_its_size_and_this_ranks_place_for_the_nccl_join(shim: CounterWriter) -> None:
    wrappers.make_wrapper("all_reduce", all_reduce)(Tensor(cuda=True))
    (comm,) = read_counter_file(shim.path).counters.communicators
    assert (comm.backend, comm.ranks, comm.comm_nranks, comm.comm_rank) == ("nccl", (0, 1), 2, 0)


def test_a_list_payload_on_cuda_counts_as_device_work(shim: CounterWriter) -> None:
    assert call_args.on_cuda([Tensor(cuda=True)]) and not call_args.on_cuda([])
    assert not call_args.on_cuda(None) and not call_args.on_cuda((Tensor(cuda=False),))


def test_process_group_hooks_on_nccl_wait_for_the_device(shim: CounterWriter) -> None:
    """torch >= 2.14's hooks see C++-issued collectives (DDP): their NCCL Work completes on the device, not at once."""
    hooks: dict[str, Any] = {}
    group = SimpleNamespace(register_pre_hook=lambda fn: hooks.setdefault("pre", fn),
                            register_post_hook=lambda fn: hooks.setdefault("post", fn))
    group_hooks.hook_group(group, shim.comm("0", "nccl", "default_pg", (0, 1)), on_device=True)
    work = Work()
    hooks["pre"](SimpleNamespace(name="ALLREDUCE", op_id=7))
    hooks["post"](SimpleNamespace(name="ALLREDUCE", op_id=7, work=work))
    completion.poll()
    assert counts(shim, "allreduce") == (1, 1, 0)
    work.done = True
    completion.poll()
    assert counts(shim, "allreduce") == (1, 1, 1)


def test_with_our_profiler_plugin_loaded_device_work_is_counted_not_timed(shim: CounterWriter) -> None:
    """The plugin times NCCL's device work itself: the shim counts the launch, settles at return, records no TD/N."""
    STATE.plugin = True
    try:
        wrapped = wrappers.make_wrapper("all_reduce", all_reduce)
        wrapped(Tensor(cuda=True))
        work = wrapped(Tensor(cuda=True), async_op=True)
        assert isinstance(work, Work) and not work.done
        assert counts(shim, "all_reduce") == (2, 2, 2)
        assert Event.made == [] and completion.open_works() == 0 and len(STATE.device_events) == 0
        (o,) = read_counter_file(shim.path).counters.ops
        assert (o.bytes_total, o.recent_throughput, o.last_complete_wall, o.last_duration_s) == (128, (), None, None)
        wrapped(Tensor(cuda=False))  # host tensors are still the shim's to time
        (o,) = read_counter_file(shim.path).counters.ops
        assert o.wc == 3 and len(o.recent_throughput) == 1 and o.last_complete_wall is not None
        assert o.last_duration_s is not None
    finally:
        STATE.plugin = False


def test_the_plugin_is_recognised_by_its_library_name() -> None:
    assert torch_hooks.plugin_loaded({"NCCL_PROFILER_PLUGIN": "/c/librankscope_nccl_profiler-3f2a.so"})
    assert not torch_hooks.plugin_loaded({"NCCL_PROFILER_PLUGIN": "/usr/lib/libnccl-profiler-inspector.so"})
    assert not torch_hooks.plugin_loaded({})


def test_two_polls_at_once_settle_each_finished_call_once(shim: CounterWriter) -> None:
    """The background thread and a second poller (the exit's, a benchmark's) at the same time: on the H200 both
    took the same finished event from the queue and the second pop raised. The first poller's query waits (up to a
    second) for the second to reach the same query; one pass at a time, it never does."""
    import contextlib
    import threading

    wrapped = wrappers.make_wrapper("all_reduce", all_reduce)
    wrapped(Tensor(cuda=True))
    (ev,) = Event.made
    both = threading.Barrier(2, timeout=1.0)

    def query() -> bool:
        with contextlib.suppress(threading.BrokenBarrierError):
            both.wait()
        return True

    ev.query = query  # type: ignore[method-assign]
    errors: list[BaseException] = []

    def poller() -> None:
        try:
            completion.poll()
        except BaseException as exc:  # what the background thread would have died of
            errors.append(exc)

    threads = [threading.Thread(target=poller) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors, errors
    assert counts(shim, "all_reduce") == (1, 1, 1)
