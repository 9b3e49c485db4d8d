"""The agents a client reaches: a ``Target`` (addresses, token, TLS), and agents started inside a Slurm job.

``slurm_target`` starts one agent per node of a running job for a ``with``
block, renews their lease and stops them at the end; with ``follow`` it starts
them again on the job's new nodes after a requeue and keeps a private hostfile
listing them. The CLI's ``--slurm`` and the Slurm drill both open it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rankscope.wire.slurm import MissingNode, SlurmAgents
    from rankscope.wire.tls import ClientTLS


@dataclass
class Target:
    agents: list[str]
    token: str | None
    tls: ClientTLS | None
    missing: list[MissingNode] = field(default_factory=list)
    slurm_job: str | None = None
    # --slurm: a private hostfile rewritten with the agents of the job's new allocation after a requeue
    # (the TUI follows it); None otherwise
    hostfile: Path | None = None


@contextmanager
def slurm_target(job_id: str, *, env: Mapping[str, str] | None = None, state_dir: str | None = None,
                 agent_args: Sequence[str] = (), agent_command: Sequence[str] | None = None,
                 start_timeout_s: float = 60.0, lease_s: float = 60.0, follow: bool = False) -> Iterator[Target]:
    """Agents inside Slurm job ``job_id`` for the block's duration, their lease renewed, stopped at the end.

    ``env``: the Slurm commands' environment (SLURM_CONF); default: this process's. ``follow``: see
    ``open_target``.
    """
    from rankscope.wire.lease import KeepAlive
    from rankscope.wire.slurm import SlurmAgents, sigterm_as_interrupt

    session = SlurmAgents(job_id, state_dir=state_dir, start_timeout_s=start_timeout_s,
                          extra_agent_args=tuple(agent_args), lease_s=lease_s, env=env)
    if agent_command:
        session.agent_command = tuple(agent_command)
    with ExitStack() as stack:
        stack.enter_context(sigterm_as_interrupt())
        if lease_s > 0:
            # Renewing from the first announcement on: a node that starts slowly must not cost the others
            # their lease while start() waits for it.
            session.prepare()
            stack.enter_context(KeepAlive(session.ready_addresses, session.token, tls=session.tls,
                                          every_s=max(1.0, lease_s / 6)))
        stack.enter_context(session)
        hostfile = follow_into_hostfile(session, stack) if follow else None
        yield Target(list(session.agents.values()), session.token, session.tls, list(session.missing), job_id,
                     hostfile)


def follow_into_hostfile(session: SlurmAgents, stack: ExitStack) -> Path:
    """Re-launch the session's agents after each requeue and keep a private hostfile listing them.

    The file (in a 0700 directory, removed at the end) holds addresses only.
    """
    import shutil
    import tempfile

    from rankscope.wire.agents_spec import write_hostfile

    folder = Path(tempfile.mkdtemp(prefix="rankscope-slurm-"))
    stack.callback(shutil.rmtree, folder, True)
    path = folder / "agents.txt"
    write_hostfile(path, session.agents.values())

    def changed(s: SlurmAgents, what: str) -> None:
        with contextlib.suppress(OSError):  # the session is ending and its folder already gone
            write_hostfile(path, s.agents.values())

    session.follow(changed)
    return path
