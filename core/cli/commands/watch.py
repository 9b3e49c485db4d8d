"""`rankscope watch`: the live fail-slow detectors without the TUI, one line per verdict change.

For scripts, alerting and CI: poll every agent each ``--interval`` seconds
(metrics and CCL counters), capture stacks every ``--stack-interval`` seconds
for ByteRobust's aggregation rounds, feed everything to the pure
``FailSlowDetector`` and print a line each time its verdict changes (a new
suspect, more confidence, an agent lost or back). With ``--json`` each line is
one JSON object; the first is ``{"event": "start", ...}`` and the last
``{"event": "end", ...}``.

The JSON lines (``--json``), one object each:

- ``start``: agents, interval_s, stack_interval_s, duration_s, window_s, continuity_s, rounds_needed, sample_hz.
- ``verdict`` (each change of suspect, sources, confidence by 0.1, confident, missing ranks
  or unreachable agents): wall, elapsed_s, round, summary, machine (first of the top
  suspect), suspect_machines, kind ("machine", "pp", "rank", ...), ranks, sources,
  confidence (0..1), confident, slow_since_wall, suspects (``Suspect`` fields), flags
  (every detector's ``DetectorFlag``: detector, machine, ranks, metric, score, evidence,
  alarmed, held, required), trend (the job's step time: step_s, baseline_s, ratio, slope),
  machines (those that answered), unreachable (address, error, fix), missing_ranks, notes.
- ``error``: message, fix (each distinct problem once: a stack round that failed, ranks whose sampling failed, ...).
- ``end``: rounds, summary, machine, suspect_machines, confident, confidence, stack_rounds, exit.

Polls never overlap: the next one starts an interval after the previous one
*started*, or at once if it took longer (so a run may end up to one poll after
``--duration``). An agent that does not answer is reported in the line and the
watch goes on; it never stops on one machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from rankscope.cli.commands.target import add_slurm_args, add_tls_args, open_target
from rankscope.cli.options import add_failslow_args, add_layout_args, failslow_config, layout_from_args, seconds

if TYPE_CHECKING:
    from rankscope.analyzers.failslow_vote import FailSlowVerdict
    from rankscope.analyzers.rounds import StackRound
    from rankscope.contract.snapshot import JobSnapshot
    from rankscope.wire.tls import ClientTLS

DESCRIPTION = """\
Watch a running job for fail-slow machines without the TUI. The detectors are
the TUI's: step time per rank, cross-host metric outliers (Aegis, λ+2δ over
--window seconds), Minder's machine similarity with --continuity seconds of
persistence, stack-aggregation rounds (ByteRobust) every --stack-interval
seconds, and every rank's main thread sampled --sample-hz times a second
(the rank that rarely waits while its peers wait for it; no counters needed). Each verdict change is printed; with --json as one JSON object per
line (events: start, verdict, error, end).

Exit status: 0 when the watch ended without a confident fail-slow verdict, 1
when it ended with one (the last verdict's confidence reached 0.7; with
--until-confident it ends at the first such verdict), 4 when no
agent ever answered, 2 on bad input, 130 on Ctrl-C. A suspect below that
confidence is in the lines (and the "end" event) but does not fail the run.
"""

EXIT_CLEAN, EXIT_SUSPECT, EXIT_NO_AGENT = 0, 1, 4
RECORD_LIMIT = 3600  # snapshots kept for --record: an hour at one poll a second


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "watch", help="watch a job for slow machines and print each verdict change (headless, --json for scripts)",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--agents", help="comma-separated host:port list, Slurm range or @hostfile")
    p.add_argument("--hostfile", type=Path, help="file with one agent (host:port or range) per line")
    p.add_argument("--port", type=int, default=None, help="port for entries written without one")
    p.add_argument("--token-file", type=Path, help="file with the token to send; default: $RANKSCOPE_TOKEN")
    p.add_argument("--duration", type=seconds, default=None, help="stop after this many seconds (default: until Ctrl-C)")
    p.add_argument("--interval", type=seconds, default=1.0, help="seconds between polls of metrics and counters (default 1)")
    p.add_argument("--stack-interval", type=float, default=10.0,
                   help="seconds between stack captures for the aggregation rounds (default 10; 0 turns them off)")
    p.add_argument("--sample-hz", type=float, default=5.0,
                   help="sample every rank's main thread this many times a second without pausing it (py-spy "
                        "--nonblocking), for the wait-share straggler test; works without `rankscope run` "
                        "(default 5; 0 turns sampling off)")
    p.add_argument("--deadline", type=float, default=5.0, help="seconds each agent has to answer a poll (default 5)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds each py-spy call may take (default 5)")
    add_failslow_args(p)
    add_layout_args(p, "parallel layout (to name parallel groups in stack rounds)")
    p.add_argument("--record", type=Path, metavar="FILE",
                   help=f"also save every snapshot polled (the last {RECORD_LIMIT}) as a bundle, for "
                        "`rankscope attach --bundle`, a ticket or rankscope.analyzers.failslow.replay")
    p.add_argument("--until-confident", action="store_true",
                   help="end at the first confident verdict (exit 1) instead of watching on: for alerting and CI")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    add_tls_args(p)
    add_slurm_args(p)
    p.set_defaults(func=run)


# --------------------------------------------------------------------------
# What a line says
# --------------------------------------------------------------------------


def _unreachable(snap: JobSnapshot) -> list[dict[str, str]]:
    out = []
    for m in snap.machines:
        if not m.reachable:
            out.append({"address": m.address, "error": m.error.message if m.error else "no reason recorded",
                        "fix": m.error.fix if m.error else ""})
    return out


def verdict_event(fs: FailSlowVerdict, snap: JobSnapshot, started_mono: float) -> dict[str, Any]:
    """The JSON object of one verdict line (documented in README: `rankscope watch`)."""
    from rankscope.contract.bundle import to_jsonable

    v = fs.verdict
    top = v.top
    slow_since_wall = None
    if fs.slow_since_mono is not None:
        slow_since_wall = snap.captured.wall - (snap.captured.mono - fs.slow_since_mono)
    return {
        "event": "verdict",
        "wall": snap.captured.wall,
        "elapsed_s": round(snap.captured.mono - started_mono, 3),
        "round": fs.rounds,
        "summary": v.summary,
        "machine": fs.machine,
        "suspect_machines": list(fs.machines),
        "kind": str(top.kind) if top else None,
        "ranks": list(top.ranks) if top else [],
        "sources": list(top.sources) if top else [],
        "confidence": fs.confidence,
        "confident": fs.confident,
        "slow_since_wall": slow_since_wall,
        "suspects": to_jsonable(v.suspects),
        "flags": to_jsonable(fs.flags),
        "trend": to_jsonable(fs.trend) if fs.trend is not None else None,
        "machines": [m.machine for m in snap.machines if m.reachable],
        "unreachable": _unreachable(snap),
        "missing_ranks": list(v.missing_ranks),
        "notes": list(v.notes),
    }


def change_key(fs: FailSlowVerdict, snap: JobSnapshot) -> tuple[object, ...]:
    """Lines are printed when this changes: the suspect, its sources, confidence (0.1 steps), who answers."""
    return (*fs.key(), tuple(sorted(m.address for m in snap.machines if not m.reachable)))


def human_line(event: dict[str, Any]) -> str:
    import time

    stamp = time.strftime("%H:%M:%S", time.localtime(event.get("wall") or time.time()))
    kind = event["event"]
    if kind == "verdict":
        line = f"[{stamp}] {event['summary']}"
        for u in event["unreachable"]:
            line += f"\n    unreachable {u['address']}: {u['error']}" + (f" (fix: {u['fix']})" if u["fix"] else "")
        return line
    if kind == "error":
        return f"[{stamp}] error: {event['message']}" + (f" (fix: {event['fix']})" if event.get("fix") else "")
    if kind == "start":
        return f"[{stamp}] watching {len(event['agents'])} agent(s) every {event['interval_s']:g}s" + (
            f" for {event['duration_s']:g}s" if event["duration_s"] is not None else " (Ctrl-C to stop)")
    return f"[{stamp}] watch ended after {event['rounds']} round(s): {event['summary']}"


# --------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------


async def watch(args: argparse.Namespace, agents: list[str], token: str | None, emit: Callable[[dict[str, Any]], None],
                record: deque[JobSnapshot] | None = None, tls: ClientTLS | None = None) -> int:
    """The watch loop; every snapshot polled is appended to ``record`` when given."""
    import asyncio
    import time

    from rankscope.analyzers.failslow import FailSlowDetector
    from rankscope.analyzers.rounds import try_stack_round
    from rankscope.wire.client import JobClient

    config = failslow_config(args)
    layout = layout_from_args(args)
    detector = FailSlowDetector(config, layout)
    started = time.monotonic()
    end = started + args.duration if args.duration is not None else None
    emit({"event": "start", "wall": time.time(), "agents": agents, "interval_s": args.interval,
          "stack_interval_s": args.stack_interval or None, "duration_s": args.duration,
          "window_s": config.window_s, "continuity_s": config.continuity_s, "rounds_needed": config.rounds_needed,
          "sample_hz": args.sample_hz or None})
    last_key: tuple[object, ...] | None = None
    last: FailSlowVerdict | None = None
    next_stacks = started  # the first poll is a capture: a round from the start
    ever_answered = False
    stack_rounds = 0
    errors_said: set[str] = set()

    def error(message: str, fix: str = "") -> None:
        if message not in errors_said:  # the same failure every second is one line, not a flood
            errors_said.add(message)
            emit({"event": "error", "wall": time.time(), "message": message, "fix": fix})

    async with JobClient(agents, token, deadline_s=args.deadline, tls=tls) as client:
        while True:
            tick = time.monotonic()
            if end is not None and tick >= end:
                break
            stack_round = args.stack_interval > 0 and tick >= next_stacks
            if stack_round:
                next_stacks = tick + args.stack_interval
                snap = await client.capture(timeout_s=args.timeout, sample_hz=args.sample_hz)  # keeps the sampling
            else:
                snap = await client.poll(sample_hz=args.sample_hz)
            ever_answered = ever_answered or any(m.reachable for m in snap.machines)
            if record is not None:
                record.append(snap)
            analysis: StackRound | None = None
            if stack_round:
                try:
                    analysis, problem = try_stack_round(snap, layout)
                except Exception as exc:  # an analyzer bug must cost this round, not the watch
                    analysis, problem = None, f"stack round failed: {type(exc).__name__}: {exc}"
                stack_rounds += analysis is not None
                if problem:
                    error(problem, "pass --tp/--pp/--dp/--ranks-per-machine that match the job, or leave them out")
            try:
                fs: FailSlowVerdict | None = detector.update(snap, analysis)
            except Exception as exc:  # an analyzer bug must cost this poll, not the watch
                error(f"fail-slow analysis failed: {type(exc).__name__}: {exc}", "report this as a rankscope bug")
                fs = None
            for problem in detector.sampling_problems:  # ranks the wait test cannot speak for
                error(problem)
            if fs is not None:
                key = change_key(fs, snap)
                if key != last_key:
                    emit(verdict_event(fs, snap, started))
                    last_key = key
                last = fs
                if args.until_confident and fs.confident:
                    break
            wake = tick + args.interval
            if end is not None:
                wake = min(wake, end)
            delay = wake - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
    summary = last.verdict.summary if last is not None else "no poll completed"
    code = EXIT_NO_AGENT if not ever_answered else (EXIT_SUSPECT if last is not None and last.confident else EXIT_CLEAN)
    emit({"event": "end", "wall": time.time(), "rounds": last.rounds if last is not None else 0, "summary": summary,
          "machine": last.machine if last is not None else None,
          "suspect_machines": list(last.machines) if last is not None else [],
          "confident": last.confident if last is not None else False, "confidence": last.confidence if last is not None else 0.0,
          "stack_rounds": stack_rounds, "exit": code})
    return code


def run(args: argparse.Namespace) -> int:
    import asyncio

    from rankscope.contract.errors import RankscopeError
    from rankscope.wire.slurm import missing_lines

    if args.interval <= 0 or args.deadline <= 0 or args.timeout <= 0:
        raise RankscopeError("--interval, --deadline and --timeout must be positive", "e.g. --interval 1 --deadline 5")
    if args.sample_hz < 0 or args.sample_hz > 20:
        raise RankscopeError("--sample-hz must be between 0 (off) and 20", "e.g. --sample-hz 5")
    if args.stack_interval < 0 or (args.duration is not None and args.duration <= 0):
        raise RankscopeError("--stack-interval must be 0 or more and --duration positive",
                             "e.g. --duration 60 --stack-interval 10 (0 turns stack rounds off)")
    failslow_config(args)  # both refused here, before any agent is asked
    layout_from_args(args)
    if args.record is not None and not args.record.resolve().parent.is_dir():
        raise RankscopeError(f"--record {args.record}: folder {args.record.resolve().parent} does not exist",
                             "create the folder first or pass a path in an existing one")
    out: TextIO = sys.stdout

    def emit(event: dict[str, Any]) -> None:
        out.write((json.dumps(event, default=str) if args.json else human_line(event)) + "\n")
        out.flush()  # a pipe reader (a script, `tail -f`) sees each change as it happens

    record: deque[JobSnapshot] | None = deque(maxlen=RECORD_LIMIT) if args.record is not None else None
    agents: list[str] = []
    try:
        with open_target(args) as target:
            agents = target.agents
            for line in missing_lines(target.missing):
                emit({"event": "error", "wall": None, "message": line.strip(),
                      "fix": "the other nodes are watched; read the node's slurmd log"})
            code = asyncio.run(watch(args, agents, target.token, emit, record, tls=target.tls))
    except KeyboardInterrupt:
        emit({"event": "end", "wall": None, "rounds": None, "summary": "interrupted", "machine": None,
              "suspect_machines": [], "confident": None, "confidence": None, "stack_rounds": None, "exit": 130})
        code = 130
    finally:
        if record is not None and record:
            _write_record(args, agents, tuple(record))
    return code


def _write_record(args: argparse.Namespace, agents: list[str], snapshots: tuple[JobSnapshot, ...]) -> None:
    """Save the watched series (interrupted or not: an incident's record is never thrown away)."""
    import time

    from rankscope import __version__
    from rankscope.contract.bundle import Bundle, write_bundle

    config = failslow_config(args)
    bundle = Bundle(snapshots=snapshots, created_wall=time.time(),
                    meta={"command": "watch", "rankscope_version": __version__, "agents": agents,
                          "interval_s": args.interval, "stack_interval_s": args.stack_interval,
                          "window_s": config.window_s, "continuity_s": config.continuity_s,
                          "rounds": config.rounds_needed})
    try:
        path = write_bundle(bundle, args.record)
    except OSError as exc:
        print(f"rankscope watch: error: could not write the record {args.record}: {exc}", file=sys.stderr)
        print("  fix: pass --record a path in a writable folder with room to spare", file=sys.stderr)
        return
    print(f"rankscope watch: {len(snapshots)} snapshot(s) recorded to {path}", file=sys.stderr)
