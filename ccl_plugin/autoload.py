"""What the ``rankscope-ccl.pth`` hook runs at interpreter start-up.

Why a .pth file: it is read by every Python process that uses this
site-packages, including ranks that torchrun (or any launcher) spawns, so the
counters load without touching user code. The .pth line itself only reads an
environment variable; everything else happens here and only when
``RANKSCOPE_CCL=1`` (set by ``rankscope run`` or by ``ccl_env``).

``activate()`` does not import torch (that would cost every Python start a
second or more): it waits for ``torch.distributed`` to be imported, then
patches it right after its module body ran, before any user ``from
torch.distributed import ...`` can bind the originals. It never raises.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from pathlib import Path

from rankscope.ccl_plugin import layout as L
from rankscope.ccl_plugin.post_import import after_import

PTH_NAME = "rankscope-ccl.pth"
# One line, executed by site.py for every interpreter: cheap when the variable is unset.
PTH_LINE = ("import os; os.environ.get('RANKSCOPE_CCL') == '1' and "
            "__import__('rankscope.ccl_plugin.autoload', fromlist=['activate']).activate()\n")
TARGET = "torch.distributed"
_activated = False


def ccl_env(counter_dir: Path, job_id: str, nccl_plugin: Path | None = None) -> dict[str, str]:
    """Environment that turns the counters on in every Python process started with it.

    The drill and ``rankscope run`` merge this into the launcher's environment.
    ``nccl_plugin`` (the built profiler library) is passed to NCCL when given.
    """
    env = {L.ENV_ENABLE: "1", L.ENV_DIR: str(counter_dir), L.ENV_JOB_ID: job_id}
    if nccl_plugin is not None:
        env["NCCL_PROFILER_PLUGIN"] = str(nccl_plugin)
    return env


def _settings() -> tuple[Path, str]:
    directory = Path(os.environ.get(L.ENV_DIR) or L.DEFAULT_DIR)
    job = os.environ.get(L.ENV_JOB_ID) or os.environ.get("TORCHELASTIC_RUN_ID") or "job"
    return directory, job


def _install_now() -> None:
    try:
        from rankscope.ccl_plugin import torch_hooks
        directory, job = _settings()
        if torch_hooks.install(directory, job):
            atexit.register(torch_hooks.shutdown)
        from rankscope.ccl_plugin import backup
        if os.environ.get(backup.ENV_REQUEST):
            # checkpoint backup on request (key `b`), through torch's global optimizer step hook
            backup.install()
    except Exception as exc:  # never into user code
        with contextlib.suppress(Exception):
            print(f"rankscope: CCL counters not loaded: {type(exc).__name__}: {exc}", file=sys.stderr)


def activate() -> None:
    """Turn the hooks on for this process (idempotent; never raises)."""
    global _activated
    if _activated:
        return
    _activated = True
    try:
        after_import(TARGET, lambda _module: _install_now())
    except Exception as exc:
        with contextlib.suppress(Exception):
            print(f"rankscope: CCL counters not loaded: {type(exc).__name__}: {exc}", file=sys.stderr)


def environment_changed() -> None:
    """Read again what depends on the environment (never raises).

    For an interpreter whose rank environment was set after start-up: a
    parked rank (``rankscope.drill.warm``) imported torch, and so ran
    :func:`_install_now`, before it knew its machine's backup request file.
    """
    if not _activated:
        return
    try:
        from rankscope.ccl_plugin import backup
        if os.environ.get(backup.ENV_REQUEST):
            backup.install()
    except Exception as exc:
        with contextlib.suppress(Exception):
            print(f"rankscope: checkpoint backup not loaded: {type(exc).__name__}: {exc}", file=sys.stderr)


# ---- installing the .pth -----------------------------------------------


def site_dirs() -> list[Path]:
    """Where this interpreter reads .pth files, most preferred first."""
    import site
    import sysconfig
    dirs = [Path(sysconfig.get_paths()["purelib"])]
    with contextlib.suppress(Exception):
        dirs += [Path(p) for p in site.getsitepackages()]
    if site.ENABLE_USER_SITE:
        with contextlib.suppress(Exception):
            dirs.append(Path(site.getusersitepackages()))
    out: list[Path] = []
    for d in dirs:
        if d not in out:
            out.append(d)
    return out


def installed_pth() -> Path | None:
    """The hook file that this interpreter will read, if present and current."""
    for d in site_dirs():
        p = d / PTH_NAME
        with contextlib.suppress(OSError):
            if p.read_text() == PTH_LINE:
                return p
    return None


def install_pth() -> Path:
    """Write the hook into the first writable site directory; OSError if none is.

    Kept out of the wheel on purpose: setuptools cannot place a root-level .pth
    from package data, and writing it at first use works the same for editable
    and wheel installs (and for a venv the launcher and its ranks share).
    """
    found = installed_pth()
    if found is not None:
        return found
    errors: list[str] = []
    for d in site_dirs():
        try:
            d.mkdir(parents=True, exist_ok=True)
            target = d / PTH_NAME
            tmp = d / f".{PTH_NAME}.{os.getpid()}"
            tmp.write_text(PTH_LINE)
            os.replace(tmp, target)
            return target
        except OSError as exc:
            errors.append(f"{d}: {exc.strerror or exc}")
    raise OSError("; ".join(errors))
