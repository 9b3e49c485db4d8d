"""The job's code on each machine, for hot-updates: a link per machine into checkouts of the drill's code repository.

With actions on, every machine runs the job's code from its own
hot-updatable link, ``state/<machine>/code/current``, into
``state/<machine>/code/versions`` (a checkout per version of the drill's code
repository ``code/repo``, see ``rankscope.drill.user_code``). Each agent's
actions config names its machine's link; a restart applies each machine's
pending lazy hot-update before its processes start again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rankscope.contract.errors import RankscopeError

if TYPE_CHECKING:
    from rankscope.actions.config import ActionsConfig


class JobCode:
    """Each machine's code link and its hot-update history; ``enabled`` False: the ranks run the installed code.

    ``state_dir(machine)``: where that machine's agent keeps its state (the
    link and the history live there). ``notes`` collects what the drill
    should tell its user (hot-update turned off, updates applied).
    """

    def __init__(self, run_dir: Path, state_dir: Callable[[str], Path], *, enabled: bool, notes: list[str]) -> None:
        self.run_dir, self.state_dir, self.enabled, self.notes = run_dir, state_dir, enabled, notes

    @property
    def repo(self) -> Path:
        """The drill's code repository (tags v1, v2, v3): the ``repo`` of every agent's hot-update config."""
        return self.run_dir / "code" / "repo"

    def link(self, name: str) -> Path:
        """The link machine ``name``'s ranks import their code from."""
        return self.state_dir(name) / "code" / "current"

    def versions(self, name: str) -> Path:
        return self.state_dir(name) / "code" / "versions"

    def prepare(self, name: str) -> None:
        """The repository (once) and ``name``'s link, at the initial version when it has none yet."""
        from rankscope.actions.hot_update import CodeVersions
        from rankscope.drill import user_code

        user_code.make_repo(self.repo)
        versions = CodeVersions(self.link(name), self.versions(name), self.repo)
        if versions.target() is None:
            versions.switch(versions.checkout(user_code.INITIAL_VERSION))

    def env(self, label: str, *, running: bool) -> dict[str, str]:
        """What machine ``label``'s ranks need to run from its link.

        ``running``: some nodes already run from their links, so a failure to
        prepare this one is raised (a half-set-up job must not start);
        otherwise (no git here, say) hot-update is turned off for the drill,
        with a note saying why, and the ranks run the installed code.
        """
        from rankscope.drill import user_code

        try:
            self.prepare(label)
        except RankscopeError as exc:
            if running:
                raise
            self.enabled = False
            self.notes.append(f"hot-update off on this drill: {exc.message} (fix: {exc.fix})")
            return {}
        return {user_code.CODE_ENV: str(self.link(label)), user_code.MACHINE_ENV: label}

    def config(self, name: str) -> ActionsConfig:
        """Machine ``name``'s hot-update settings, as its agent has them."""
        from rankscope.actions.config import ActionsConfig, HotUpdateSettings

        return ActionsConfig(state_dir=self.state_dir(name),
                             hot_update=HotUpdateSettings(self.link(name), self.versions(name), self.repo))

    def pending(self, machines: Sequence[str]) -> bool:
        """Whether any of ``machines`` has a lazy hot-update waiting for the next restart."""
        from rankscope.actions.history import HotUpdateHistory

        if not self.enabled:
            return False
        return any(HotUpdateHistory.has_pending(self.config(name).history_path) for name in machines)

    def apply_pending(self, machines: Sequence[str]) -> list[str]:
        """Apply each machine's pending lazy hot-update, for the restart about to happen; what was done.

        ByteRobust §6.1 applies a lazy update in the recovery procedure of
        the next restart. On a cluster the agent would do it in its restart
        path; on the drill the launcher is the restart path (the agents are
        scoped to a torchrun pid, so they are stopped and started with the
        nodes), so it calls the agents' code (``apply_pending``) on each
        machine's history and link while nothing of that machine runs.
        """
        from rankscope.actions.history import UpdateState
        from rankscope.actions.hot_update import JobEvent, JobEventKind
        from rankscope.actions.procedures.update import apply_pending

        done: list[str] = []
        if not self.enabled:
            return done
        for name in machines:
            self.prepare(name)
            record = apply_pending(self.config(name), name, JobEvent(JobEventKind.RESTART, time.time()))
            if record is not None:
                ok = record.state == UpdateState.APPLIED
                done.append(f"{name}: {'applied' if ok else 'could not apply'} pending {record.to_version.label} "
                            f"at the restart{'' if ok else ': ' + record.message}")
        self.notes.extend(done)
        return done
