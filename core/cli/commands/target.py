"""Which agents a client command talks to, and how: --agents/--hostfile or --slurm JOBID, TLS, the token.

Shared by ``snapshot``, ``attach`` and ``watch``: each registers the options
with ``add_target_args`` and opens the target with ``open_target``, which for
``--slurm`` starts the agents inside the job for as long as the ``with``
block lasts (and stops them on the way out, also on Ctrl-C and SIGTERM).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from rankscope.contract.errors import RankscopeError
from rankscope.wire.target import Target, slurm_target

if TYPE_CHECKING:
    from rankscope.wire.tokens import Role


def add_tls_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("TLS (agents bound beyond loopback serve it)")
    g.add_argument("--tls-ca", type=Path, help="PEM CA that signed the agents' certificates: connect over TLS")
    g.add_argument("--tls-cert", type=Path, help="mutual TLS: this client's PEM certificate (with --tls-key)")
    g.add_argument("--tls-key", type=Path, help="mutual TLS: this client's PEM private key")
    g.add_argument("--tls-server-name", help="check the agents' certificates for this name instead of each host's")


def add_slurm_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Slurm (start the agents inside a running job)")
    g.add_argument("--slurm", metavar="JOBID",
                   help="find the job's nodes with the Slurm CLI and start one agent per node in its allocation "
                        "(srun --overlap), with a token and TLS certificates made for this session; "
                        "they stop when this command ends")
    g.add_argument("--slurm-agent-command", default=None,
                   help=f"how the nodes run the agent (default: {sys.executable} -m rankscope agent)")
    g.add_argument("--slurm-timeout", type=float, default=60.0,
                   help="seconds the agents have to start on the nodes (default 60)")
    g.add_argument("--slurm-lease", type=float, default=60.0, metavar="SECONDS",
                   help="the agents stop by themselves when this command has not been heard from for this long "
                        "(it renews them every lease/6 s; default 60)")


@contextmanager
def open_target(args: argparse.Namespace, *, role: Role | None = None,
                state_dir: str | None = None, agent_args: list[str] | None = None,
                follow: bool = False) -> Iterator[Target]:
    """The agents, token and TLS the options name; with --slurm, agents started for the block's duration.

    ``role``: the token role to load (Role.ACT for a session that may act).
    ``state_dir``: with --slurm, the agents' --state-dir on the nodes (enables actions); None: read-only agents.
    ``follow``: with --slurm, start agents again on the job's new nodes after a requeue and write them to
    ``Target.hostfile`` (attach, watch); the agents' lease is renewed while the block lasts either way.
    """
    from rankscope.wire.tls import client_tls
    from rankscope.wire.tokens import Role as _Role
    from rankscope.wire.tokens import load_client_token

    slurm = getattr(args, "slurm", None)
    if not slurm:
        from rankscope.wire.agents_spec import resolve_agents

        agents = resolve_agents(args.agents, args.hostfile, default_port=args.port)
        tls = client_tls(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
        yield Target(agents, load_client_token(args.token_file, role=role or _Role.READ), tls)
        return
    if args.agents or args.hostfile:
        raise RankscopeError("--slurm starts its own agents; it cannot be combined with --agents/--hostfile",
                             "drop one of them")
    if args.tls_ca or args.tls_cert or args.tls_key or args.token_file:
        raise RankscopeError("--slurm makes its own token and TLS certificates for the session",
                             "drop --token-file and --tls-* with --slurm")
    command = shlex.split(args.slurm_agent_command) if args.slurm_agent_command else None
    with slurm_target(str(slurm), state_dir=state_dir, agent_args=agent_args or (), agent_command=command,
                      start_timeout_s=args.slurm_timeout, lease_s=args.slurm_lease, follow=follow) as target:
        yield target
