"""`rankscope attach` picks the token a session needs: 'act' when it may act, else 'read'."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from rankscope.cli.main import main


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    import rankscope.tui.app as tui_app

    seen: list[dict[str, Any]] = []

    def fake_run_attach(agents: Any, token: Any, options: Any, reach: Any = None) -> int:
        seen.append({"agents": list(agents), "token": token, "options": options, "reach": reach})
        return 0

    monkeypatch.setattr(tui_app, "run_attach", fake_run_attach)
    return seen


def _tokens(tmp_path: Path, text: str) -> str:
    path = tmp_path / "token"
    path.write_text(text)
    path.chmod(0o600)
    return str(path)


def test_an_acting_session_sends_the_act_token(tmp_path: Path, calls: list[dict[str, Any]]) -> None:
    f = _tokens(tmp_path, "read:" + "r" * 32 + "\nact:" + "a" * 32 + "\n")
    assert main(["attach", "--agents", "127.0.0.1:1", "--token-file", f]) == 0
    assert calls[0]["token"] == "a" * 32
    assert calls[0]["reach"].act_problem is None


def test_a_read_token_attaches_and_names_why_it_cannot_act(tmp_path: Path, calls: list[dict[str, Any]]) -> None:
    f = _tokens(tmp_path, "read:" + "r" * 32 + "\n")
    assert main(["attach", "--agents", "127.0.0.1:1", "--token-file", f]) == 0
    assert calls[0]["token"] == "r" * 32
    message, fix = calls[0]["reach"].act_problem
    assert "'act' role" in message and "act:" in fix


def test_a_read_only_session_sends_the_read_token(tmp_path: Path, calls: list[dict[str, Any]]) -> None:
    f = _tokens(tmp_path, "read:" + "r" * 32 + "\nact:" + "a" * 32 + "\n")
    assert main(["attach", "--agents", "127.0.0.1:1", "--token-file", f, "--read-only"]) == 0
    assert calls[0]["token"] == "r" * 32 and calls[0]["options"].read_only is True


def test_the_fail_slow_windows_reach_the_detectors(tmp_path: Path, calls: list[dict[str, Any]],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from rankscope.tui.app import AppOptions

    f = _tokens(tmp_path, "read:" + "r" * 32 + "\n")
    assert main(["attach", "--agents", "127.0.0.1:1", "--token-file", f, "--read-only", "--fail-slow",
                 "--window", "600", "--continuity", "240", "--rounds", "7"]) == 0
    config = calls[0]["options"].failslow_config
    assert (config.window_s, config.continuity_s, config.step_window_s, config.rounds_needed) == (600, 240, 240, 7)
    assert AppOptions(failslow_config=config).failslow_config is config  # an AppOptions field, passed as is
    assert isinstance(calls[0]["options"], AppOptions)  # the typed options, passed as is
    assert main(["attach", "--agents", "127.0.0.1:1", "--token-file", f, "--rounds", "0"]) == 2
    assert "--rounds at least 1" in capsys.readouterr().err


def test_unset_fail_slow_windows_are_the_detectors_own_defaults(tmp_path: Path, calls: list[dict[str, Any]]) -> None:
    from rankscope.analyzers.failslow_config import FailSlowConfig

    f = _tokens(tmp_path, "read:" + "r" * 32 + "\n")
    assert main(["attach", "--agents", "127.0.0.1:1", "--token-file", f, "--read-only"]) == 0
    assert calls[0]["options"].failslow_config == FailSlowConfig()


@pytest.mark.parametrize("verb", ["attach", "watch", "analyze", "backup-plan"])
def test_every_verb_refuses_a_parallel_size_below_one(verb: str, tmp_path: Path, calls: list[dict[str, Any]],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """One layout group for every verb: `--tp 0` is refused with the fix, never read as 1."""
    from rankscope.contract.bundle import write_bundle
    from tui_bundles import fig7_bundle

    f = _tokens(tmp_path, "read:" + "r" * 32 + "\n")
    bundle = write_bundle(fig7_bundle(), tmp_path / "fig7.json")
    where = {"attach": ["--agents", "127.0.0.1:1", "--token-file", f], "watch": ["--agents", "127.0.0.1:1",
             "--token-file", f], "analyze": [str(bundle)], "backup-plan": []}[verb]
    assert main([verb, *where, "--tp", "0"]) == 2
    assert "--tp must be a whole number of at least 1, got 0" in capsys.readouterr().err
    assert not calls


def test_the_layout_typed_for_attach_has_every_dimension(tmp_path: Path, calls: list[dict[str, Any]]) -> None:
    from rankscope.contract.snapshot import Layout

    f = _tokens(tmp_path, "read:" + "r" * 32 + "\n")
    assert main(["attach", "--agents", "127.0.0.1:1", "--token-file", f, "--tp", "2", "--cp", "2", "--ep", "2"]) == 0
    assert calls[0]["options"].layout == Layout(tp=2, cp=2, ep=2)
    assert main(["attach", "--agents", "127.0.0.1:1", "--token-file", f]) == 0
    assert calls[1]["options"].layout is None  # nothing typed: the job's own layout
