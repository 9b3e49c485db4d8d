"""`rankscope drill`: a real TP x PP x DP job on local "machines", a named fault, and the ground truth."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rankscope.contract.errors import RankscopeError

DESCRIPTION = """\
Start a real PyTorch job (gloo on CPU; NCCL on GPUs with --backend nccl) with tensor, pipeline and data
parallelism, spread over --machines local machines: one torchrun node and one
rankscope agent each, on loopback. Inject a named fault at a rank (or a
machine) and a step, and look at the job the way an on-call engineer would.

Without --headless the TUI opens attached to the live drill. With --headless
the drill waits until progress stops (hang faults) or until a capture step
(slow faults and the healthy baseline 'none'), captures a snapshot through the
agents, writes the bundle and prints the ground truth beside what was
captured. Every process the drill started is stopped at the end, also on
Ctrl-C and on failure.

Faults: none, hang-compute, hang-p2p, hang-collective, dataloader-stall,
dataloader-deadlock, checkpoint-stall, crash, desync (a group runs one step
more than the rest), sigstop (a rank stopped, state T) (hangs); slow-compute, slow-gpu (--backend nccl),
slow-comm, slow-dataloader, cpu-contention, thermal (fail-slow; --fault-on/--fault-off make them
intermittent).

Example: rankscope drill --headless --json --fault hang-p2p --fault-rank 5 --fault-step 20
"""


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "drill", help="run a real TP/PP/DP job on local machines, inject a fault, capture it",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (default 2)")
    p.add_argument("--dp", type=int, default=2, help="data-parallel replicas (default 2)")
    p.add_argument("--machines", type=int, default=4, help="local machines: torchrun nodes with one agent each (default 4)")
    p.add_argument("--steps", type=int, default=None,
                   help="training steps (default: fault step + 40 headless, fault step + 2000 with the TUI, so the "
                        "job is still training after an eviction or a hot-update)")
    p.add_argument("--fault", default="hang-p2p", help="fault name, or 'none' for a healthy baseline (default hang-p2p)")
    p.add_argument("--fault-rank", type=int, help="the faulty rank (default: drawn from --seed)")
    p.add_argument("--fault-machine", type=int, help="draw the faulty rank from this machine (0-based)")
    p.add_argument("--fault-step", type=int, default=20, help="step at which the fault starts (default 20)")
    p.add_argument("--fault-group", choices=("tp", "pp", "dp"),
                   help="group of hang-collective (default tp), desync (default tp: the ranks one step ahead) "
                        "or slow-comm (default pp)")
    p.add_argument("--fault-factor", type=float, default=2.0,
                   help="slow-compute/slow-gpu/thermal: how many times longer a step takes (default 2.0)")
    p.add_argument("--fault-delay-ms", type=float, default=50.0,
                   help="slow-comm/slow-dataloader: delay per send or per batch (default 50); a dataloader "
                        "delay shows only once it exceeds a step's time, since the worker prefetches")
    p.add_argument("--fault-on", type=int, default=0, help="intermittent slow fault: steps on (with --fault-off)")
    p.add_argument("--fault-off", type=int, default=0, help="intermittent slow fault: steps off")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the data, the model and the random fault rank (default: drawn at random and "
                        "printed, so a drill can be repeated with --seed)")
    p.add_argument("--checkpoint-every", type=int, default=5, help="steps between checkpoints (default 5)")
    p.add_argument("--loader-workers", type=int, default=1, help="dataloader worker processes per rank (default 1)")
    p.add_argument("--stall-seconds", type=float, default=5.0,
                   help="progress stopped = no rank advanced for this long (default 5)")
    p.add_argument("--start-timeout", type=float, default=180.0, help="seconds for the job to start (default 180)")
    p.add_argument("--stall-timeout", type=float, default=120.0, help="seconds to wait for the stall (default 120)")
    p.add_argument("--standbys", type=int, default=None,
                   help="idle warm standby machines that join when `e` evicts (default with the TUI: the P99 "
                        "binomial pool, and at least enough to replace one pipeline or data-parallel group; "
                        "headless: 0, no recovery)")
    p.add_argument("--cold-restarts", action="store_true",
                   help="with standbys: start every node with torchrun, importing torch at each restart, instead of "
                        "from parked interpreters that already did (what a job without warm standbys pays)")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                   help="gloo: CPU tensors (default); nccl: each rank on a GPU, round-robin; with fewer GPUs than "
                        "ranks they share, each with its own NCCL_HOSTID, over sockets on loopback")
    p.add_argument("--no-counters", action="store_true", help="do not load the CCL counter plugin in the ranks")
    p.add_argument("--no-agents", action="store_true", help="capture in this process with the probes instead of agents")
    p.add_argument("--keep-run-dir", action="store_true",
                   help="with the TUI: keep the temporary run directory (logs, progress, checkpoints, the agents' "
                        "state) after quitting; by default it is removed, so no dead drill's agents are attached by "
                        "mistake (a --run-dir given is always kept)")
    p.add_argument("--run-dir", type=Path, help="folder for logs, progress, checkpoints and the bundle (default: a temp dir)")
    p.add_argument("-o", "--output", type=Path, help="write the bundle here (default: RUN_DIR/bundle.json)")
    p.add_argument("--headless", action="store_true", help="no TUI: run, capture, report and stop")
    p.add_argument("--show-fault", action="store_true",
                   help="with the TUI: print the injected fault before the TUI opens (by default only the report "
                        "names it, so the drill stays blind)")
    p.add_argument("--launcher", choices=("local", "slurm"), default="local",
                   help="local: torchrun nodes started here (default); slurm: a local multi-node Slurm cluster "
                        "(or the one $SLURM_CONF names) runs the job as one sbatch, and the incident is handled "
                        "end to end: attach --slurm (the TUI, or headless with --headless/--json), evict the suspects "
                        "(drain, requeue), resume")
    p.add_argument("--json", action="store_true", help="print the report as JSON (with --headless or --suite)")
    p.add_argument("--suite", choices=("failslow",),
                   help="run the fail-slow scorecard instead of one drill: slow faults at seeded random ranks plus "
                        "healthy baselines, each watched live; prints detection, attribution, time to a confident "
                        "verdict and precision/recall/F1 (see rankscope.drill.suite)")
    p.add_argument("--suite-drills", type=int, default=20, help="--suite: faulty drills (default 20)")
    p.add_argument("--suite-baselines", type=int, default=5, help="--suite: healthy baselines (default 5)")
    p.add_argument("--stack-interval", type=float, default=10.0,
                   help="--suite: seconds between stack captures (default 10, ByteRobust's rounds)")
    p.add_argument("--time-limit", type=float, default=90.0,
                   help="--suite: seconds after the fault's onset to wait for a confident verdict (default 90)")
    p.add_argument("--suite-modes", default="prepared",
                   help="--suite: how each drill's job is started, comma-separated: prepared (with the CCL "
                        "counters, as `rankscope run` does), unprepared (plain torchrun, no counters: the "
                        "scorecard's 'unprepared job' column); default prepared")
    p.set_defaults(func=run)


def build_config(args: argparse.Namespace) -> Any:
    from rankscope.drill.faults import DrillLayout, make_plan
    from rankscope.drill.launcher import TrainingOptions
    from rankscope.drill.session import DrillConfig

    layout = DrillLayout(tp=args.tp, pp=args.pp, dp=args.dp, machines=args.machines)
    if args.seed is None:  # `run` draws it (and prints it) first; a caller of this alone gets the fixed 0
        args.seed = 0
    if args.fault_machine is not None and not 0 <= args.fault_machine < layout.machines:
        raise RankscopeError(f"--fault-machine {args.fault_machine} does not exist",
                             f"choose a machine from 0 to {layout.machines - 1}")
    plan = make_plan(
        args.fault, layout, rank=args.fault_rank, machine=args.fault_machine, step=args.fault_step,
        group=args.fault_group, factor=args.fault_factor, delay_ms=args.fault_delay_ms,
        on_steps=args.fault_on, off_steps=args.fault_off, seed=args.seed, backend=getattr(args, "backend", "gloo"),
    )
    tui = not (args.headless or args.no_agents or getattr(args, "suite", None))
    steps = args.steps if args.steps is not None else args.fault_step + (2000 if tui else 40)
    if plan.name != "none" and steps <= plan.step:
        raise RankscopeError(f"--steps {steps} ends before --fault-step {plan.step}", f"pass --steps {plan.step + 20} or more")
    if plan.spec.role == "dataloader" and args.loader_workers < 1:
        raise RankscopeError(f"{plan.name} acts in a dataloader worker process, and --loader-workers is 0",
                             "pass --loader-workers 1 or more")
    backend = getattr(args, "backend", "gloo")
    if backend == "nccl":
        from rankscope.drill.gpu import check_cuda

        check_cuda(layout.world)  # here, before any process starts: the error names the fix
    training = TrainingOptions(steps=steps, seed=args.seed, loader_workers=args.loader_workers,
                               checkpoint_every=args.checkpoint_every, backend=backend)
    if args.standbys is not None and args.standbys < 0:
        raise RankscopeError(f"--standbys {args.standbys} is negative", "pass 0 (no recovery) or more")
    if args.standbys is not None:
        standbys = args.standbys
    elif args.headless or args.no_agents:
        standbys = 0
    else:
        from rankscope.drill.control import default_standbys

        # `e` over-evicts a whole suspect group: a pipeline or data-parallel group spans up to PP or DP
        # machines here, so the pool must refill that many for the drill to recover, whatever P99 says.
        standbys = max(default_standbys(layout.machines), min(max(layout.pp, layout.dp), layout.machines))
    return DrillConfig(layout=layout, plan=plan, training=training, run_dir=args.run_dir, agents=not args.no_agents,
                       stall_seconds=args.stall_seconds, start_timeout_s=args.start_timeout,
                       stall_timeout_s=args.stall_timeout, counters=not args.no_counters, standbys=standbys,
                       warm=not args.cold_restarts)


def run(args: argparse.Namespace) -> int:
    if args.backend != "gloo" and args.launcher == "slurm":
        raise RankscopeError(f"--backend {args.backend} runs with the local launcher only",
                             "drop --launcher slurm, or run it on gloo")
    if args.seed is None:
        import secrets

        args.seed = secrets.randbelow(1_000_000)
        print(f"seed {args.seed} (pass --seed {args.seed} to repeat this drill)", file=sys.stderr, flush=True)
    if args.suite:
        return _run_suite(args)
    if args.launcher == "slurm":
        return _run_slurm(args)
    config = build_config(args)
    if not args.headless:
        return _run_attached(config, args)
    from rankscope.drill.session import run_headless

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    report = run_headless(config, bundle_path=args.output, on_event=say)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print("\n".join(report_lines(report)))
    return 0


def _run_slurm(args: argparse.Namespace) -> int:
    from rankscope.drill.slurm_drill import SlurmDrillConfig, run_slurm_drill, run_slurm_drill_attached

    attached = not (args.headless or args.json)
    if attached:
        try:
            import rankscope.tui.app  # noqa: F401
        except ImportError:
            print("rankscope drill: the TUI is not available here; running headless", file=sys.stderr)
            attached = False
    args.headless = not attached
    base = build_config(args)
    layout = base.layout
    standbys = args.standbys if args.standbys is not None else min(max(layout.pp, layout.dp), layout.machines)
    config = SlurmDrillConfig(layout=layout, plan=base.plan, training=base.training, run_dir=args.run_dir,
                              standbys=standbys, stall_seconds=args.stall_seconds,
                              start_timeout_s=max(args.start_timeout, 300.0), stall_timeout_s=args.stall_timeout)

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    from rankscope.wire.slurm import sigterm_as_interrupt

    with sigterm_as_interrupt():  # a kill or a closed pane still stops the job and the cluster it started
        if attached:
            report = run_slurm_drill_attached(config, on_event=say)
            keys: tuple[str, ...] = ("job", "nodes", "drained", "restarts", "now_on", "steps", "resumed_from")
        else:
            report = run_slurm_drill(config, on_event=say)
            keys = ("job", "nodes", "verdict", "evicted", "drained", "restarted_on", "resumed_from", "resumed")
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        for key in keys:
            print(f"{key}: {report.get(key)}")
    return int(report.get("tui_exit", 0))


def _run_suite(args: argparse.Namespace) -> int:
    from rankscope.drill.faults import DrillLayout
    from rankscope.drill.suite import SuiteConfig, run_suite, scorecard_lines

    if args.suite_drills < 0 or args.suite_baselines < 0 or args.suite_drills + args.suite_baselines == 0:
        raise RankscopeError("--suite needs at least one drill", "pass --suite-drills 20 --suite-baselines 5")
    if args.stack_interval < 0 or args.time_limit <= 0:
        raise RankscopeError("--stack-interval must be 0 or more and --time-limit positive",
                             "e.g. --stack-interval 10 --time-limit 90")
    modes = tuple(m.strip() for m in args.suite_modes.split(",") if m.strip())
    if not modes or set(modes) - {"prepared", "unprepared"}:
        raise RankscopeError(f"--suite-modes {args.suite_modes!r}: each mode is prepared or unprepared",
                             "e.g. --suite-modes prepared,unprepared")
    config = SuiteConfig(layout=DrillLayout(tp=args.tp, pp=args.pp, dp=args.dp, machines=args.machines), modes=modes,
                         faulty=args.suite_drills, baselines=args.suite_baselines, seed=args.seed,
                         fault_step=args.fault_step, stack_interval_s=args.stack_interval,
                         time_limit_s=args.time_limit, start_timeout_s=args.start_timeout, run_root=args.run_dir,
                         backend=args.backend)
    if args.backend == "nccl":
        from rankscope.drill.gpu import check_cuda

        check_cuda(config.layout.world)
    result = run_suite(config, say=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(json.dumps(result, indent=2, default=str) if args.json else "\n".join(scorecard_lines(result)))
    return 0


def _run_attached(config: Any, args: argparse.Namespace) -> int:
    """The TUI attached to the live drill; the drill stops when the TUI quits."""
    try:
        from rankscope.tui.app import AppOptions, AttachOptions, run_attach
    except ImportError:
        print("rankscope drill: the TUI is not available here; running headless", file=sys.stderr)
        args.headless = True
        return run(args)
    from rankscope.drill.session import DrillSession

    verdicts: list[tuple[Any, float, dict[int, str], float | None]] = []
    with DrillSession(config) as s:
        # The fault stays hidden until the report (a blind drill), unless the person asked for it.
        fault = f"fault {config.plan.name} at rank {config.plan.rank}, step {config.plan.step}" \
            if args.show_fault else "a fault is injected (the report names it when you quit; --show-fault now)"
        print(f"drill {s.launcher.run_id}: {fault} (seed {args.seed}); waiting for the job to start ...",
              file=sys.stderr, flush=True)
        s.wait_for_steps(1, config.start_timeout_s)
        if not s.agents:
            raise RankscopeError("the drill's agents did not start, so the TUI has nothing to attach to",
                                 f"read the agent logs in {s.run_dir / 'logs'}, or run with --headless")
        from rankscope.tui.screens.pair import pair_hint

        command = write_pair_command(s.run_dir, list(s.agents.values()), s.launcher.ensure_token(), config.layout)
        print(pair_hint(command), file=sys.stderr, flush=True)
        from rankscope.drill.control import HOSTFILE

        def on_verdict(verdict: Any, wall: float, placement: dict[int, str]) -> None:
            if not verdicts:  # the first verdict naming suspects; the fault's onset read now, before a restart
                verdicts.append((verdict, wall, placement, fault_onset_wall(s)))

        code = int(run_attach(list(s.agents.values()), s.token(),
                              AppOptions(layout=config.layout.to_snapshot_layout(), pair_command=command,
                                         on_verdict=on_verdict),
                              AttachOptions(hostfile=s.run_dir / HOSTFILE)) or 0)
    # The session has stopped everything it started: say what the drill did (the TUI's screen is gone).
    s.watcher.poll()
    graded = verdict_grade_lines(s.truth, *verdicts[0]) if verdicts else ["verdict: none named a suspect"]
    lines = attached_report_lines(s, code, graded)
    if args.run_dir is None and not args.keep_run_dir:
        import shutil

        shutil.rmtree(s.run_dir, ignore_errors=True)
        lines[-1] = f"removed the run directory {s.run_dir} (--keep-run-dir keeps it)"
    lines.append(f"repeat this drill: --seed {args.seed}")
    print("\n".join(lines), flush=True)
    return code


def fault_onset_wall(s: Any) -> float | None:
    """When the fault began: the faulty rank's last report of a completed step, once it stopped at its fault step
    (a hang); None for other faults or when it went on (read when the first verdict comes, before any restart)."""
    from rankscope.drill.progress import read_progress

    if s.truth.category != "hang" or s.plan.rank < 0:
        return None
    p = read_progress(s.run_dir).get(s.plan.rank)
    fault_step = s.truth.step if s.truth.step is not None else s.plan.step
    return p.wall if p is not None and p.step <= fault_step else None


def verdict_grade_lines(truth: Any, verdict: Any, wall: float, placement: dict[int, str],
                        onset_wall: float | None) -> list[str]:
    """The TUI's first verdict graded against the drill's ground truth: right machines, extra machines (of the
    plan `e` executes and of the over-eviction), time from the fault to the verdict."""
    from rankscope.drill.scoring import score_verdict

    graded = score_verdict(verdict, truth, placement)
    when = f", {wall - onset_wall:.1f} s after the fault" if onset_wall is not None else ""
    mark = "right" if graded.get("correct") else "WRONG"
    expected = expected_suspect_words(truth)
    lines = [f"verdict{when}: {verdict.summary}  [{mark}: fault on {truth.machine}, expected {expected}]"]
    lines.extend(eviction_lines(graded.get("eviction")))
    return lines


def expected_suspect_words(truth: Any) -> str:
    """``rank 3 on machine-1``, ``PP group (ranks 2,6) on machine-1, machine-3``: the ground truth's suspect as the
    reports say it (a drill's ``GroundTruth`` or its JSON form)."""
    from rankscope.contract.ranks import compact_ranks

    get = truth.get if isinstance(truth, dict) else lambda name: getattr(truth, name)
    kind, ranks, machines = str(get("suspect_kind")), tuple(get("suspect_ranks") or ()), get("suspect_machines")
    where = f" on {', '.join(machines)}" if machines else ""
    if kind == "none" or not ranks:
        return "nobody" if kind == "none" else f"{kind}{where}"
    if kind == "rank" and len(ranks) == 1:
        return f"rank {ranks[0]}{where}"
    name = "machine" if kind == "machine" else f"{kind.upper()} group" if kind not in ("desync", "rank") else kind
    return f"{name} (ranks {compact_ranks(ranks)}){where}"


def attached_report_lines(s: Any, tui_exit: int, graded: list[str] | None = None) -> list[str]:
    """What an attached drill prints once its TUI quit and it stopped: steps, the verdict graded (``graded``),
    recoveries, leftovers, where to look."""
    from rankscope.contract.ranks import compact_ranks

    quit_how = "the TUI quit" if tui_exit == 0 else f"the TUI ended with code {tui_exit}"
    lines = [f"drill {s.launcher.run_id} stopped ({quit_how}); fault {s.plan.name} at rank {s.plan.rank}, "
             f"step {s.plan.step}"]
    by_step: dict[int, list[int]] = {}
    for rank, step in s.steps().items():
        by_step.setdefault(step, []).append(rank)
    reached = "; ".join(f"ranks {compact_ranks(ranks, 8)} at step {step}" for step, ranks in sorted(by_step.items()))
    lines.append(f"steps: {reached or 'no rank reported a step'} (of {s.config.training.steps})")
    lines.extend(graded or ())
    recovery = s.recovery
    for event in recovery.events if recovery is not None else ():
        what = " ".join(event.evicted) if event.evicted else "in place"
        if event.ok:
            joined = f", {' '.join(event.joined)} joined" if event.joined else ""
            lines.append(f"{event.kind} {what}: restarted on {' '.join(event.machines)}{joined}, "
                         f"resumed from step {event.resume_step}")
        else:
            lines.append(f"{event.kind} {what}: not restarted: {event.message}")
    for error in recovery.errors if recovery is not None else ():
        lines.append(f"recovery error: {error}")
    if s.leftovers:
        lines.append(f"stopped {len(s.leftovers)} leftover processes by force: {' '.join(map(str, s.leftovers))}")
    else:
        lines.append("every process the drill started has stopped")
    lines.append(f"logs, losses and progress: {s.run_dir}")
    return lines


PAIR_COMMAND = "pair-command.txt"


def write_pair_command(run_dir: Path, agents: list[str], token_file: Path, layout: Any) -> str:
    """Write the drill's agents to a hostfile; the command a second person runs to watch read-only."""
    import shlex

    from rankscope.drill.control import HOSTFILE
    from rankscope.wire.agents_spec import write_hostfile

    hostfile = run_dir / HOSTFILE
    write_hostfile(hostfile, agents)
    argv = [*running_rankscope(), "attach", "--hostfile", str(hostfile), "--token-file", str(token_file), "--read-only",
            "--tp", str(layout.tp), "--pp", str(layout.pp), "--dp", str(layout.dp),
            "--ranks-per-machine", str(layout.ranks_per_machine)]
    command = shlex.join(argv)
    (run_dir / PAIR_COMMAND).write_text(command + "\n")  # the same line, for a script or a pane to run
    return command


def running_rankscope() -> list[str]:
    """The command that runs this very rankscope, whatever the PATH of the one who pastes it."""
    script = Path(sys.executable).parent / "rankscope"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "rankscope"]


def eviction_lines(eviction: dict[str, Any] | None) -> list[str]:
    """The plan `e` executes for the verdict (``scoring.score_eviction``): the default and the over-eviction."""
    if not eviction:
        return []
    lines = []
    for scope in ("precise", "group"):
        e = eviction[scope]
        name = "evict what the evidence names" if scope == "precise" else "over-evict the group (ByteRobust)"
        default = " (default)" if eviction["default"] == scope else ""
        lines.append(f"  {name}{default}: {' '.join(e['machines'])}: faulty machine "
                     f"{'evicted' if e['right'] else 'NOT evicted'}, extra machines: {e['extra_machines']}, "
                     f"standbys used: {e['standbys']}")
        if eviction["precise"] == eviction["group"]:
            break
    lines.append(f"  why: {eviction['reason']}")
    return lines


def report_lines(report: dict[str, Any]) -> list[str]:
    truth = report["ground_truth"]
    cap = report["captured"]
    lines = [
        f"drill {report['run_id']}  bundle: {report['bundle']}",
        f"ground truth: {truth['fault']} on rank {truth['rank']} ({truth['machine']}) at step {truth['step']}; "
        f"expected suspect: {expected_suspect_words(truth)}",
        f"progress: {report['stall']['reason']} at steps {report['stall']['steps']}",
    ]
    for m in cap["machines"]:
        lines.append(f"  {m['machine']} reachable={m['reachable']} ranks={m['ranks_seen']} stacks={m['stacks_captured']}")
        for rank, r in m["ranks"].items():
            # Short: skip the wrappers (torch's logger, the CCL plugin's hooks) between the real calls.
            names = [f.split(" (")[0] for f in r["main"] if "wrapper" not in f and "ccl_plugin/" not in f]
            top = " <- ".join(names[:4]) if names else (r["error"] or "no stack")
            subs = ", ".join(f"{sp['role']}:{sp['pid']}" for sp in r["subprocesses"])
            lines.append(f"    rank {rank}: {top}   [{subs}]")
    lines.append(f"injected frame {cap['injected_frame']}: found in {cap['injected_frame_found_in']}")
    verdict = report.get("verdict")
    if verdict is not None:
        mark = "right" if verdict.get("correct") else "WRONG"
        lines.append(f"verdict: {verdict.get('summary')}  [{mark}: fault on {truth['machine']}, expected "
                     f"{expected_suspect_words(truth)}]")
        lines.extend(eviction_lines(verdict.get("eviction")))
    lines.append(f"times (s): {report['times_s']}")
    return lines
