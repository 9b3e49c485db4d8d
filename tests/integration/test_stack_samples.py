"""The sampled-stack straggler test: classification, py-spy's collapsed output, the statistics, the probe.

The statistics are checked on constructed windows (a straggler's confidence
must grow with samples; systematic differences of a healthy job must never
become significant however many samples pile up); the probe on a real
process sampled by real py-spy; the parser with hypothesis.
"""

from __future__ import annotations

import asyncio
import math
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rankscope.analyzers.failslow import FailSlowDetector
from rankscope.analyzers.stack_samples import (
    SampledWaitDetector,
    binom_cdf,
    find_stragglers,
    null_share,
    rank_waits,
    sampling_problems,
    wilson_lower,
)
from rankscope.contract.collapsed import parse_collapsed
from rankscope.contract.frames import CLASSES, classify
from rankscope.contract.snapshot import (
    CaptureErrorKind,
    Instant,
    JobSnapshot,
    Layout,
    MachineSnapshot,
    RankInfo,
    StackSampleWindow,
)
from rankscope.probes.sampler import StackSampler
from rankscope.wire.identity import container_id, machine_identity

# ---- classification and parsing --------------------------------------------------


@pytest.mark.parametrize(("frames", "kind"), [
    (["all_reduce (torch/distributed/distributed_c10d.py)", "train_step (train.py)"], "collective"),
    (["wrapper (torch/distributed/c10d_logger.py)", "all_reduce (torch/distributed/distributed_c10d.py)"], "collective"),
    (["recv (torch/distributed/distributed_c10d.py)", "forward (model.py)"], "p2p"),
    (["_next_data (torch/utils/data/dataloader.py)", "__next__ (torch/utils/data/dataloader.py)", "main (train.py)"],
     "data"),
    (["_call_impl (torch/nn/modules/module.py)", "main (train.py)"], "compute"),
    (["backward (torch/_tensor.py)", "main (train.py)"], "compute"),
    (["save (checkpoint.py)", "main (train.py)"], "other"),
    ([], "other"),
])
def test_classify_by_the_innermost_frame_that_says_something(frames: list[str], kind: str) -> None:
    assert classify(frames) == kind


RAW = """\
thread (4242): MainThread;<module> (train.py);main (train.py);all_reduce (torch/distributed/distributed_c10d.py) 7
thread (4242): MainThread;<module> (train.py);main (train.py);forward (model.py) 3
thread (4242): MainThread;<module> (train.py);main (train.py);recv (torch/distributed/distributed_c10d.py) 2
thread (4300): Thread-1;Thread._bootstrap (threading.py);run (threading.py);all_reduce (torch/distributed/distributed_c10d.py) 40
thread (4301) 5
thread (4302);BackwardCFunction.apply (torch/autograd/function.py);backward (torch/_tensor.py) 9
"""


def test_parse_counts_the_main_thread_only() -> None:
    """Also past a thread without a name (autograd's device thread on the H200 drill: 'thread (1565);Backward...'),
    which once made the whole window unreadable and silenced the wait test on every GPU rank."""
    counts = parse_collapsed(RAW, 4242)
    assert counts == {"collective": 7, "p2p": 2, "compute": 3, "data": 0, "other": 0}
    assert parse_collapsed(RAW, 4302) == {"collective": 0, "p2p": 0, "compute": 9, "data": 0, "other": 0}


def test_parse_finds_main_thread_by_name_when_tids_are_python_ids() -> None:
    assert parse_collapsed(RAW, 1)["collective"] == 7


@pytest.mark.parametrize("bad", ["garbage", "thread (12): a;b notanumber", "process 12: a 3", "thread (x): a 3"])
def test_parse_rejects_unknown_lines_with_the_line(bad: str) -> None:
    with pytest.raises(ValueError, match="line 1"):
        parse_collapsed(bad, 12)


# Frames as py-spy prints them: a name, a space, the file in parentheses; names may hold any printable text.
frame_text = st.builds(lambda name, file: f"{name} ({file})",
                       st.text(st.characters(whitelist_categories=("L", "N", "P", "S"), blacklist_characters=";"),
                               min_size=1, max_size=20),
                       st.sampled_from(["train.py", "torch/distributed/distributed_c10d.py",
                                        "torch/utils/data/dataloader.py", "torch/nn/modules/module.py"]))


@given(st.lists(st.tuples(st.sampled_from([7, 8, 9]), st.lists(frame_text, max_size=5), st.integers(1, 50),
                          st.booleans()), max_size=12))
@settings(max_examples=200, deadline=None)
def test_parse_well_formed_lines_count_every_main_thread_sample(lines: list[tuple[int, list[str], int, bool]]) -> None:
    text = "\n".join((f"thread ({tid}): T{tid};{';'.join(fs)} {n}" if named else f"thread ({tid});{';'.join(fs)} {n}")
                     if fs else f"thread ({tid}) {n}" for tid, fs, n, named in lines)
    counts = parse_collapsed(text, 7)
    assert set(counts) == set(CLASSES)
    assert sum(counts.values()) == sum(n for tid, _, n, _named in lines if tid == 7)


@given(st.text(max_size=300))
@settings(max_examples=300, deadline=None)
def test_parse_any_text_gives_counts_or_a_value_error(text: str) -> None:
    try:
        counts = parse_collapsed(text, 1)
    except ValueError as exc:
        assert "line" in str(exc)
    else:
        assert all(v >= 0 for v in counts.values())


# ---- statistics ----------------------------------------------------------------


def test_binomial_cdf_matches_direct_sums() -> None:
    for n, p in ((10, 0.3), (50, 0.9), (200, 0.05)):
        for k in (0, 1, n // 3, n - 1, n):
            direct = sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))
            assert binom_cdf(k, n, p) == pytest.approx(direct, rel=1e-9, abs=1e-300)
    assert binom_cdf(-1, 5, 0.5) == 0.0 and binom_cdf(3, 5, 0.0) == 1.0 and binom_cdf(3, 5, 1.0) == 0.0


def test_wilson_lower_bound_is_below_the_share_and_tightens_with_n() -> None:
    assert wilson_lower(0, 0) == 0.0
    a, b = wilson_lower(90, 100), wilson_lower(900, 1000)
    assert a < b < 0.9


def test_null_share_keeps_margin_in_odds_and_in_points() -> None:
    assert null_share(0.97, 0.25, 0.2) == pytest.approx(0.77)  # 20 points below: odds would allow 0.89
    assert null_share(0.4, 0.25, 0.2) == pytest.approx(0.1429, abs=1e-3)  # a quarter of the odds
    assert null_share(0.0, 0.25, 0.2) == 0.0 and null_share(1.0, 0.25, 0.2) == 0.8


def windows(shares: dict[int, float], n_windows: int, per_window: int = 15, seed: int = 3, t0: float = 1000.0,
            ) -> list[StackSampleWindow]:
    """Seeded windows of 3 s: each rank waits with its share, the rest is compute."""
    rng = random.Random(seed)
    out = []
    for i in range(n_windows):
        for r, p in shares.items():
            wait = sum(rng.random() < p for _ in range(per_window))
            out.append(StackSampleWindow(r, 100 + r, t0 + 3 * i, t0 + 3 * i + 3, collective=wait,
                                         compute=per_window - wait))
    return out


def test_a_straggler_is_named_with_confidence_that_grows_with_samples() -> None:
    shares = {r: 0.9 for r in range(8)} | {5: 0.35}
    p_values = []
    for n in (2, 4, 8):
        found = find_stragglers(rank_waits(windows(shares, n)))
        assert found and found[0].rank == 5
        p_values.append(found[0].p_value)
        assert all(s.p_value > 0.5 for s in found[1:])
    assert p_values[0] > p_values[1] > p_values[2] and p_values[2] < 1e-6


def test_a_rank_one_and_a_half_times_slow_is_named_within_a_minute_of_samples() -> None:
    """Peers that waited 88 % of a healthy step wait 1 - 0.12/1.5 = 92 % once one rank takes 1.5x as long;
    that rank waits 0.88/1.5 = 59 % (a 33-point gap, 1 - 1/1.5). 45 s of 5 Hz samples name it; the margins
    before this change (a fifth of the odds, 25 points) needed about three times as many samples."""
    waiting = {r: 207 for r in range(8)} | {2: 132}  # of 225 samples (45 s at 5 Hz): 92 % and 59 %
    ws = [StackSampleWindow(r, 100 + r, 1000.0, 1045.0, collective=k, compute=225 - k) for r, k in waiting.items()]
    found = find_stragglers(rank_waits(ws))
    assert found and found[0].rank == 2 and found[0].p_value <= 0.001, [(s.rank, s.p_value) for s in found]
    assert all(s.p_value > 0.5 for s in found[1:])


@pytest.mark.parametrize("shares", [
    {r: 0.93 for r in range(8)} | {3: 0.86, 1: 0.94},  # the drill healthy and watched: 86-94 %
    {r: 0.97 for r in range(8)} | {2: 0.9},  # a saturated machine: 90 % against 97 %
    {r: 0.4 if r % 4 < 2 else 0.3 for r in range(8)},  # two pipeline stages waiting 40 % and 30 %
    {r: 0.05 for r in range(8)},  # nobody waits: nothing to blame
])
def test_systematic_healthy_differences_never_become_significant(shares: dict[int, float]) -> None:
    found = find_stragglers(rank_waits(windows(shares, 200)))  # ten minutes of samples
    assert all(s.p_value > 0.01 for s in found), [(s.rank, s.p_value) for s in found]


def test_detector_keeps_each_window_once_and_only_the_horizon() -> None:
    det = SampledWaitDetector(horizon_s=30.0)
    ws = windows({0: 0.5, 1: 0.5}, 20)
    det.add(ws[:20])
    det.add(ws)  # the agent sends all it holds again: counted once
    res = det.result()
    assert res.windows == 2 * 11  # windows ending within 30 s of the newest (3 s each, inclusive)
    assert sum(w.samples for w in res.ranks) == 22 * 15


def test_error_windows_are_not_counted() -> None:
    from rankscope.contract.snapshot import CaptureError

    ws = [StackSampleWindow(0, 1, 0.0, 3.0, collective=5),
          StackSampleWindow(0, 1, 3.0, 6.0, error=CaptureError(CaptureErrorKind.GONE, "gone"))]
    assert rank_waits(ws)[0].samples == 5


def test_sampling_problems_name_the_ranks_whose_newest_window_failed_with_the_fix() -> None:
    from rankscope.contract.snapshot import CaptureError

    def refused(pid: int) -> CaptureError:
        return CaptureError(CaptureErrorKind.PERMISSION, f"ptrace refused for pid {pid}", "run the agent as root")

    gone = CaptureError(CaptureErrorKind.GONE, "pid 9 is gone")
    ws = [StackSampleWindow(0, 1, 0.0, 3.0, error=refused(1)), StackSampleWindow(0, 1, 3.0, 6.0, collective=5),  # recovered
          StackSampleWindow(2, 3, 3.0, 6.0, error=refused(3)), StackSampleWindow(1, 2, 0.0, 3.0, compute=4),
          StackSampleWindow(1, 2, 3.0, 6.0, error=refused(2)), StackSampleWindow(3, 4, 3.0, 6.0, error=gone)]
    # one line per kind of failure (each message names its own pid): the lowest rank's message, the others counted
    assert sampling_problems(ws) == (
        "sampling failed on ranks 1-2: ptrace refused for pid 2 (and 1 more alike) (fix: run the agent as root)",
        "sampling failed on rank 3: pid 9 is gone",
    )
    assert sampling_problems(ws[:2]) == ()


def _snap(t: float, ws: list[StackSampleWindow]) -> JobSnapshot:
    machines = []
    for m in range(2):
        ranks = tuple(RankInfo(r, r % 4, 8, 100 + r, group_rank=m) for r in range(4 * m, 4 * m + 4))
        machines.append(MachineSnapshot(f"host-node{m}", f"127.0.0.1:{m}", True, Instant(t, t), ranks=ranks,
                                        samples=tuple(w for w in ws if w.rank // 4 == m)))
    return JobSnapshot(Instant(t, t), tuple(machines))


def test_failslow_detector_is_confident_on_samples_alone_and_names_rank_groups_and_machine() -> None:
    det = FailSlowDetector(layout=Layout(tp=2, pp=2, dp=2, order="tp-dp-pp"))
    ws = windows({r: 0.9 for r in range(8)} | {5: 0.3}, 8)
    verdicts = [det.update(_snap(1000.0 + 3 * i, ws[: 8 * (i + 1)])) for i in range(8)]
    assert not verdicts[0].confident  # one window: too few samples to test
    last = verdicts[-1]
    assert last.confident and last.machines == ("host-node1",)
    flag = next(f for f in last.flags if f.detector == "samples")
    assert flag.alarmed and flag.ranks == (5,)
    assert "rank 5 waited" in flag.evidence and "TP group #2" in flag.evidence and "PP group #1" in flag.evidence
    assert last.confidence > verdicts[3].confidence or verdicts[3].confident


def test_failslow_verdict_says_which_ranks_could_not_be_sampled() -> None:
    from rankscope.contract.snapshot import CaptureError

    det = FailSlowDetector()
    ws = windows({r: 0.9 for r in range(8)}, 8)
    refused = CaptureError(CaptureErrorKind.PERMISSION, "ptrace refused", "run the agent as root")
    failed = [StackSampleWindow(6, 106, 1e9, 1e9 + 3, error=refused), StackSampleWindow(7, 107, 1e9, 1e9 + 3, error=refused)]
    fs = det.update(_snap(1000.0, ws + failed))
    assert "sampling failed on ranks 6-7: ptrace refused (and 1 more alike) (fix: run the agent as root)" in fs.verdict.notes
    assert not any("sampling failed" in n for n in det.update(_snap(1003.0, ws)).verdict.notes)


def test_failslow_detector_stays_quiet_on_a_healthy_sampled_job() -> None:
    det = FailSlowDetector()
    ws = windows({r: 0.4 if r < 4 else 0.3 for r in range(8)}, 30, seed=11)
    for i in range(30):
        fs = det.update(_snap(1000.0 + 3 * i, ws[: 8 * (i + 1)]))
        assert not fs.confident, fs.verdict.summary


# ---- the probe, with real py-spy -------------------------------------------------

WAITER = """
import sys, threading, time
def recv():  # named like a point-to-point receive: the sampled main thread waits "for a peer"
    while True:
        time.sleep(0.01)
threading.Thread(target=lambda: [time.sleep(0.01) for _ in iter(int, 1)], daemon=True).start()
open(sys.argv[1], "w").close()
recv()
"""


@pytest.fixture
def waiter(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", WAITER, str(ready)])
    try:
        from agent_helpers import wait_for

        wait_for(ready.exists, 30, "the sampled process to start")
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_sampler_classifies_a_real_process_without_pausing_it(waiter: subprocess.Popen[bytes]) -> None:
    async def go() -> StackSampleWindow:
        sampler = StackSampler(window_s=1)
        try:
            return await sampler.sample_once(3, waiter.pid, 10)
        finally:
            await sampler.close()

    w = asyncio.run(go())
    assert w.error is None and w.rank == 3 and w.pid == waiter.pid
    assert w.samples >= 3 and w.p2p == w.samples  # only the main thread, and every sample in recv
    assert w.end_wall > w.start_wall


def test_closing_the_sampler_mid_window_kills_and_reaps_its_py_spy(waiter: subprocess.Popen[bytes]) -> None:
    # A sampler closed while its recorders run (a lease ending, an agent stopping) leaves no py-spy attached to a
    # rank and nothing for the garbage collector to complain about ("Event loop is closed", seen once in
    # bench_sampling's output before the recorder was reaped on cancel; this test does not reproduce that one).
    import psutil

    def recorders() -> list[psutil.Process]:
        return [c for c in psutil.Process().children(recursive=True) if "py-spy" in c.name()]

    async def go() -> tuple[int, list[psutil.Process]]:
        sampler = StackSampler(window_s=60)
        sampler.demand([RankInfo(rank=0, local_rank=0, world_size=1, pid=waiter.pid)], 5)
        for _ in range(600):  # no event tells when the recorder has started: look for it
            if recorders():
                break
            await asyncio.sleep(0.05)
        started = len(recorders())
        await sampler.close()
        return started, recorders()

    import gc

    unraisable: list[str] = []
    hook = sys.unraisablehook
    sys.unraisablehook = lambda u: unraisable.append(f"{u.exc_type.__name__}: {u.exc_value}")
    try:
        started, left = asyncio.run(go())
        gc.collect()  # what the interpreter does with a process transport left behind
    finally:
        sys.unraisablehook = hook
    assert started == 1 and left == [] and unraisable == []


def test_a_ranks_first_window_is_short_and_the_ones_after_it_longer() -> None:
    # The first figures come within seconds; after that fewer py-spy starts (60 % of the cost at 5 s windows).
    asked: list[int | None] = []
    sampler = StackSampler(window_s=2, steady_window_s=7, binary=None)

    async def fake_window(rank: int, pid: int, rate_hz: int, window_s: int | None = None) -> StackSampleWindow:
        asked.append(window_s)
        if len(asked) == 4:
            sampler._demanded = -1e18  # the lease ends: the loop stops after this window
        await asyncio.sleep(0)
        return StackSampleWindow(rank, pid, 0.0, 1.0, compute=1)

    async def go() -> None:
        sampler.sample_once = fake_window  # type: ignore[method-assign]
        sampler.demand([RankInfo(rank=0, local_rank=0, world_size=1, pid=4242)], 5)
        await asyncio.gather(*sampler._tasks.values())
        await sampler.close()

    asyncio.run(go())
    assert asked == [2, 7, 7, 7]
    assert StackSampler(window_s=9, steady_window_s=3, binary=None).steady_window_s == 9  # never shorter


def test_sampler_records_a_gone_process_as_an_error_window(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()

    async def go() -> StackSampleWindow:
        sampler = StackSampler(window_s=1)
        try:
            return await sampler.sample_once(0, proc.pid, 5)
        finally:
            await sampler.close()

    w = asyncio.run(go())
    assert w.error is not None and w.error.kind is CaptureErrorKind.GONE and w.samples == 0 and w.error.fix


def test_sampler_without_py_spy_says_how_to_install_it() -> None:
    async def go() -> StackSampleWindow:
        sampler = StackSampler(window_s=1, binary=None)
        sampler.binary = None
        try:
            return await sampler.sample_once(0, 1, 5)
        finally:
            await sampler.close()

    w = asyncio.run(go())
    assert w.error is not None and w.error.kind is CaptureErrorKind.TOOL_MISSING and "pip install" in w.error.fix


# ---- machine identity ------------------------------------------------------------


def test_machine_identity_is_unique_per_node_container_or_port() -> None:
    ranks = (RankInfo(4, 0, 8, 10, group_rank=1), RankInfo(5, 1, 8, 11, group_rank=1))
    assert machine_identity("vm", ranks, None, 50051) == "vm-node1"
    assert machine_identity("vm", (), "0123456789ab", 50051) == "vm-0123456789ab"
    assert machine_identity("0123456789ab", (), "0123456789ab", 50051) == "0123456789ab"
    assert machine_identity("vm", (), None, 50052) == "vm-50052"
    mixed = (RankInfo(0, 0, 8, 10, group_rank=0), RankInfo(4, 0, 8, 11, group_rank=1))
    assert machine_identity("vm", mixed, None, 7) == "vm-7"  # two nodes' ranks: the node rank says nothing


def test_container_id_from_cgroup_lines() -> None:
    docker = "0::/system.slice/docker-" + "a" * 64 + ".scope\n"
    assert container_id(docker) == "a" * 12
    assert container_id("12:pids:/kubepods/burstable/pod1/cri-containerd-" + "b" * 64) == "b" * 12
    assert container_id("0::/user.slice/user-1000.slice/session-1.scope\n") is None
