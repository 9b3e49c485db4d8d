"""Eviction backends: the exact argv each one runs, against stand-in executables that record it.

kubectl and a site script are replaced by small executables that append
their argv to a file and answer as configured; the backends run them for
real with subprocess (no shell). The Slurm backend runs against a real Slurm
cluster in tests/integration/test_slurm.py. The local backend is driven through the
drill's interface by a recording control object (the real drill control comes
with the drill's restart support).
"""

from __future__ import annotations

import json
import stat
import sys
import threading
from pathlib import Path

import pytest
from rankscope.actions.evict_backends import (
    KubernetesBackend,
    LocalBackend,
    SelfCheck,
    SiteCommandBackend,
    SlurmBackend,
    run_argv,
)
from rankscope.contract.errors import RankscopeError


def _standin(tmp_path: Path, name: str, stdout: str = "", exit_code: int = 0, stderr: str = "") -> tuple[str, Path]:
    """An executable that records its argv (one JSON list per line) and answers as told."""
    log = tmp_path / f"{name}.argv"
    exe = tmp_path / name
    exe.write_text(
        f"#!{sys.executable}\n"
        "import json, sys\n"
        f"with open({str(log)!r}, 'a') as f:\n"
        "    f.write(json.dumps(sys.argv[1:]) + '\\n')\n"
        f"sys.stdout.write({stdout!r})\n"
        f"sys.stderr.write({stderr!r})\n"
        f"sys.exit({exit_code})\n"
    )
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return str(exe), log


def _argvs(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_kubernetes_cordons_annotates_and_deletes_the_jobs_pods_per_node(tmp_path: Path) -> None:
    kubectl, log = _standin(tmp_path, "kubectl")
    backend = KubernetesBackend(namespace="llm", selector="job-name=pretrain", kubectl=kubectl)
    assert backend.evict(["node-a", "node-b"], "PP group 3 hung").ok
    assert _argvs(log) == [
        ["cordon", "node-a"],
        ["annotate", "node", "node-a", "--overwrite", "rankscope.io/evict-reason=PP group 3 hung"],
        ["cordon", "node-b"],
        ["annotate", "node", "node-b", "--overwrite", "rankscope.io/evict-reason=PP group 3 hung"],
        ["delete", "pods", "--namespace", "llm", "--selector", "job-name=pretrain",
         "--field-selector", "spec.nodeName=node-a", "--wait=false"],
        ["delete", "pods", "--namespace", "llm", "--selector", "job-name=pretrain",
         "--field-selector", "spec.nodeName=node-b", "--wait=false"],
    ]


def test_kubernetes_context_is_passed_first(tmp_path: Path) -> None:
    kubectl, _ = _standin(tmp_path, "kubectl")
    plan = KubernetesBackend("llm", "app=train", kubectl=kubectl, context="prod-east").plan(["n1"], "r")
    assert plan.commands[0] == (kubectl, "--context=prod-east", "cordon", "n1")


def test_site_script_gets_the_documented_argv_and_its_json_is_read(tmp_path: Path) -> None:
    reply = json.dumps({"ok": True, "message": "swapped in 2 spares", "replacements": ["spare-1", "spare-2"]})
    script, log = _standin(tmp_path, "evict-site", stdout=reply)
    outcome = SiteCommandBackend(script, job_id="j-9").evict(["m12", "m13"], "hang in PP group 3")
    assert _argvs(log) == [["evict", "--job", "j-9", "--reason", "hang in PP group 3",
                            "--machine", "m12", "--machine", "m13"]]
    assert outcome.ok and outcome.message == "swapped in 2 spares"
    assert outcome.replacements == ("spare-1", "spare-2")


@pytest.mark.parametrize(("stdout", "code", "ok", "needle"), [
    ("", 0, True, "evicted m1"),
    ('{"ok": false, "message": "no spares left"}', 0, False, "no spares left"),
    ("", 3, False, "exit status 3"),
    ("done!", 0, False, "did not print one JSON object"),
])
def test_site_script_outcomes(tmp_path: Path, stdout: str, code: int, ok: bool, needle: str) -> None:
    script, _ = _standin(tmp_path, "evict-site", stdout=stdout, exit_code=code)
    outcome = SiteCommandBackend(script).evict(["m1"], "r")
    assert outcome.ok is ok and needle in outcome.message


def test_shell_metacharacters_stay_one_argument(tmp_path: Path) -> None:
    script, log = _standin(tmp_path, "evict-site")
    marker = tmp_path / "pwned"
    SiteCommandBackend(script).evict(["m1"], f"hang; touch {marker} $(id)")
    assert _argvs(log)[0][2] == f"hang; touch {marker} $(id)"
    assert not marker.exists()


def test_missing_executable_is_a_failed_run_not_a_traceback(tmp_path: Path) -> None:
    outcome = SlurmBackend(job_id="1", restart="none", scontrol=str(tmp_path / "no-scontrol")).evict(["n1"], "r")
    assert not outcome.ok and "executable not found" in outcome.message
    assert run_argv([str(tmp_path / "nope")]).returncode == 127


@pytest.mark.parametrize("build", [
    lambda: SlurmBackend(job_id="1", restart="reboot"),
    lambda: SlurmBackend(job_id="1", restart="step"),
    lambda: SlurmBackend(job_id="--all"),
    lambda: KubernetesBackend(namespace="llm", selector="--all"),
    lambda: SlurmBackend(job_id="1").plan([], "r"),
    lambda: SlurmBackend(job_id="1").plan(["-n1"], "r"),
    lambda: SlurmBackend(job_id="1").plan(["n1"], "two\nlines"),
])
def test_bad_configuration_and_targets_are_refused(build: object) -> None:
    with pytest.raises(RankscopeError) as err:
        build()  # type: ignore[operator]
    assert err.value.fix


class RecordingDrill:
    """Stands in for the drill's control; records the calls the local backend makes, in order."""

    def __init__(self, failing: frozenset[str] = frozenset()) -> None:
        self.running = ("m0", "m1", "m2", "m3")
        self.pool = ("s0", "s1", "s2")
        self.failing = failing
        self.calls: list[tuple[str, object]] = []

    def machines(self) -> tuple[str, ...]:
        return self.running

    def standbys(self) -> tuple[str, ...]:
        return self.pool

    def stop(self, machine: str) -> None:
        self.calls.append(("stop", machine))

    def self_check(self, machine: str) -> SelfCheck:
        self.calls.append(("self_check", machine))
        if machine in self.failing:
            return SelfCheck(machine, False, (("cpu", True, "ok"), ("loopback all_reduce", False, "timed out")))
        return SelfCheck(machine, True, (("cpu", True, "ok"),))

    def restart(self, machines: tuple[str, ...]) -> None:
        self.calls.append(("restart", machines))


def test_local_backend_stops_checks_standbys_and_restarts_on_the_rest_plus_standbys() -> None:
    drill = RecordingDrill(failing=frozenset({"s0"}))
    backend = LocalBackend(drill, blocked=lambda: frozenset({"s2"}))
    plan = backend.plan(["m2", "m3"], "PP group 1 hung")
    assert plan.standbys == ("s0", "s1") and plan.warnings == ()
    outcome = backend.evict(["m2", "m3"], "PP group 1 hung")
    # s0 fails its loopback check, s2 is blocked: only s1 is usable, so the job must not restart short-handed.
    assert not outcome.ok and "only 1 of 2 standbys" in outcome.message and "loopback all_reduce" in outcome.message
    # The machines are stopped side by side (in either order), all before any standby is checked.
    assert sorted(drill.calls[:2]) == [("stop", "m2"), ("stop", "m3")]
    assert drill.calls[2:] == [("self_check", "s0"), ("self_check", "s1")]

    drill = RecordingDrill(failing=frozenset({"s0"}))
    outcome = LocalBackend(drill).evict(["m2"], "slow")
    assert outcome.ok and outcome.replacements == ("s1",)
    assert drill.calls == [("stop", "m2"), ("self_check", "s0"), ("self_check", "s1"),
                           ("restart", ("m0", "m1", "m3", "s1"))]


class SlowStops(RecordingDrill):
    """A drill whose stop of a machine returns only once every evicted machine's stop has begun."""

    def __init__(self, evicted: int) -> None:
        super().__init__()
        self.all_begun = threading.Barrier(evicted)

    def stop(self, machine: str) -> None:
        super().stop(machine)
        self.all_begun.wait(timeout=60)  # one stop after another would break the barrier (BrokenBarrierError)


def test_local_backend_stops_the_evicted_machines_side_by_side() -> None:
    drill = SlowStops(evicted=3)
    outcome = LocalBackend(drill).evict(["m1", "m2", "m3"], "a PP stage hung")
    assert outcome.ok and outcome.replacements == ("s0", "s1", "s2")
    assert sorted(drill.calls[:3]) == [("stop", "m1"), ("stop", "m2"), ("stop", "m3")]
    assert drill.calls[-1] == ("restart", ("m0", "s0", "s1", "s2"))


def test_local_backend_refuses_machines_outside_the_job_and_warns_of_a_short_pool() -> None:
    backend = LocalBackend(RecordingDrill())
    with pytest.raises(RankscopeError, match="do not run this job"):
        backend.plan(["m9"], "r")
    plan = LocalBackend(RecordingDrill()).plan(["m0", "m1", "m2", "m3"], "r")
    assert plan.standbys == ("s0", "s1", "s2") and "only 3 warm standby" in plan.warnings[0]
