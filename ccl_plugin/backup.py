"""Checkpoint backup inside the training process (ByteRobust §6.3), with no change to user code.

At interpreter start this module imports only the standard library; torch is
imported inside :func:`install` and the snapshot functions. Nothing here
raises into user code: a failed backup is reported on stderr and training
goes on.

How it finds the state: :func:`install` registers PyTorch's global optimizer
step post-hook (``torch.optim.optimizer.register_optimizer_step_post_hook``).
Every ``optimizer.step()`` of the process passes through it, so the end of a
step is known and the optimizers (their parameters and state) are at hand.
A job that wants to say exactly what to save adds it with
:func:`register_state`.

The trigger is a file the agent writes, so the agent never talks to the
process (a hung or busy rank just does not answer): ``RANKSCOPE_BACKUP_REQUEST``
names it (in the drill ``<state dir of the machine's agent>/backup.request``),
holding ``{"request_id": ..., "written": <wall>, "align": N}``. At each step
boundary the hook looks at the file's size and mtime (one ``stat``); on a new
request id it snapshots the next two boundaries whose step is a multiple of
N. The agents write their requests a few steps apart at most (N is chosen
above that), so every rank then holds a common step. A request written
before this process started was meant for the one it replaced and is ignored.

Where the shard goes: ``RANKSCOPE_BACKUP_TARGETS`` is JSON ``{"<rank>": [own
store, peer store]}``: the store of the rank's own agent and the store of its
backup peer's agent (``rankscope.analyzers.backup_plan``). A store is a
directory in the layout of ``rankscope.actions.shard_store.ShardStore``
(``rank%06d/step%012d.shard`` plus a ``.json`` with the SHA-256), written
atomically, the newest two steps kept, so the agent reads, verifies and
reports what arrived.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rankscope.ccl_plugin.post_import import after_import

ENV_REQUEST = "RANKSCOPE_BACKUP_REQUEST"
ENV_TARGETS = "RANKSCOPE_BACKUP_TARGETS"
REQUEST_FILE = "backup.request"  # in the agent's state dir
SHARDS_DIR = "shards"  # in the agent's state dir: its ShardStore
KEEP = 2
SNAPSHOTS_PER_REQUEST = 2  # this step boundary and the next: ranks are at most one step apart

_lock = threading.Lock()
_registered: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
_optimizers: list[Any] = []  # weak references to every optimizer seen stepping, first one counts the steps
_status: dict[str, Any] = {"installed": False, "step": 0, "seen": None, "handled": None, "pending": 0,
                           "align": 1, "last": None, "error": None, "since": time.time()}


def register_state(name: str, get_state: Callable[[], Any], set_state: Callable[[Any], None]) -> None:
    """Save ``get_state()`` under ``name`` with every backup; :func:`restore_registered` calls ``set_state``.

    For a job that wants to say exactly what a backup holds (a data loader's
    position, an RNG, a scheduler). ``get_state`` runs at the step boundary
    and should return tensors or plain Python values.
    """
    with _lock:
        _registered[name] = (get_state, set_state)


def set_step(step: int) -> None:
    """The step the job is at (a job that resumed by itself says so, so shards carry the job's step numbers)."""
    _status["step"] = int(step)


def status() -> dict[str, Any]:
    return dict(_status)


def install() -> bool:
    """Register the global optimizer step hook once; False (and a note on stderr) when it cannot be.

    Called from the CCL plugin's autoload while torch is still importing
    itself: importing ``torch.optim`` from there would break torch's own
    start-up, so when ``torch.optim.optimizer`` is not loaded yet the hook is
    registered right after that module's body has run.
    """
    if _status["installed"]:
        return True
    try:
        module = sys.modules.get(_OPTIMIZER_MODULE)
        if module is not None and hasattr(module, "register_optimizer_step_post_hook"):
            _register(module)
        elif module is None:  # (a module still being imported by torch itself has no hook to call yet)
            after_import(_OPTIMIZER_MODULE, _register_quietly)
        return True
    except Exception as exc:
        _say(f"checkpoint backup not loaded: {type(exc).__name__}: {exc}")
        return False


_OPTIMIZER_MODULE = "torch.optim.optimizer"


def _register(module: Any) -> None:
    if not _status["installed"]:
        module.register_optimizer_step_post_hook(_after_step)
        _status["installed"] = True


def _register_quietly(module: Any) -> None:
    try:
        _register(module)
    except Exception as exc:
        _say(f"checkpoint backup not loaded: {type(exc).__name__}: {exc}")


def _say(message: str) -> None:
    with contextlib.suppress(Exception):
        print(f"rankscope: {message}", file=sys.stderr)


# ---- at each step boundary --------------------------------------------------------------


def _after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    try:
        import weakref

        if not any(ref() is optimizer for ref in _optimizers):
            _optimizers.append(weakref.ref(optimizer))
        if _optimizers[0]() is not optimizer:
            return  # one boundary per step, whatever the number of optimizers
        _status["step"] += 1
        if _new_request():
            _status["pending"] = SNAPSHOTS_PER_REQUEST
        if _status["pending"] > 0 and _status["step"] % _status["align"] == 0:
            _status["pending"] -= 1
            backup_now()
    except Exception as exc:  # never into user code
        _status["error"] = f"{type(exc).__name__}: {exc}"
        _say(f"checkpoint backup failed: {_status['error']}")


def _new_request() -> bool:
    path = os.environ.get(ENV_REQUEST)
    if not path:
        return False
    try:
        st = os.stat(path)
    except OSError:
        return False
    seen = (st.st_mtime_ns, st.st_size)
    if seen == _status["seen"]:
        return False
    _status["seen"] = seen
    try:
        request = json.loads(Path(path).read_text())
        request_id = str(request["request_id"])
        written = float(request.get("written", time.time()))
        align = max(1, int(request.get("align", 1)))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    if request_id == _status["handled"] or written < _status["since"]:
        return False  # done already, or a request to the process this one replaced (a restart)
    _status["handled"], _status["align"] = request_id, align
    return True


def snapshot() -> dict[str, Any]:
    """This process's state now, on the CPU: each optimizer's parameters and state, and the registered states."""
    import torch

    optimizers = []
    for ref in _optimizers:
        opt = ref()
        if opt is None:
            continue
        params = [p.detach().to("cpu", copy=True) for group in opt.param_groups for p in group["params"]]
        state = opt.state_dict()
        state["state"] = {k: {n: (v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v)
                              for n, v in s.items()} for k, s in state["state"].items()}
        optimizers.append({"params": params, "state": state})
    with _lock:
        registered = {name: get() for name, (get, _set) in _registered.items()}
    return {"step": _status["step"], "optimizers": optimizers, "registered": registered}


def backup_now() -> list[Path]:
    """Snapshot, serialise and write this rank's shard to its own and its peer's store; the files written."""
    import torch

    rank = int(os.environ.get("RANK", "0"))
    targets = _targets().get(str(rank), [])
    if not targets:
        return []
    buf = io.BytesIO()
    torch.save(snapshot(), buf)
    data = buf.getvalue()
    written = [write_shard(Path(d), rank, _status["step"], data, "own" if i == 0 else "peer")
               for i, d in enumerate(targets)]
    _status["last"] = _status["step"]
    return written


def _targets() -> dict[str, list[str]]:
    raw = os.environ.get(ENV_TARGETS)
    if not raw:
        return {}
    try:
        parsed = json.loads(raw)
    except ValueError:
        return {}
    return {str(k): [str(d) for d in v] for k, v in parsed.items()} if isinstance(parsed, dict) else {}


# ---- the store format (the same as rankscope.actions.shard_store.ShardStore) ------------------


def shard_path(store: Path, rank: int, step: int) -> Path:
    return store / f"rank{rank:06d}" / f"step{step:012d}.shard"


def write_shard(store: Path, rank: int, step: int, data: bytes, origin: str, keep: int = KEEP) -> Path:
    """Write one shard (``write_shard_files``) and delete this rank's steps but the newest ``keep``."""
    path = write_shard_files(store, rank, step, data, origin)
    for old in stored_steps(store, rank)[:-keep]:
        for p in (shard_path(store, rank, old), shard_path(store, rank, old).with_suffix(".json")):
            with contextlib.suppress(OSError):
                p.unlink()
    return path


def write_shard_files(store: Path, rank: int, step: int, data: bytes, origin: str) -> Path:
    """Write one shard atomically: data and checksum to temporary files, the checksum renamed first.

    The one definition of a shard on disk: the ranks write it here, the
    agent's ``ShardStore`` writes and reads the same files.
    """
    path = shard_path(store, rank, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{threading.get_ident()}"
    tmp = path.with_name(f"{path.name}.tmp-{tag}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    meta = path.with_suffix(".json")
    meta_tmp = meta.with_name(f"{meta.name}.tmp-{tag}")
    meta_tmp.write_text(json.dumps({"rank": rank, "step": step, "origin": origin, "size": len(data),
                                    "sha256": hashlib.sha256(data).hexdigest()}))
    os.replace(meta_tmp, meta)
    os.replace(tmp, path)
    return path


def stored_steps(store: Path, rank: int) -> list[int]:
    folder = store / f"rank{rank:06d}"
    with contextlib.suppress(OSError):
        return sorted(int(p.stem[4:]) for p in folder.glob("step*.shard") if p.with_suffix(".json").exists())
    return []


def read_shard(store: Path, rank: int, step: int) -> bytes | None:
    """The shard's bytes if present and matching its SHA-256; None otherwise (the caller takes another copy)."""
    path = shard_path(store, rank, step)
    try:
        meta = json.loads(path.with_suffix(".json").read_text())
        data = path.read_bytes()
    except (OSError, ValueError):
        return None
    if hashlib.sha256(data).hexdigest() != meta.get("sha256") or len(data) != meta.get("size"):
        _say(f"shard of rank {rank} step {step} in {store} does not match its checksum: not loaded")
        return None
    return data


def load(data: bytes, optimizers: Sequence[Any]) -> int:
    """Put a shard's state back into ``optimizers`` (parameters and state) and the registered states; its step."""
    import torch

    payload = torch.load(io.BytesIO(data), weights_only=True)
    for opt, saved in zip(optimizers, payload["optimizers"], strict=True):
        params = [p for group in opt.param_groups for p in group["params"]]
        with torch.no_grad():
            for p, value in zip(params, saved["params"], strict=True):
                p.copy_(value)
        opt.load_state_dict(saved["state"])
    with _lock:
        for name, value in payload.get("registered", {}).items():
            if name in _registered:
                _registered[name][1](value)
    set_step(int(payload["step"]))
    return int(payload["step"])
