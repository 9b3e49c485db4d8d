"""An agent's --actions-config is outside input: any file gives a config or an error naming the fix, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rankscope.actions.config import ActionsConfig, load_actions_config
from rankscope.contract.errors import RankscopeError
from rankscope.contract.snapshot import Layout

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10, 10**6), st.floats(allow_nan=True),
                    st.text(max_size=12), st.sampled_from(["/abs/path", "rel/path", "local", "slurm", "x y"]))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6),
                                                                                             inner, max_size=3),
                      max_leaves=6)


def _maybe(good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a value of the right kind, sometimes anything: both paths of every check get run."""
    return st.one_of(good, good, good, VALUES)


def _table(**fields: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Some of a section's settings, now and then an unknown one, now and then not a table at all."""
    known = st.fixed_dictionaries({}, optional={k: _maybe(v) for k, v in fields.items()})
    stray = st.builds(lambda d, k, v: {**d, k: v}, known, st.text(min_size=1, max_size=6), VALUES)
    return st.one_of(known, known, known, known, stray, VALUES)


PATHS = st.sampled_from(["/srv/job/code", "/srv/job/versions", "/run/standbys.json", "relative/dir"])
SECONDS = st.one_of(st.integers(-5, 700), st.floats(-1.0, 90000.0))
SIZES = st.one_of(st.integers(-1, 8), st.none())
EVICTION = _table(
    backend=st.sampled_from(["local", "slurm", "kubernetes", "command", "pbs"]),
    grace_s=SECONDS,
    local=_table(standbys=st.lists(st.sampled_from(["spare-0", "spare-1", "-bad", "a b"]), max_size=3),
                 standbys_file=PATHS),
    slurm=_table(job_id=st.sampled_from(["77", "", "-1"]), restart=st.sampled_from(["requeue", "none", "step"]),
                 step_id=st.sampled_from(["0", "x"]), scontrol=PATHS, timeout_s=SECONDS),
    kubernetes=_table(namespace=st.sampled_from(["train", ""]), selector=st.sampled_from(["app=job", ""]),
                      kubectl=PATHS, timeout_s=SECONDS),
    command=_table(script=PATHS, job_id=st.sampled_from(["77", ""]), timeout_s=SECONDS),
)
CONFIG = _table(
    state_dir=PATHS,
    eviction=EVICTION,
    hot_update=_table(current=PATHS, versions_dir=PATHS, repo=PATHS, git=st.sampled_from(["git", "/usr/bin/git"])),
    layout=_table(tp=SIZES, pp=SIZES, dp=SIZES, cp=SIZES, ep=SIZES, ranks_per_machine=SIZES,
                  order=st.sampled_from(["tp-cp-ep-dp-pp", "tp-pp-dp", "nonsense"])),
    backup=_table(wait_s=SECONDS, align_steps=SIZES),
)


@SETTINGS
@given(data=CONFIG)
def test_any_config_file_gives_a_config_or_an_error_naming_the_fix(tmp_path: Path, data: Any) -> None:
    path = tmp_path / "actions.json"
    path.write_text(json.dumps(data))
    try:
        config = load_actions_config(path, tmp_path / "state")
    except RankscopeError as exc:
        assert exc.message and exc.fix
        return
    assert isinstance(config, ActionsConfig) and config.state_dir == tmp_path / "state"
    assert config.backup_wait_s > 0 and config.backup_align_steps >= 1


@pytest.mark.parametrize(("text", "needle"), [
    ('[backup]\nwait_s = "soon"\n', "wait_s"),
    ("[backup]\nalign_steps = [2]\n", "align_steps"),
    ("[backup]\nwait_s = -1\n", "wait_s"),
    ("[hot_update]\ncurrent = 5\nversions_dir = '/v'\n", "current"),
    ("[layout]\ntp = 'two'\n", "tp"),
    ("[layout]\ntp = 0\n", "tp"),
    ('state_dir = 7\n', "state_dir"),
])
def test_a_setting_of_the_wrong_type_is_named_with_the_fix(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "actions.toml"
    path.write_text(text)
    with pytest.raises(RankscopeError, match=needle) as err:
        load_actions_config(path, None if text.startswith("state_dir") else tmp_path / "state")
    assert err.value.fix


def test_a_json_null_leaves_a_layout_setting_at_its_default(tmp_path: Path) -> None:
    """The drill's launcher writes ``ranks_per_machine: null`` when the layout does not say."""
    path = tmp_path / "actions.json"
    path.write_text(json.dumps({"layout": {"tp": 2, "pp": 4, "dp": 1, "ranks_per_machine": None},
                                "backup": {"align_steps": 16, "wait_s": 60}}))
    config = load_actions_config(path, tmp_path / "state")
    assert config is not None and config.layout == Layout(tp=2, pp=4, dp=1)
    assert config.backup_align_steps == 16 and config.backup_wait_s == 60.0
