"""The drill's agents: one rankscope agent per machine (a node's or an idle standby's), each on its own port.

Every agent shares the run's token; with actions on, each gets its own
actions config (``state/<machine>/actions.json``) naming its machine's code
link and the warm standbys the drill would bring in
(``state/standbys.json``).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rankscope.contract.errors import RankscopeError
from rankscope.drill.code_versions import JobCode
from rankscope.drill.faults import DrillLayout
from rankscope.drill.processes import log_tail
from rankscope.drill.spawner import Start
from rankscope.wire.tls import write_private

AGENT_START_TIMEOUT_S = 30.0


@dataclass
class Agent:
    """One machine's agent and the address it listens on."""

    name: str
    proc: subprocess.Popen[bytes]
    address: str
    log: Path


class Agents:
    """Starts and knows the agents of one drill run; ``running`` maps a machine to its agent.

    ``state_dir(machine)``: where that machine's agent keeps its state;
    ``standbys()``: the idle standbys now (the pool changes while the agents
    run); ``orphans``: where an agent that was started but not waited for is
    handed, for the run's stop to end it.
    """

    def __init__(self, run_dir: Path, layout: DrillLayout, python: str, start: Start,
                 base_env: Callable[[], dict[str, str]], state_dir: Callable[[str], Path], *, counter_dir: Path | None,
                 actions: bool, code: JobCode, standbys: Callable[[], Sequence[str]],
                 orphans: list[subprocess.Popen[bytes]]) -> None:
        self.run_dir, self.layout, self.python = run_dir, layout, python
        self._start, self._base_env, self.state_dir = start, base_env, state_dir
        self.counter_dir, self.actions, self.code = counter_dir, actions, code
        self._standbys, self._orphans = standbys, orphans
        self.running: dict[str, Agent] = {}
        self.token_file: Path | None = None

    def ensure_token(self) -> Path:
        if self.token_file is None:
            path = self.run_dir / "rankscope.token"
            write_private(path, (secrets.token_hex(16) + "\n").encode())
            self.token_file = path
        return self.token_file

    def token(self) -> str:
        return self.ensure_token().read_text().strip()

    def _argv(self, name: str, port: int, port_file: Path, scope: Sequence[str]) -> list[str]:
        argv = [
            self.python, "-m", "rankscope", "agent", "--bind", "127.0.0.1", "--port", str(port),
            "--port-file", str(port_file), "--token-file", str(self.ensure_token()), "--machine-name", name, *scope,
        ]
        if self.counter_dir is not None:
            argv += ["--counter-dir", str(self.counter_dir)]
        if self.actions:
            # Eviction backend `local` (the default): the agent stops its own ranks and blocks the machine;
            # the drill's recovery (rankscope.drill.control) restarts the job. The layout lets a backup
            # plan name each rank's peer.
            self.state_dir(name).mkdir(parents=True, exist_ok=True)
            argv += ["--state-dir", str(self.state_dir(name)), "--actions-config", str(self.actions_config(name))]
        return argv

    def actions_config(self, name: str) -> Path:
        """Machine ``name``'s agent config, written anew at each agent start (the standby pool changes).

        One file per machine: each agent's hot-update section names its own
        machine's code link. The local eviction points at the standby list
        (:meth:`write_standbys`), so every eviction plan lists who would join.
        """
        path = self.state_dir(name) / "actions.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        layout = {"tp": self.layout.tp, "pp": self.layout.pp, "dp": self.layout.dp,
                  "ranks_per_machine": self.layout.ranks_per_machine}
        # The drill's steps take milliseconds, so the agents' requests land steps apart: about 8 on a
        # lightly loaded 2-core host, more under load. Ranks whose requests land more than one align
        # apart share no backed-up step and the restore falls back to the checkpoint; 16 leaves room.
        backup = {"align_steps": 16, "wait_s": 60}
        config: dict[str, Any] = {"eviction": {"backend": "local", "local": {"standbys_file": str(self.write_standbys())}},
                                  "layout": layout, "backup": backup}
        if self.code.enabled:
            self.code.prepare(name)
            config["hot_update"] = {"current": str(self.code.link(name)), "versions_dir": str(self.code.versions(name)),
                                    "repo": str(self.code.repo)}
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(config, indent=1))
        os.replace(tmp, path)
        return path

    def blocked_machines(self) -> frozenset[str]:
        """Every machine some agent of this drill has blocked (each agent keeps its own persistent list)."""
        from rankscope.actions.blocklist import Blocklist

        out: set[str] = set()
        for path in sorted((self.run_dir / "state").glob("*/blocklist.sqlite")):
            with contextlib.suppress(Exception):  # a list being created right now is read next time
                out.update(entry.machine for entry in Blocklist(path).blocked())
        return frozenset(out)

    def write_standbys(self) -> Path:
        """``state/standbys.json``: the idle standbys not blocked, in the order the recovery takes them.

        Agents read it at each eviction plan (``[eviction.local]
        standbys_file``): the pool changes while they run (standbys are added
        after the job's agents start, and join at a recovery).
        """
        path = self.run_dir / "state" / "standbys.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        blocked = self.blocked_machines()
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps([m for m in self._standbys() if m not in blocked]))
        os.replace(tmp, path)
        return path

    def start(self, scopes: Mapping[str, Sequence[str]], *, timeout_s: float = AGENT_START_TIMEOUT_S,
              ports: Mapping[str, int] | None = None) -> dict[str, str]:
        """An agent for each machine of ``scopes`` that has none, scoped by those flags; every agent's address.

        ``ports`` pins the port of some machines' agents (a restart keeps the
        addresses a TUI already holds); the others pick a free port.

        Raises ``RankscopeError`` (with the agent's log tail) when an agent
        does not come up; nodes already started keep running.
        """
        pending: dict[str, tuple[subprocess.Popen[bytes], Path, Path]] = {}
        for name, scope in scopes.items():
            if name in self.running:
                continue
            port_file = self.run_dir / "logs" / f"{name}.agent.port"
            port_file.unlink(missing_ok=True)
            log = self.run_dir / "logs" / f"{name}.agent.log"
            argv = self._argv(name, (ports or {}).get(name, 0), port_file, scope)
            pending[name] = (self._start(argv, log, self._base_env()), port_file, log)
        deadline = time.monotonic() + timeout_s
        while pending:
            for name, (proc, port_file, log) in list(pending.items()):
                port = _read_port(port_file)
                if port is not None:
                    self.running[name] = Agent(name=name, proc=proc, address=f"127.0.0.1:{port}", log=log)
                    del pending[name]
                elif proc.poll() is not None:
                    for other, _, _ in pending.values():
                        self._orphans.append(other)
                    raise RankscopeError(
                        f"the agent of {name} exited with status {proc.returncode}: {log_tail(log)}",
                        f"read {log}; check that `python -m rankscope agent --help` works in this environment",
                    )
            if pending and time.monotonic() > deadline:
                for other, _, _ in pending.values():
                    self._orphans.append(other)
                raise RankscopeError(f"agents of {', '.join(pending)} did not report a port within {timeout_s:.0f} s",
                                     f"read the agent logs in {self.run_dir / 'logs'}")
            time.sleep(0.05)
        return self.addresses()

    def addresses(self) -> dict[str, str]:
        return {name: a.address for name, a in self.running.items()}


def _read_port(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
