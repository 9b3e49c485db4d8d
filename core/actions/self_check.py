"""A warm standby's self-check before it joins the job (ByteRobust §6.2).

A standby that is broken would turn a fast recovery into a second failure,
so before it is woken it proves, on its own:

- **CPU and memory**: enough cores and free memory, and a small matrix
  product whose exact result is known (a core that miscomputes shows here);
- **GPUs**, through NVML when the machine has them (the probes' one NVML
  reader): the expected count, no uncorrectable ECC errors, no recent Xid;
- **a loopback collective**: two local processes run a real gloo
  ``all_reduce`` over 127.0.0.1, so the torch / c10d stack works on this
  machine. (With GPUs the same check should run NCCL across its devices; that
  path needs a GPU machine and is not exercised here.)

The judging functions take readings and return verdicts, so they are tested
on recorded values; :func:`self_check` gathers the real readings.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass

from rankscope.actions.evict_backends import SelfCheck
from rankscope.contract.snapshot import GpuStatus, HostMetrics

Check = tuple[str, bool, str]


@dataclass(frozen=True, slots=True)
class SelfCheckConfig:
    min_cpus: int = 1
    min_free_memory_bytes: int = 1 << 30
    expect_gpus: int = 0  # 0: a CPU machine; n > 0: NVML must show at least n healthy GPUs
    collective: bool = True
    collective_timeout_s: float = 60.0
    python: str = sys.executable  # the interpreter with torch, as the job uses it


def judge_host(host: HostMetrics, cfg: SelfCheckConfig) -> list[Check]:
    checks: list[Check] = []
    cpus = host.cpu_count
    checks.append(("cpu count", cpus is not None and cpus >= cfg.min_cpus,
                   f"{cpus} core(s), need {cfg.min_cpus}" if cpus is not None else f"unknown ({host.error})"))
    if host.mem_total_bytes is None or host.mem_used_bytes is None:
        checks.append(("free memory", False, f"unknown ({host.error})"))
    else:
        free = host.mem_total_bytes - host.mem_used_bytes
        checks.append(("free memory", free >= cfg.min_free_memory_bytes,
                       f"{free / 2**30:.1f} GiB free, need {cfg.min_free_memory_bytes / 2**30:.1f} GiB"))
    return checks


def judge_gpus(status: GpuStatus, cfg: SelfCheckConfig) -> list[Check]:
    if not status.available:
        if cfg.expect_gpus == 0:
            return [("gpus", True, f"none expected ({status.reason or 'no NVML'})")]
        return [("gpus", False, f"{cfg.expect_gpus} expected but {status.reason or 'NVML is unavailable'}")]
    checks: list[Check] = [("gpu count", len(status.gpus) >= cfg.expect_gpus,
                            f"{len(status.gpus)} GPU(s), need {cfg.expect_gpus}")]
    for gpu in status.gpus:
        bad: list[str] = []
        if gpu.ecc_uncorrected:
            bad.append(f"{gpu.ecc_uncorrected} uncorrectable ECC error(s)")
        if gpu.xid_events:
            bad.append(f"Xid {', '.join(str(x) for x in gpu.xid_events)}")
        checks.append((f"gpu {gpu.index}", not bad, "; ".join(bad) or "healthy"))
    return checks


def check_arithmetic() -> Check:
    """An integer-valued matrix product checked exactly: a miscomputing core gives a wrong entry."""
    import numpy as np

    n = 64
    a = (np.arange(n * n, dtype=np.float64).reshape(n, n) % 7) - 3
    b = (np.arange(n * n, dtype=np.float64).reshape(n, n).T % 5) - 2
    got = a @ b
    want = np.array([[sum(int(a[i, k]) * int(b[k, j]) for k in range(n)) for j in range(n)] for i in range(n)],
                    dtype=np.float64)
    wrong = int(np.count_nonzero(got != want))
    return ("cpu arithmetic", wrong == 0, "exact" if wrong == 0 else f"{wrong} wrong entries of {n * n}")


_COLLECTIVE = """
import datetime, sys
import torch
import torch.distributed as dist
rank, port, timeout = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=timeout))
t = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
dist.all_reduce(t)
print(f"{t[0].item():g} {t[1].item():g}")
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_loopback_collective(python: str = sys.executable, timeout_s: float = 60.0) -> Check:
    """Two processes, one gloo all_reduce over loopback; both must print the exact sums (3, 30)."""
    port = _free_port()
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1")
    procs: list[subprocess.Popen[str]] = []
    outputs: list[str] = []
    try:
        for r in range(2):
            procs.append(subprocess.Popen([python, "-c", _COLLECTIVE, str(r), str(port), str(timeout_s)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, shell=False))
        for p in procs:
            out, err = p.communicate(timeout=timeout_s + 30)
            if p.returncode != 0:
                last = (err.strip().splitlines() or [f"exit status {p.returncode}"])[-1]
                return ("loopback collective", False, f"a process failed: {last}")
            outputs.append(out.strip())
    except subprocess.TimeoutExpired:
        return ("loopback collective", False, f"no result within {timeout_s + 30:g} s")
    except OSError as exc:
        return ("loopback collective", False, f"cannot start {python}: {exc}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    ok = outputs == ["3 30", "3 30"]
    return ("loopback collective", ok, "gloo all_reduce over 127.0.0.1 exact" if ok else f"wrong sums {outputs}")


def self_check(machine: str, cfg: SelfCheckConfig | None = None) -> SelfCheck:
    """Run every check on this machine; the standby joins only if all pass."""
    from rankscope.probes.gpu import gpu_status
    from rankscope.probes.host import host_metrics

    cfg = cfg or SelfCheckConfig()
    checks = judge_host(host_metrics(), cfg)
    checks.append(check_arithmetic())
    checks.extend(judge_gpus(gpu_status(), cfg))
    if cfg.collective:
        checks.append(check_loopback_collective(cfg.python, cfg.collective_timeout_s))
    return SelfCheck(machine, all(ok for _, ok, _ in checks), tuple(checks))
