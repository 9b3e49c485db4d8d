"""Starting a child from a process whose gRPC threads may be live (a client, an agent, a drill).

gRPC registers fork handlers. In a child made by ``fork()`` they restart
gRPC's poller, which then fails on the epoll descriptor that ``close_fds``
closed before ``exec`` ("epoll_wait error: Bad file descriptor",
grpc/grpc#43055) and kills the child before it runs anything: a read-only
view that never appears, an srun that never starts the agents. Python starts a
child with ``vfork``, which runs no fork handlers, unless it is given a
``preexec_fn``. So what has to happen in the child before ``exec`` is done by
a tiny Python shim that then execs the command, and no ``preexec_fn`` is used.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

# SIGTERM to the child when the thread that started it ends (Linux PR_SET_PDEATHSIG; elsewhere nothing), then exec.
PARENT_DEATH_SHIM = (
    "import ctypes, os, signal, sys\n"
    "try:\n    ctypes.CDLL(None).prctl(1, signal.SIGTERM)\nexcept Exception:\n    pass\n"
    "os.execvp(sys.argv[1], sys.argv[1:])\n"
)


def with_parent_death_signal(argv: Sequence[str], python: str = sys.executable) -> list[str]:
    """``argv`` started through the shim: it gets SIGTERM when the *thread* that started it ends.

    Linux sends the signal when the thread that forked the child ends, not
    its process: start such children from a thread that lives as long as
    the process that owns them.
    """
    return [python, "-S", "-c", PARENT_DEATH_SHIM, *argv]
