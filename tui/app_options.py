"""What a session of the TUI is told at start: what the app does (``AppOptions``) and how a live view reaches the
job's agents (``AttachOptions``). Both are importable from ``rankscope.tui.app`` too, where the app and its start-up
live."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rankscope.analyzers.failslow_config import FailSlowConfig
from rankscope.analyzers.findings import Verdict
from rankscope.contract.snapshot import Layout

if TYPE_CHECKING:
    from rankscope.wire.tls import ClientTLS


@dataclass(frozen=True, slots=True)
class AppOptions:
    poll_interval_s: float = 1.0
    hang_after_s: float = 30.0  # capture automatically when progress stops this long (seeds AppState's)
    fail_slow: bool = False  # capture every 10 s
    capture_on_start: bool = True
    bundle_dir: Path = Path(".")
    layout: Layout | None = None
    read_only: bool = False
    pair_command: str = ""  # how a second person attaches read-only (the drill makes it); logged as the first event
    failslow_config: FailSlowConfig | None = None  # the fail-slow detectors' windows (None: drill-sized defaults)
    # Told every verdict that names suspects of a stopped job (not a running one's timing, not a restart's): the
    # verdict, its capture's wall time and rank -> machine then. The drill grades the first after its fault.
    on_verdict: Callable[[Verdict, float, dict[int, str]], None] | None = None
    # A terminal's SIGINT (kill -INT, a pairing wrapper) quits like q. Without a handler it lands as a
    # KeyboardInterrupt in whatever code runs then, and code that guards a call against every error can swallow
    # it (the view then ran on). Set by ``run_app`` only: tests run the app inside pytest's own loop.
    exit_on_sigint: bool = False


@dataclass(frozen=True, slots=True)
class AttachOptions:
    """How a live view reaches the job's agents (``run_attach``), beside what the app does (``AppOptions``)."""

    deadline_s: float = 10.0  # per agent and call
    capture_timeout_s: float = 5.0  # per py-spy call
    native: bool = False  # native frames in captures
    sample_hz: float = 0.0  # the agents sample every rank's main thread at this rate while polled; 0: off
    tls: ClientTLS | None = None  # reach the agents over TLS
    # (message, fix) when the token is known not to have the 'act' role: the action keys then say so instead of
    # failing later.
    act_problem: tuple[str, str] | None = None
    hostfile: Path | None = None  # re-read while attached
    evicted: tuple[str, ...] = ()  # agents the hostfile marks evicted
    machine_names: Mapping[str, str] = field(default_factory=dict)  # their machines' names, where it says
