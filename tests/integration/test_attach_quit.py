"""Quitting a read-only view leaves the job, its agent and every other view running (#12).

One drill was seen to stop (agents "stopping", torchrun SIGTERM, nothing said) about 2 s after its
read-only view quit. Here the pairing command the drill prints (``write_pair_command``), run exactly as printed, is
the read-only view: four of them, each in a terminal of its own (a pseudo-terminal, its controlling
terminal as in a tmux pane), attached to a real agent serving a real rank process while another client --
the main view's stand-in -- keeps polling and follows the audit log. Each view then ends a
different way: `q`, SIGINT, SIGTERM, and the terminal hung up (what tmux kill-pane and a closed window
do). Afterwards the agent and the rank still run, the agent said nothing of stopping, the other
client's polls and audit stream go on unbroken, and the views wrote nothing beside the hostfile
and token they read.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from agent_helpers import Processes, clean_env, make_token_file
from rankscope.actions.agent_protocol import AgentLost
from rankscope.cli.commands.drill import PAIR_COMMAND, write_pair_command
from rankscope.contract.snapshot import MachineSnapshot
from rankscope.drill.faults import DrillLayout
from rankscope.wire.client import JobClient

ANSI = re.compile(r"\x1b(?:\[[0-9;?<>=]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[()][0-9A-Za-z]|[=>78cDEHMNOZ])")
ATTACHED = "1/1 machines"  # the header once the view has drawn the agent's first answer
WAIT_S = 300.0  # bounds on real events (a view starting, quitting), generous for a loaded 2-core host


# In the view's new session its pty becomes its controlling terminal, as a tmux pane's is; then the view runs. A
# shim, not a preexec_fn: this process's gRPC threads are live (see rankscope.wire.spawn). SIGHUP back to its
# default, as in a pane: a suite started under nohup ignores it, and an ignored signal stays ignored across exec.
_CONTROLLING_TERMINAL = ("import fcntl, os, signal, sys, termios\nfcntl.ioctl(0, termios.TIOCSCTTY, 0)\n"
                         "signal.signal(signal.SIGHUP, signal.SIG_DFL)\n"
                         "os.execvp(sys.argv[1], sys.argv[1:])\n")


class View:
    """One read-only view in a pseudo-terminal of its own; its screen output read without blocking."""

    def __init__(self, argv: list[str], loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.master, slave = os.openpty()
        env = clean_env()
        env["TERM"] = "xterm-256color"
        for name in ("COLUMNS", "LINES"):  # the test's own terminal size would override the pty's
            env.pop(name, None)
        self.proc = subprocess.Popen([sys.executable, "-S", "-c", _CONTROLLING_TERMINAL, *argv], stdin=slave,
                                     stdout=slave, stderr=slave, env=env, start_new_session=True)
        os.close(slave)
        self.output = bytearray()
        self.attached = asyncio.Event()
        self.closed = asyncio.Event()  # the view closed its side of the terminal: it ended
        os.set_blocking(self.master, False)
        loop.add_reader(self.master, self._read)

    def _read(self) -> None:
        try:
            chunk = os.read(self.master, 1 << 16)
        except OSError:  # the view ended: its side of the terminal is closed
            chunk = b""
        if not chunk:
            self.loop.remove_reader(self.master)
            self.closed.set()
            return
        self.output.extend(chunk)
        if ATTACHED in self.text():
            self.attached.set()

    def text(self) -> str:
        return ANSI.sub("", self.output.decode(errors="replace"))

    def hang_up(self) -> None:
        """Close the terminal's master side, as tmux kill-pane does: the kernel sends the view SIGHUP."""
        self.loop.remove_reader(self.master)
        os.close(self.master)
        self.master = -1

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        if self.master >= 0:
            self.loop.remove_reader(self.master)
            os.close(self.master)
            self.master = -1


QUITS: dict[str, Callable[[View], None]] = {
    "q": lambda v: os.write(v.master, b"q") and None,
    "SIGINT": lambda v: v.proc.send_signal(signal.SIGINT),
    "SIGTERM": lambda v: v.proc.send_signal(signal.SIGTERM),
    "terminal hung up": View.hang_up,
}


def test_read_only_views_that_quit_leave_the_agent_its_rank_and_other_clients_running(
        procs: Processes, tmp_path: Path) -> None:
    _, token_file = make_token_file(tmp_path)
    rank = procs.rank(0, 1)
    agent = procs.agent("machine-0", "--run-id", rank.run_id, "--state-dir", str(tmp_path / "state"),
                        token_file=token_file)
    write_pair_command(tmp_path, [agent.address], token_file, DrillLayout(tp=1, pp=1, dp=1, machines=1))
    printed = shlex.split((tmp_path / PAIR_COMMAND).read_text())
    assert "--read-only" in printed

    def shared_files() -> dict[str, int]:
        """The run dir's files but the agent's own (its log and state): what the views could touch."""
        return {str(f.relative_to(tmp_path)): f.stat().st_mtime_ns for f in tmp_path.rglob("*")
                if f.is_file() and f != agent.log and "state" not in f.relative_to(tmp_path).parts}

    before = shared_files()

    def ended(how: str, view: View) -> int:
        try:
            return view.proc.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the view did not end on {how}:\n{view.text()[-2000:]}") from None

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        readings: asyncio.Queue[MachineSnapshot] = asyncio.Queue()
        audit: list[object] = []
        async with JobClient([agent.address], token_file.read_text().strip()) as main:

            async def stream() -> None:
                while True:  # as the main view does: a poll, then the next one
                    await readings.put((await main.poll()).machines[0])
                    await asyncio.sleep(0.5)

            async def follow() -> None:
                async for item in main.watch_audit(agent.address, since=0, retry_s=0.5):
                    audit.append(item)

            streaming = asyncio.create_task(stream())
            following = asyncio.create_task(follow())
            views = {how: View(printed, loop) for how in QUITS}
            try:
                for how, view in views.items():
                    waits = [asyncio.create_task(view.attached.wait()), asyncio.create_task(view.closed.wait())]
                    await asyncio.wait(waits, timeout=WAIT_S, return_when=asyncio.FIRST_COMPLETED)
                    for waiting in waits:
                        waiting.cancel()
                    assert view.attached.is_set(), f"the view to quit by {how} did not attach:\n{view.text()[-2000:]}"
                for how, view in views.items():
                    QUITS[how](view)
                codes = {how: await asyncio.to_thread(ended, how, view) for how, view in views.items()}
                # Each ended the way it was told to: q and SIGINT (Textual ends the app) cleanly, the others by the
                # signal (a hung-up terminal sends SIGHUP).
                assert codes["q"] == 0 and codes["SIGINT"] in (0, 130), (codes, views["q"].text()[-2000:])
                assert (codes["SIGTERM"], codes["terminal hung up"]) == (-signal.SIGTERM, -signal.SIGHUP), codes

                # The other client's streams go on: a reading that started after every view ended, of the rank.
                while not readings.empty():
                    readings.get_nowait()
                reading = await asyncio.wait_for(readings.get(), WAIT_S)
                assert reading.reachable and [r.rank for r in reading.ranks] == [0], reading
                job = await main.describe()
                assert [(m.reachable, [r.rank for r in m.ranks]) for m in job.machines] == [(True, [0])]
                assert not streaming.done() and not following.done()
                assert not [item for item in audit if isinstance(item, AgentLost)], audit
            finally:
                streaming.cancel()
                following.cancel()
                await asyncio.gather(streaming, following, return_exceptions=True)
                for view in views.values():
                    await asyncio.to_thread(view.close)

    asyncio.run(scenario())
    assert agent.proc.poll() is None, agent.log_text()
    assert rank.proc.poll() is None
    assert "stopping" not in agent.log_text(), agent.log_text()
    assert shared_files() == before  # the views wrote nothing where the drill keeps its hostfile and token
