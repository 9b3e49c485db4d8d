"""Processes that use gRPC end without a traceback: the drill's sequence of clients, followers and agent restarts.

A recovery benchmark once printed gRPC tracebacks while its processes shut down ("Event loop is closed",
"Bad file descriptor"): a channel or call outliving the event loop that made it, a poller that reads a
closed socket, a fork handler in a child. Here the drill's own machinery runs in a subprocess, the way the
benchmarks and the drill run it -- real agents with actions, the recovery's audit follower in its thread, a
second thread polling with its own event loop while the main thread captures, the agents stopped and
started again on their ports under both, the incident journal written, then everything stopped -- and
neither that process nor any agent may print a traceback or a gRPC error on its way out.

The main thread's one-off calls follow the agents' audit streams and leave them open (as the TUI and a benchmark's
action do): the calls cancelled as their channel closes complete inside gRPC a moment later. Made on a loop of their
own that has closed by then (``asyncio.run`` per call), the completion reached another thread's live loop -- the
poller's, or the recovery's -- which printed "Exception in callback PollerCompletionQueue._handle_events ...
RuntimeError: Event loop is closed". Synchronous callers run on the process's one gRPC loop
(``rankscope.wire.sync_loop``); the recovery, stopped and started again here, too.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from agent_helpers import clean_env
from rankscope.drill.processes import shutdown_noise

SEQUENCE = r"""
import asyncio, sys, threading, time
from pathlib import Path
from rankscope.drill.control import DrillMachines, Recovery, agents_journal
from rankscope.drill.faults import DrillLayout
from rankscope.actions.journal import JournalEntry
from rankscope.drill.launcher import Launcher, TrainingOptions
from rankscope.drill.processes import kill_trees
from rankscope.wire.client import JobClient, capture_once
from rankscope.wire.sync_loop import run_sync

run_dir = Path(sys.argv[1])
launcher = Launcher(run_dir, DrillLayout(tp=1, pp=1, dp=2, machines=2), TrainingOptions(steps=4), counters=False,
                    actions=True, warm=False)
recovery = Recovery(launcher, DrillMachines(launcher))
polling = threading.Event()
polls = []

async def follow_then_leave():
    # Follow every agent's audit stream while one poll goes round, then leave the streams open.
    async with JobClient(list(launcher.addresses().values()), launcher.token(), acting=True) as client:
        async def follow():
            async for _ in client.watch_all_audit(since=0):
                pass
        following = asyncio.create_task(follow())
        polls.append(await client.poll())
        following.cancel()
        await asyncio.gather(following, return_exceptions=True)

def poll_loop():
    while not polling.is_set():
        async def once():
            async with JobClient(list(launcher.addresses().values()), launcher.token(), deadline_s=2.0) as client:
                polls.append(await client.poll())
        asyncio.run(once())

try:
    launcher.start_standbys(["s0", "s1"])
    recovery.start()
    poller = threading.Thread(target=poll_loop, name="poller")
    poller.start()
    for _ in range(2):
        for _ in range(8):
            run_sync(follow_then_leave())
        # A recovery stopped ends its round with its audit streams cancelled; a new one follows the agents again.
        recovery.stop()
        assert recovery.errors == [], recovery.errors
        recovery = Recovery(launcher, DrillMachines(launcher))
        recovery.start()
        snap = capture_once(list(launcher.addresses().values()), launcher.token())
        assert len(snap.machines) == 2, snap
        # What a restart does to the agents: stopped, then started again on the same ports.
        ports = {name: int(a.address.rsplit(":", 1)[1]) for name, a in launcher.agents.items()}
        leaving = [launcher.agents.pop(name) for name in list(launcher.agents)]
        kill_trees([a.proc.pid for a in leaving], grace_s=0.5)
        for a in leaving:
            a.proc.wait(timeout=30)
        launcher.start_agents(ports=ports)
    story = agents_journal(launcher)([JournalEntry(time.time(), "resumed", "shutdown test", "test")])
    assert any(e.text == "shutdown test" for e in story), story
    polling.set()
    poller.join()
    assert polls, "the poller never polled"
finally:
    polling.set()
    recovery.stop()
    launcher.stop()
print("sequence done", len(polls), "polls;", "recovery errors:", recovery.errors)
"""


def test_clients_followers_and_agents_of_the_drill_end_without_a_traceback(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-c", SEQUENCE, str(tmp_path)], capture_output=True, text=True,
                         env=clean_env(), timeout=600, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "sequence done" in run.stdout and "recovery errors: []" in run.stdout, run.stdout + run.stderr
    assert not shutdown_noise(run.stderr), run.stderr
    logs = sorted((tmp_path / "logs").glob("*.log"))
    assert len([p for p in logs if "agent" in p.name]) >= 2, [p.name for p in logs]
    for log in logs:
        text = log.read_text(errors="replace")
        assert not shutdown_noise(text), f"{log.name}:\n{text}"


def test_the_noise_of_a_shutdown_out_of_order_is_recognised() -> None:
    """What the benchmarks and the test above look for, on the lines gRPC and asyncio print."""
    printed = ("rankscope agent: stopping\n"
               "Exception in callback PollerCompletionQueue._handle_events(<_UnixSelectorEventLoop ...>)()\n"
               "Traceback (most recent call last):\n"
               "BlockingIOError: [Errno 11] Resource temporarily unavailable\n"
               "RuntimeError: Event loop is closed\n"
               "E1128 16:33:03.71 ev_epoll1_linux.cc:122] epoll_wait error: Bad file descriptor\n")
    assert shutdown_noise(printed) == ["Traceback (most recent call last):", "RuntimeError: Event loop is closed",
                                       "E1128 16:33:03.71 ev_epoll1_linux.cc:122] epoll_wait error: Bad file descriptor"]
    assert shutdown_noise("rankscope agent: listening on 127.0.0.1:1\nrankscope agent: stopping\n") == []


TORCHRUN_STOPPED_LOG = """\
W1128 20:10:02.840000 17797 torch/distributed/elastic/agent/server/api.py:753] Received 15 death signal, shutting down workers
W1128 20:10:02.841000 17797 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 17986 closing signal SIGTERM
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/x/.venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1032, in <module>
    main()
  File "/x/.venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 374, in launch_agent
    result = agent.run()
             ^^^^^^^^^^^
  File "/x/.venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py", line 86, in handler
    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)
torch.distributed.elastic.multiprocessing.api.SignalException: Process 17797 got signal: 15
"""


def test_torchruns_report_of_the_sigterm_that_stopped_it_is_the_only_traceback_let_through() -> None:
    """torchrun's log (its ranks' output too) is checked like the others; its own SignalException for the SIGTERM of
    a stop is by design, and only that exact report is passed over."""
    assert shutdown_noise(TORCHRUN_STOPPED_LOG) == []
    # The same report for another signal is not a stop of the drill's.
    killed = TORCHRUN_STOPPED_LOG.replace("got signal: 15", "got signal: 1")
    assert shutdown_noise(killed) == ["Traceback (most recent call last):"]
    # A rank's traceback beside torchrun's report is still found, and so is a gRPC error line.
    rank = ("Traceback (most recent call last):\n  File \"worker.py\", line 3, in step\n"
            "RuntimeError: Event loop is closed\n")
    assert shutdown_noise(TORCHRUN_STOPPED_LOG + rank) == ["Traceback (most recent call last):",
                                                           "RuntimeError: Event loop is closed"]
    # A traceback whose exception was raised while handling another is not torchrun's report.
    chained = TORCHRUN_STOPPED_LOG.replace("Traceback (most recent call last):\n",
                                           "Traceback (most recent call last):\n  File \"a.py\", line 1\n"
                                           "OSError: x\n\nDuring handling of the above exception, another "
                                           "exception occurred:\n\nTraceback (most recent call last):\n", 1)
    assert shutdown_noise(chained) == ["Traceback (most recent call last):"]
