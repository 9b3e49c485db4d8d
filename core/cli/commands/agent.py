"""`rankscope agent`: serve this machine's ranks to rankscope clients over gRPC."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

DESCRIPTION = """\
Run the node agent: one per machine. It finds the torchrun ranks on this
machine, captures their stacks (py-spy), host/GPU metrics and CCL counters, and
answers `rankscope snapshot`, `rankscope attach` and the drill.

Safe by default: it listens on 127.0.0.1 unless --bind names another address,
and every call needs the token from --token-file (or $RANKSCOPE_TOKEN). Bound
beyond loopback it serves TLS (--tls-cert/--tls-key; --tls-client-ca requires
client certificates: mutual TLS) and refuses to start without it unless
--insecure is given.

Inside a Slurm job (`srun --jobid J --overlap ... rankscope agent --slurm-scope`,
which `rankscope attach --slurm J` does for you) the agent serves only the ranks
of its job on its node ($SLURM_JOB_ID, $SLURMD_NODENAME), names itself after
the node, and with --state-dir evicts through Slurm (drain, requeue).

Actions (evict, hot_update, rollback, backup) are off unless --state-dir is
given: the agent then keeps its audit log, blocklist and hot-update history
there and carries out the procedures of --actions-config (TOML, or JSON by
suffix); with --state-dir alone, eviction stops this machine's ranks (SIGTERM,
SIGKILL after 10 s) and blocks the machine. Clients never send commands: they
name an action, the agent shows its plan, and runs it only when the person
confirmed exactly the planned targets with a token of the 'act' role.

  state_dir = "/var/lib/rankscope"     # or --state-dir
  [eviction]
  backend = "local"                    # local | slurm | kubernetes | command
  grace_s = 10
  [eviction.local]                     # the warm standbys the launcher restarts with (shown in plans)
  standbys = ["spare-0"]               # or standbys_file = "/abs/standbys.json" (a JSON list, read per plan)
  [eviction.slurm]                     # settings of the chosen backend
  job_id = "12345"                     # also: restart, step_id, standby_partition, standby_reservation
  [eviction.kubernetes]
  namespace = "train"                  # also: selector, kubectl, context
  [eviction.command]
  script = "/opt/site/evict"           # called as: script evict --job J --reason R --machine M
  [hot_update]
  current = "/srv/job/code"            # a symlink the job runs its code from
  versions_dir = "/srv/job/versions"
  repo = "/srv/job/repo"               # for git refs
  [layout]                             # for the backup plan
  tp = 2
  pp = 4
  dp = 2
"""


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "agent", help="run the node agent (one per machine)", description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--bind", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; use 0.0.0.0 or this machine's address for remote clients)")
    p.add_argument("--port", type=int, default=50051, help="port to listen on (default 50051; 0 picks a free one)")
    p.add_argument("--port-file", type=Path, help="write the port actually bound to this file (for scripts with --port 0)")
    p.add_argument("--token-file", type=Path,
                   help="file with the accepted token(s), one per line; default: $RANKSCOPE_TOKEN")
    p.add_argument("--insecure-no-token", action="store_true",
                   help="serve without a token (only on a loopback address; for local experiments)")
    p.add_argument("--tls-cert", type=Path, help="PEM certificate to serve TLS with (needs --tls-key)")
    p.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert (keep it chmod 600)")
    p.add_argument("--tls-client-ca", type=Path,
                   help="mutual TLS: accept only clients whose certificate this CA signed")
    p.add_argument("--insecure", action="store_true",
                   help="serve plaintext beyond loopback (token and snapshots unencrypted; trusted networks only)")
    p.add_argument("--slurm-scope", action="store_true",
                   help="inside a Slurm job step: only this job's ranks on this node; machine name = the node")
    p.add_argument("--slurm-standby-partition",
                   help="with --slurm-scope: evicted nodes are replaced by idle nodes of this partition")
    p.add_argument("--slurm-standby-reservation",
                   help="with --slurm-scope: evicted nodes are replaced by idle nodes of this reservation")
    p.add_argument("--lease", type=float, default=0.0, metavar="SECONDS",
                   help="stop by itself when no client called with an accepted token for this long (its client "
                        "is gone); `attach/snapshot/watch --slurm` start agents with a lease and renew it")
    p.add_argument("--announce", action="store_true",
                   help="print 'RANKSCOPE_AGENT_READY machine=... host=... port=...' on stdout once listening")
    p.add_argument("--machine-name",
                   help="name reported for this machine (default: unique on the host and stable across restarts: "
                        "HOST-nodeN from its ranks' torchrun node rank, else HOST-CONTAINER in a container, "
                        "else HOST-PORT)")
    p.add_argument("--launcher-pid", type=int, help="only ranks started by this launcher (torchrun) process")
    p.add_argument("--run-id", help="only ranks of this torchrun run id (TORCHELASTIC_RUN_ID)")
    p.add_argument("--job-user", action="append", default=[], metavar="USER",
                   help="only processes of this user (name or uid; repeatable) are ranks; default: the agent's own "
                        "user, or for root, root and the user of a rank's launcher (torchrun, Slurm)")
    p.add_argument("--counter-dir", type=Path, help="where the CCL plugin writes its counter files")
    p.add_argument("--concurrency", type=int, default=8, help="py-spy calls at once during a capture (default 8)")
    p.add_argument("--state-dir", type=Path,
                   help="enable actions; keep the audit log, blocklist and hot-update history here "
                        "(%%n is replaced by the machine name)")
    p.add_argument("--actions-config", type=Path,
                   help="TOML (or .json) file naming the eviction backend, hot-update paths and layout (see above)")
    p.add_argument("--relay-to", metavar="AGENTS",
                   help="also forward every describe/capture to these agents (same forms as the client's --agents) "
                        "and send their replies inside this one's: a two-level tree for thousands of machines")
    p.add_argument("--relay-token-file", type=Path,
                   help="token presented to the --relay-to agents; default: this agent's --token-file")
    p.add_argument("--relay-tls-ca", type=Path, help="CA to verify the --relay-to agents' TLS with (default plaintext)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import dataclasses
    import os
    import socket

    from rankscope.actions.config import EvictionSettings, load_actions_config, state_dir_for
    from rankscope.cli.options import job_users
    from rankscope.contract.errors import RankscopeError
    from rankscope.wire.agent import AgentConfig, serve
    from rankscope.wire.tls import server_tls
    from rankscope.wire.tokens import load_tokens

    if args.concurrency < 1:
        raise RankscopeError("--concurrency must be at least 1", "use the default, 8")
    if args.lease < 0:
        raise RankscopeError("--lease must be 0 (none) or a number of seconds", "e.g. --lease 60")
    tokens = load_tokens(args.token_file, private=True)
    if tokens is not None and args.insecure_no_token:
        raise RankscopeError("--insecure-no-token given together with a token", "drop one of them")
    if args.insecure and (args.tls_cert or args.tls_key):
        raise RankscopeError("--insecure given together with --tls-cert/--tls-key", "drop one of them")
    slurm_job = slurm_node = None
    if args.slurm_scope:
        slurm_job, slurm_node = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURMD_NODENAME")
        if not slurm_job or not slurm_node:
            raise RankscopeError("--slurm-scope outside a Slurm job step ($SLURM_JOB_ID/$SLURMD_NODENAME unset)",
                                 "start it with srun --jobid JOBID --overlap, or use rankscope attach --slurm JOBID")
    if args.state_dir is not None and "%n" in str(args.state_dir):
        # One command line for every node of a job step: each agent keeps its own state.
        args.state_dir = state_dir_for(args.state_dir, args.machine_name or slurm_node or socket.gethostname())
    actions = load_actions_config(args.actions_config, args.state_dir)
    if actions is not None and slurm_job and args.actions_config is None:
        # Started inside the job with no procedures of its own: evicting means draining and requeueing in Slurm.
        options = {"job_id": slurm_job, "standby_partition": args.slurm_standby_partition,
                   "standby_reservation": args.slurm_standby_reservation}
        actions = dataclasses.replace(actions, eviction=EvictionSettings("slurm", options=options))
    config = AgentConfig(
        tokens=tokens,
        bind=args.bind,
        port=args.port,
        machine_name=args.machine_name or slurm_node or socket.gethostname(),
        # Without a name given (or a Slurm node's), the agent picks one unique on this host at start.
        auto_name=args.machine_name is None and not slurm_node,
        launcher_pid=args.launcher_pid,
        run_id=args.run_id,
        counter_dir=args.counter_dir,
        insecure_no_token=args.insecure_no_token,
        capture_concurrency=args.concurrency,
        actions=actions,
        tls=server_tls(args.tls_cert, args.tls_key, args.tls_client_ca),
        insecure=args.insecure,
        slurm_job=slurm_job,
        slurm_node=slurm_node,
        lease_s=args.lease,
        job_users=job_users(args.job_user),
    )
    if args.relay_to:
        from rankscope.wire.agents_spec import parse_agents
        from rankscope.wire.tls import client_tls
        from rankscope.wire.tokens import load_client_token

        config = dataclasses.replace(
            config, relay_to=tuple(parse_agents(args.relay_to)),
            relay_token=load_client_token(args.relay_token_file or args.token_file),
            relay_tls=client_tls(args.relay_tls_ca) if args.relay_tls_ca is not None else None)
    asyncio.run(serve(config, port_file=args.port_file, announce=args.announce))
    return 0
