"""The NCCL drill up to where CUDA is needed: devices, NCCL's environment, flags, and the error on a CPU machine."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rankscope.cli.commands import drill as drill_cli
from rankscope.contract.errors import RankscopeError
from rankscope.drill import gpu
from rankscope.drill.faults import DrillLayout
from rankscope.drill.launcher import Launcher, TrainingOptions
from rankscope.drill.worker import build_parser, use_gpu

torch = pytest.importorskip("torch")
CPU_ONLY = not torch.cuda.is_available()


def test_ranks_go_round_robin_over_the_gpus() -> None:
    assert [gpu.rank_device(r, 2) for r in range(5)] == [0, 1, 0, 1, 0]
    assert [gpu.rank_device(r, 8) for r in range(4)] == [0, 1, 2, 3]
    with pytest.raises(RankscopeError, match="needs a GPU"):
        gpu.rank_device(0, 0)


def test_ranks_sharing_a_gpu_each_pose_as_their_own_host_over_loopback() -> None:
    envs = [gpu.nccl_rank_env(r, 4, 1, "drill-ab") for r in range(4)]
    assert len({e["NCCL_HOSTID"] for e in envs}) == 4
    assert envs[1] == {"NCCL_HOSTID": "drill-ab-rank1", "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}
    assert gpu.nccl_rank_env(3, 4, 4, "drill-ab") == {}  # a GPU each: NCCL's own paths, nothing to pose


@given(world=st.integers(1, 64), gpus=st.integers(1, 16))
def test_no_two_ranks_of_a_shared_gpu_share_a_host_id(world: int, gpus: int) -> None:
    seen: dict[tuple[int, str], int] = {}
    for r in range(world):
        host = gpu.nccl_rank_env(r, world, gpus, "d").get("NCCL_HOSTID", "one-host")
        key = (gpu.rank_device(r, gpus), host)
        assert key not in seen, f"ranks {seen.get(key)} and {r} are one device of one host"
        seen[key] = r


def test_the_users_own_nccl_settings_win() -> None:
    wanted = gpu.nccl_rank_env(0, 2, 1, "d")
    assert gpu.not_set({"NCCL_SOCKET_IFNAME": "eth0"}, wanted) == {"NCCL_HOSTID": "d-rank0", "NCCL_IB_DISABLE": "1"}


def test_the_backend_reaches_the_worker_and_gloo_stays_the_default(tmp_path: Path) -> None:
    layout = DrillLayout(tp=2, pp=1, dp=1, machines=1)
    gloo = TrainingOptions().worker_args(layout, tmp_path, resume=False)
    nccl = TrainingOptions(backend="nccl").worker_args(layout, tmp_path, resume=True)
    assert "--backend" not in gloo
    assert nccl[-3:] == ["--backend", "nccl", "--resume"]
    args = build_parser().parse_args(["train", "--run-dir", str(tmp_path), *nccl[2:]])
    assert args.backend == "nccl" and args.resume
    assert build_parser().parse_args(["train", "--run-dir", "x"]).backend == "gloo"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--run-dir", "x", "--backend", "mpi"])


def _cli_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    drill_cli.register(sub)
    return parser.parse_args(["drill", *argv])


def test_cli_option_parses_and_defaults_to_gloo() -> None:
    assert _cli_args("--headless").backend == "gloo"
    assert _cli_args("--headless", "--backend", "nccl").backend == "nccl"
    with pytest.raises(SystemExit):
        _cli_args("--backend", "mpi")


@pytest.mark.skipif(not CPU_ONLY, reason="a CUDA machine passes the check")
def test_nccl_on_a_machine_without_cuda_says_why_and_the_fix() -> None:
    with pytest.raises(RankscopeError) as err:
        drill_cli.build_config(_cli_args("--headless", "--backend", "nccl", "--fault", "hang-compute", "--tp", "2", "--pp", "1", "--dp", "1",
                                         "--machines", "1"))
    assert "--backend nccl needs CUDA: torch.cuda.is_available() is False" in err.value.message
    assert "CUDA build of torch" in err.value.fix and "drop --backend nccl" in err.value.fix
    with pytest.raises(SystemExit, match="needs CUDA"):
        use_gpu(0, 2)  # a worker started anyway stops with the reason, not deep inside NCCL


def test_slurm_refuses_nccl_and_the_suite_passes_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(RankscopeError, match="local launcher only"):
        drill_cli.run(_cli_args("--backend", "nccl", "--launcher", "slurm"))
    from rankscope.drill import suite

    seen: list[str] = []
    monkeypatch.setattr(gpu, "check_cuda", lambda world: seen.append("checked"))
    monkeypatch.setattr(suite, "run_suite", lambda config, say: seen.append(config.backend) or {})
    monkeypatch.setattr(suite, "scorecard_lines", lambda result: [])
    assert drill_cli.run(_cli_args("--backend", "nccl", "--suite", "failslow", "--suite-drills", "1")) == 0
    assert seen == ["checked", "nccl"]


def test_the_nccl_drill_loads_the_profiler_plugin_beside_the_python_counters(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rankscope.ccl_plugin import build

    monkeypatch.setattr(build, "build_plugin", lambda: tmp_path / "libplugin.so")
    layout = DrillLayout(tp=2, pp=1, dp=1, machines=1)
    nccl = Launcher(tmp_path / "n", layout, TrainingOptions(backend="nccl"))
    gloo = Launcher(tmp_path / "g", layout, TrainingOptions())
    assert nccl.base_env()["NCCL_PROFILER_PLUGIN"] == str(tmp_path / "libplugin.so")
    assert nccl.base_env()["RANKSCOPE_CCL"] == "1"
    assert "NCCL_PROFILER_PLUGIN" not in gloo.base_env() or gloo.base_env()["NCCL_PROFILER_PLUGIN"] != str(
        tmp_path / "libplugin.so")

    def broken() -> Path:
        raise build.BuildError("no C compiler found", "install one")

    monkeypatch.setattr(build, "build_plugin", broken)
    without = Launcher(tmp_path / "b", layout, TrainingOptions(backend="nccl"))
    assert without.base_env()["RANKSCOPE_CCL"] == "1"
    assert any("NCCL profiler plugin not built (no C compiler found)" in n for n in without.notes)


def test_a_worker_sharing_one_gpu_binds_it_and_poses_as_its_own_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's set-up before NCCL starts, with torch.cuda answering as on a one-GPU machine."""
    bound: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    for key in ("NCCL_HOSTID", "NCCL_IB_DISABLE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth7")  # the user's own choice stays
    monkeypatch.setenv("RANKSCOPE_DRILL_RUN_ID", "drill-x")
    device = use_gpu(3, 4)
    assert (device.type, device.index, bound) == ("cuda", 0, [0])
    assert (os.environ["NCCL_HOSTID"], os.environ["NCCL_IB_DISABLE"], os.environ["NCCL_SOCKET_IFNAME"]) == (
        "drill-x-rank3", "1", "eth7")
