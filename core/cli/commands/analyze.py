"""`rankscope analyze`: the stack-aggregation verdict for a bundle or a folder of py-spy dumps.

    rankscope analyze incident.json --tp 2 --pp 4 --dp 4 --order tp-pp-dp --ranks-per-machine 2
    rankscope analyze --pyspy-dir dumps/ --tp 2 --pp 4 --dp 4 --order tp-pp-dp --ranks-per-machine 2 --json
    rankscope analyze --flight-recorder traces/ --tp 2 --pp 2 --dp 2
    rankscope analyze incident/    # NCCL RAS, watchdog lines, fr_trace, DETAIL errors, Inspector (+ py-spy dumps)

Sizes typed here override the layout recorded in the bundle; communicator
membership recorded by the CCL plugin overrides both. When the snapshot
carries CCL counters their verdict is merged with the stacks' (agreement
counts for more; ``stacks_summary`` keeps the stacks' own headline). A
bundle holding a series of snapshots is also read as fail-slow rounds (one
round each).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rankscope.cli.options import LAYOUT_FIX, add_layout_args, layout_from_args
from rankscope.contract.errors import RankscopeError

if TYPE_CHECKING:
    from rankscope.analyzers.findings import Verdict


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "analyze",
        help="group ranks' stacks and name the suspect parallel group and machines",
        description="Group every rank's stacks (ByteRobust-style aggregation) and rank the parallel groups "
                    "that explain the outliers, with their machines and the evidence.",
    )
    p.add_argument("bundle", nargs="?", type=Path, help="a bundle written by `rankscope snapshot -o` or the TUI")
    src = p.add_argument_group("other sources (instead of a bundle)")
    src.add_argument("--dumps", "--pyspy-dir", dest="pyspy_dir", type=Path, metavar="PATH",
                     help="a folder or one pasted file of saved py-spy dumps, text as printed or --json: "
                          "rank<R>.txt|json per rank (rank<R>.<name>.* for a subprocess), or one file per node "
                          "holding several `py-spy dump` outputs one after another")
    src.add_argument("--node-order", metavar="A,B,...",
                     help="the order of per-node dump files (file names or stems) when ranks are numbered "
                          "node by node (default: file-name order)")
    src.add_argument("--flight-recorder", type=Path, metavar="DIR",
                     help="folder of PyTorch NCCL flight-recorder dumps")
    src.add_argument("--op-trace", type=Path, metavar="FILE",
                     help="a per-operation timing trace (parquet in the ByteDance StragglerAnalysis schema, or CSV): "
                          "which worker is slow and in which op, which stage is slow, or that nobody is")
    src.add_argument("--logs", type=Path, metavar="PATH",
                     help="a folder or one pasted file of the logs NCCL and PyTorch print in a hang: NCCL RAS "
                          "(text or JSON), ProcessGroupNCCL watchdog lines, fr_trace's report, "
                          "TORCH_DISTRIBUTED_DEBUG=DETAIL mismatch errors, NCCL Inspector output; py-spy dumps in "
                          "the same folder are read with them (a folder given as BUNDLE is sniffed the same way)")
    src.add_argument("--trace-meta", type=Path, metavar="FILE",
                     help="the trace's job metadata (meta-*.yaml: dp_size, pp_size, tp_size, world_size)")
    add_layout_args(p, "parallel layout (overrides the bundle's)")
    sig = p.add_argument_group("signatures")
    sig.add_argument("--keep-lines", action="store_true", help="keep line numbers in signatures")
    sig.add_argument("--no-fold", action="store_true", help="keep wrapper frames (torch, functools, threading)")
    sig.add_argument("--no-subprocesses", action="store_true", help="main processes only")
    sig.add_argument("--idle-threads", action="store_true", help="include parked threads (queue/lock waits)")
    p.add_argument("--snapshot", type=int, default=None, metavar="I",
                   help="which snapshot of a bundle series to judge (default: the incident: the latest capture "
                        "whose stacks name suspects of a stuck job, else the latest capture, else the last)")
    p.add_argument("--json", action="store_true", help="print the verdict as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rankscope.analyzers.stacks import SignatureOptions
    from rankscope.analyzers.verdict_json import verdict_to_json

    sources = [x for x in (args.bundle, args.pyspy_dir, args.flight_recorder, args.op_trace, args.logs)
               if x is not None]
    if len(sources) != 1:
        raise RankscopeError(
            "give exactly one of BUNDLE, --dumps PATH, --flight-recorder DIR, --op-trace FILE or --logs PATH",
            "e.g. `rankscope analyze incident.json` or `rankscope analyze --dumps dumps/ --tp 2 --pp 4 --dp 4`",
        )
    if args.bundle is not None:
        _route_by_content(args)
    if args.op_trace is not None:
        return _op_trace(args)
    if args.logs is not None:
        _logs_with_dumps(args)
    options = SignatureOptions(keep_lines=args.keep_lines, fold_wrappers=not args.no_fold,
                               include_subprocesses=not args.no_subprocesses,
                               include_idle_threads=args.idle_threads)
    snapshots, other_verdicts, extra = _load(args)
    index = args.snapshot
    chosen: dict[int, Any] = {}
    if index is None:
        index, chosen, why = _incident(snapshots, layout_from_args(args, snapshots[-1].layout), options)
        if len(snapshots) > 1:
            extra = {**extra, "snapshot": {"index": index, "of": len(snapshots), "why": why}}
    if not -len(snapshots) <= index < len(snapshots):
        raise RankscopeError(f"--snapshot {index} is out of range: the bundle holds {len(snapshots)} snapshot(s)",
                             f"pass a number from 0 to {len(snapshots) - 1}, or -1 for the last")
    snapshot = snapshots[index]
    layout = layout_from_args(args, snapshot.layout)
    log_verdict, snapshot = _log_verdict(args, snapshot)
    if log_verdict is not None:
        other_verdicts = [*other_verdicts, log_verdict]
    from rankscope.analyzers.analysis import analyze_job
    from rankscope.analyzers.labels import hang_kind

    if other_verdicts and not any(m.stacks for m in snapshot.machines):
        # Nothing to group (flight-recorder dumps carry counters only): the other detectors speak alone.
        try:
            verdict = analyze_job(snapshot, layout, options, other_verdicts).verdict
        except ValueError as exc:
            raise RankscopeError(str(exc), LAYOUT_FIX) from None
        out = _verdict_only(verdict, snapshot, layout)
        out["c4_kind"] = hang_kind(verdict)
        out.update(extra)
        out.update(_log_summary(args))
        _print(out, verdict, args.json)
        return 0
    from rankscope.contract.heap import collector_paused

    try:
        with collector_paused():  # the analysis adds ~1M objects to the capture's: a collection would walk them all
            job = analyze_job(snapshot, layout, options, other_verdicts)  # the TUI's and the drill's analysis too
            # The judged snapshot's own round is its analysis above (same snapshot, layout and options).
            done = {index % len(snapshots): job} if not other_verdicts and snapshot is snapshots[index] else {}
            done = {**chosen, **done} if not other_verdicts else done
            rounds = _rounds(snapshots, layout, options, done) if len(snapshots) > 1 else None
    except ValueError as exc:
        raise RankscopeError(str(exc), LAYOUT_FIX) from None

    from rankscope.analyzers.findings import finding_to_json
    from rankscope.analyzers.render import headline
    from rankscope.analyzers.verdict_json import suspect_to_json

    analysis = job.stacks
    out = verdict_to_json(analysis)
    # The one verdict (job.verdict): merged with CCL counters or a flight recorder where there are any, and
    # its suspects folded (a root's own groups and its victims are its evidence) in every case; set aside as
    # timing when the snapshot caught a job making steps, its ranks mid-step (see analyzers.progress).
    merged = job.verdict
    if job.merged_with:
        out["stacks_summary"] = out["summary"]
    out["summary"] = headline(merged)
    out["c4_kind"] = hang_kind(merged)  # which of C4's kinds: communication hang or non-communication hang
    out["suspects"] = [suspect_to_json(s) for s in merged.suspects]
    out["findings"] = [finding_to_json(f) for f in merged.findings]
    out["missing_ranks"] = list(merged.missing_ranks)
    out["notes"] = list(merged.notes)
    if analysis.chain is not None:
        from rankscope.analyzers.completeness import rank_evidence, rank_evidence_to_json

        out["rank_evidence"] = [rank_evidence_to_json(e) for e in rank_evidence(snapshot, analysis.chain)]
    if rounds is not None:
        out["fail_slow"] = rounds
    if snapshot.notes:
        out["notes"] = [*snapshot.notes, *out["notes"]]  # type: ignore[misc]
    out.update(_log_summary(args))
    assignment = rank_assignment(snapshot)
    if assignment:
        out["rank_assignment"] = assignment
    if "snapshot" in extra:
        out["snapshot"] = extra["snapshot"]
    _print(out, merged, args.json)
    return 0


def _route_by_content(args: argparse.Namespace) -> None:
    """What is given where a bundle goes is read as what its content says it is (``formats.sniff``); one rank's
    flight recorder dump is refused with the fix (the ranks are judged against each other: the reader wants the
    whole folder)."""
    from rankscope.formats import sniff

    path: Path = args.bundle
    kind = sniff.what_is(path)
    if kind == sniff.FLIGHT_RECORDER_RANK:
        raise RankscopeError(f"{path} is one rank's PyTorch flight recorder dump, not a rankscope bundle",
                             f"pass the folder that holds every rank's dump: rankscope analyze {path.parent}")
    source = {sniff.OP_TRACE: "op_trace", sniff.FLIGHT_RECORDER: "flight_recorder", sniff.PYSPY: "pyspy_dir",
              sniff.LOGS: "logs"}.get(kind)
    if source is not None:
        setattr(args, source, path)
        args.bundle = None


def _logs_with_dumps(args: argparse.Namespace) -> None:
    """A folder of logs may hold py-spy dumps too (and one pasted file both): read those as the stacks."""
    from rankscope.formats.crash_logs import head_of, looks_like_crash, machine_files
    from rankscope.formats.incident_logs import scan
    from rankscope.formats.pyspy_dir import looks_like_pyspy

    path: Path = args.logs
    files = scan(path)
    args.log_files = [f for f in files if f.kind is not None]
    # A crashed job's logs: every log above, and those in a folder per machine.
    deeper = [p for p in machine_files(path) if looks_like_crash(head_of(p))] if path.is_dir() else []
    # A report's JSON, RAS text and Inspector records hold no crash lines; a folder whose logs hold no crash error
    # (a hang: watchdog timeouts alone) is not read for one.
    crashed = [f for f in args.log_files if f.kind in ("log", "crash")]
    if deeper or any(f.kind == "crash" or f.text is None or looks_like_crash(f.text) for f in crashed):
        args.crash_items = [(f.path, f.text) for f in crashed] + deeper
    if not args.log_files and not getattr(args, "crash_items", None):
        raise RankscopeError(f"no logs this reader knows in {path}",
                             "pass NCCL RAS output, ProcessGroupNCCL watchdog lines, fr_trace's report, DETAIL "
                             "mismatch errors, NCCL Inspector output, or a crashed job's logs (NCCL WARN lines, "
                             "DistBackendError, torchelastic's summary, kernel Xid lines; see `rankscope analyze --help`)")
    dumps = [f for f in files if f.pyspy or (f.kind is None and f.path.suffix.lower() != ".md"
                                              and looks_like_pyspy(f.path))]
    if dumps:
        args.pyspy_dir = path
    # Nothing is dropped quietly: a file that is neither is named.
    args.log_unread = [f"{f.path.name}: neither a log nor a py-spy dump this reader knows, not read"
                       for f in files if f.kind is None and f not in dumps and f.path.suffix.lower() != ".md"]


def _crash_verdict(args: argparse.Namespace) -> Any:
    """Where a crash began (``analyzers.crash_cascade``), None when the logs hold no crash."""
    items = getattr(args, "crash_items", None)
    if not items:
        return None
    from rankscope.analyzers.crash_cascade import analyze_crash
    from rankscope.formats.crash_logs import read_crash_logs

    root = args.logs if args.logs.is_dir() else None
    crash = read_crash_logs(items, root)
    verdict = analyze_crash(crash)
    if verdict is not None:
        files = sorted({e.where.rsplit(":", 1)[0] for e in crash.events})
        args.crash_read = {"crash_files": files, "crash_events": len(crash.events)}
    return verdict


def _log_verdict(args: argparse.Namespace, snapshot: Any) -> tuple[Any, Any]:
    """The logs' own verdict (``analyzers.log_evidence``; None when no logs were given), and the snapshot with the
    watchdog's PG status added as counters, so the stacks' analysis reads them like a live capture's."""
    files = getattr(args, "log_files", None)
    if not files:
        return _crash_verdict(args), snapshot
    import dataclasses

    from rankscope.analyzers.crash_cascade import with_crash
    from rankscope.analyzers.log_evidence import analyze_logs, watchdog_counters
    from rankscope.formats.incident_logs import read_logs

    crash = _crash_verdict(args)
    evidence = read_logs(files)
    if evidence.empty() and not evidence.notes:
        return crash, snapshot
    evidence = dataclasses.replace(evidence, notes=(*evidence.notes, *getattr(args, "log_unread", ())))
    args.log_read = {"files": [getattr(f, "path", f).name for f in files], "watchdog_lines": len(evidence.watchdog),
                     "ras_reports": len(evidence.ras), "fr_records": len(evidence.fr),
                     "detail_mismatches": len(evidence.mismatches), "inspector_ranks": len(evidence.inspector)}
    counters = watchdog_counters(evidence.watchdog)
    if counters and any(m.stacks for m in snapshot.machines):
        where = snapshot.rank_to_machine()
        machines = [dataclasses.replace(m, counters=(*m.counters, *(c for c in counters
                                                                     if where.get(c.rank) == m.machine)))
                    for m in snapshot.machines]
        snapshot = dataclasses.replace(snapshot, machines=tuple(machines))
    return with_crash(analyze_logs(evidence, snapshot.world_size), crash), snapshot


def _log_summary(args: argparse.Namespace) -> dict[str, Any]:
    """``--json``'s ``logs``: the files read as logs and how many records of each kind they gave."""
    read = {**getattr(args, "log_read", {}), **getattr(args, "crash_read", {})}
    return {"logs": read} if read else {}


def rank_assignment(snapshot: Any) -> list[dict[str, Any]]:
    """How each rank read from saved dumps got its number: rank, machine, pid, rule, and where from."""
    out = []
    for m in snapshot.machines:
        for r in m.ranks:
            if r.rank_source is not None:
                rule, _, detail = r.rank_source.partition(": ")
                out.append({"rank": r.rank, "machine": m.machine, "pid": r.pid, "rule": rule, "source": detail})
    return sorted(out, key=lambda a: a["rank"])


def _op_trace(args: argparse.Namespace) -> int:
    """``--op-trace``: the trace's verdict (analyzers.optrace), as text or JSON."""
    import dataclasses

    from rankscope.analyzers.optrace import TraceError, analyze_trace
    from rankscope.formats.optrace_io import read_op_trace, read_trace_meta

    columns = read_op_trace(args.op_trace)
    meta = read_trace_meta(args.trace_meta) if args.trace_meta is not None else {}
    try:
        verdict = analyze_trace(columns)
    except TraceError as exc:
        raise RankscopeError(f"--op-trace {args.op_trace}: {exc}",
                             "pass a trace with dp_rank, stage, rank, step, optype and duration columns") from None
    out = dataclasses.asdict(verdict)
    out["no_single_worker"] = verdict.no_single_worker
    out["meta"] = meta
    if args.json:
        json.dump(out, sys.stdout, indent=1, default=str)
        sys.stdout.write("\n")
        return 0
    job = ", ".join(f"{k} {meta[k]}" for k in ("dp_size", "pp_size", "tp_size", "world_size") if k in meta)
    sys.stdout.write(f"{args.op_trace.name}: {verdict.workers} workers over {verdict.stages} stages, "
                     f"{verdict.steps} steps{f' ({job})' if job else ''}\n{verdict.summary}\n")
    return 0


def _print(out: dict[str, Any], verdict: Verdict, as_json: bool) -> None:
    if as_json:
        json.dump(out, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_text(out, verdict))


def _verdict_only(verdict: Verdict, snapshot: Any, layout: Any) -> dict[str, Any]:
    """The --json shape for a source without stacks: no groups, the other detectors' suspects (``analyze_job``)."""
    from rankscope.analyzers.findings import finding_to_json
    from rankscope.analyzers.render import headline
    from rankscope.analyzers.verdict_json import suspect_to_json
    from rankscope.contract.snapshot import Layout

    summary = headline(verdict)
    lay = layout
    shown = lay if lay is not None else Layout()  # no layout: every size 1, the default order, marked assumed
    sizes = {d: getattr(shown, d) for d in Layout.SIZES}
    out = {
        "summary": summary,
        "world_size": snapshot.world_size,
        "layout": {**sizes, "order": shown.order,
                   "ranks_per_machine": lay.ranks_per_machine if lay is not None else None,
                   "from_communicators": [], "assumed": lay is None},
        "groups": [],
        "dominant": [],
        "outliers": [],
        "suspects": [suspect_to_json(s) for s in verdict.suspects],
        "findings": [finding_to_json(f) for f in verdict.findings],
        "chain": None,
        "rank_evidence": [],
        "missing_ranks": list(verdict.missing_ranks),
        "notes": [*snapshot.notes, *(n for n in verdict.notes if n not in snapshot.notes)],
    }
    return out


def _load(args: argparse.Namespace) -> tuple[list[Any], list[Any], dict[str, Any]]:
    """The snapshots to judge, verdicts from other detectors (the flight recorder's), extra --json keys."""
    if args.bundle is not None:
        from rankscope.contract.bundle import read_bundle

        bundle = read_bundle(args.bundle)
        if not bundle.snapshots:
            raise RankscopeError(f"{args.bundle} holds no snapshots", "capture one with `rankscope snapshot -o FILE`")
        return list(bundle.snapshots), [], {}
    if args.pyspy_dir is not None:
        from rankscope.formats.pyspy_dir import load_pyspy_dir

        order = [n.strip() for n in args.node_order.split(",") if n.strip()] if args.node_order else None
        return [load_pyspy_dir(args.pyspy_dir, layout_from_args(args), order)], [], {}
    if args.logs is not None:
        # Logs alone: no stacks to group; an empty capture carries the logs' notes (analyzers.log_evidence speaks).
        return [_empty_snapshot(args.logs)], [], {}
    try:
        from rankscope.formats.flight_recorder import read_flight_recorder_dir  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        raise RankscopeError(
            "this rankscope has no flight-recorder reader (rankscope.formats.flight_recorder is missing)",
            "analyze a bundle or a --pyspy-dir instead, or install a rankscope release that has it",
        ) from None
    from rankscope.analyzers.flight_recorder import wavefront_to_json

    report = read_flight_recorder_dir(args.flight_recorder, layout_from_args(args))
    return [report.snapshot], [report.verdict], {"fr_wavefront": [wavefront_to_json(w)
                                                                  for w in report.analysis.wavefront]}


def _empty_snapshot(path: Path) -> Any:
    import time

    from rankscope.contract.snapshot import Instant, JobSnapshot

    return JobSnapshot(captured=Instant(wall=time.time(), mono=time.monotonic()), machines=(), job_id=path.stem)


def _has_stacks(snapshot: Any) -> bool:
    return any(m.stacks for m in snapshot.machines)


def _incident(snapshots: list[Any], layout: Any, options: Any) -> tuple[int, dict[int, Any], str]:
    """Which snapshot of a series a person means by "the incident", the analyses made to find it, and why.

    A bundle the TUI saves (`w`) holds every poll (counters, no stacks) and every capture; the last snapshot is
    usually a poll, which says nothing of stacks. The incident is the latest capture whose stacks name suspects of
    a stuck job (not a capture of ranks mid-step), else the latest capture, else the last snapshot.
    """
    from rankscope.analyzers.analysis import analyze_job

    last = len(snapshots) - 1
    stacked = [i for i, snap in enumerate(snapshots) if _has_stacks(snap)]
    if not stacked:
        return last, {}, "no snapshot holds stacks: the last one"
    done: dict[int, Any] = {}
    for i in reversed(stacked):
        snap = snapshots[i]
        try:
            job = analyze_job(snap, layout if layout is not None else snap.layout, options)
        except ValueError:
            continue  # a layout that does not fit this capture: the judged one reports it
        done[i] = job
        if job.verdict.suspects and not job.timing_not_fault:
            return i, done, "the latest capture naming suspects of a stuck job (the incident)"
    return stacked[-1], done, "the latest capture (none named suspects of a stuck job)"


def _rounds(snapshots: list[Any], layout: Any, options: Any, done: dict[int, Any]) -> dict[str, object]:
    """Each capture of a series as one fail-slow round (``done``: analyses already made, by position); polls
    (no stacks) are no stack rounds, and a capture of ranks mid-step says so instead of naming its differences."""
    from rankscope.analyzers.analysis import analyze_job
    from rankscope.analyzers.rounds import FailSlowRounds, round_of
    from rankscope.analyzers.verdict_json import suspect_to_json

    stacked = [i for i, snap in enumerate(snapshots) if _has_stacks(snap)]
    rounds = FailSlowRounds(rounds=max(1, len(stacked)))
    timing: set[int] = set()
    for i in stacked:
        snap = snapshots[i]
        job = done.get(i) or analyze_job(snap, layout if layout is not None else snap.layout, options)
        if job.timing_not_fault:
            timing.add(len(rounds.history))
        rounds.add_round(round_of(job))
    degrader = rounds.flagged()
    # As the live detector holds them (failslow_config.FailSlowConfig.host_weight_on_device): on a job whose collectives
    # run on a GPU the host's stacks alone are a suspicion, never a verdict.
    on_gpu = any(snap.collectives_on_device() for snap in snapshots)

    def summary(r: Any) -> str:
        if r.index in timing:
            return f"caught mid-step: {r.outliers} ranks differ by timing, not a fault"
        return str(r.summary)

    return {
        "rounds": [{"index": r.index, "snapshot": stacked[r.index], "outliers": r.outliers, "summary": summary(r),
                    "timing": r.index in timing, "flagged": suspect_to_json(r.flagged) if r.flagged else None}
                   for r in rounds.history],
        "degrader": suspect_to_json(degrader) if degrader else None,
        "degrader_is_suspicion": on_gpu,
    }


def render_text(out: dict[str, Any], verdict: Verdict) -> str:
    """The verdict for a person: headline, layout, groups, suspects with evidence (``analyzers.render``, as the
    TUI's ``y`` copies them), gaps. ``out`` is the --json shape, ``verdict`` the one verdict in it."""
    from rankscope.analyzers.render import verdict_lines
    from rankscope.contract.snapshot import Layout

    lines = [f"verdict: {out['summary']}"]
    chosen = out.get("snapshot")
    if chosen:
        lines.append(f"snapshot {chosen['index']} of {chosen['of']}: {chosen['why']} (--snapshot I judges another)")
    if out.get("c4_kind"):
        lines.append(f"kind: {out['c4_kind']}")
    lay = out["layout"]
    dims = Layout(**{d: lay[d] for d in Layout.SIZES}).sizes_text()
    rpm = f", {lay['ranks_per_machine']} ranks/machine" if lay.get("ranks_per_machine") else ""
    stackless = not out["groups"] and out["world_size"] is None  # logs alone: no stacks, no layout to show
    if not stackless:
        lines.append(f"layout: {dims} (order {lay['order']}), world {out['world_size']}{rpm}"
                     + (" [assumed]" if lay.get("assumed") else ""))
    lines.append("")
    lines.append(f"stack groups ({len(out['groups'])}):" if not stackless else "stack groups: none (logs only)")
    for g in out["groups"][:20]:
        tag = "healthy" if g["healthy"] else "outlier" if out["dominant"] else "group"
        div = f"\n      leaves the healthy path at {g['diverging_frame']}" if g.get("diverging_frame") else ""
        lines.append(f"  [{tag}] {g['size']} rank(s) {_ranks(g['ranks'])}: {g['summary']}{div}")
    if len(out["groups"]) > 20:
        lines.append(f"  ... {len(out['groups']) - 20} more groups (use --json)")
    lines.append("")
    lines.extend(verdict_lines(verdict, 5, apart=True))
    gaps = [e for e in out.get("rank_evidence", []) if not e["complete"]]
    if gaps:
        lines.append("")
        lines.append(f"incomplete evidence ({len(gaps)} of {len(out['rank_evidence'])} ranks; --json: rank_evidence):")
        alike: dict[tuple[str, str], list[int]] = {}
        for e in gaps:  # ranks that lack the same thing for the same reason share a line
            what = "; ".join(e["failed"]) or (f"stack cut short: {e['truncated']}" if e["truncated"] else e["detail"])
            alike.setdefault((e["state"], what), []).append(e["rank"])
        for (state, what), ranks in list(alike.items())[:10]:
            lines.append(f"  {'rank' if len(ranks) == 1 else 'ranks'} {_ranks(ranks)} [{state}]: {what}")
        if len(alike) > 10:
            lines.append(f"  ... {len(alike) - 10} more kinds of gap")
    lines.extend(_render_fr_wavefront(out))
    fs = out.get("fail_slow")
    if fs:
        lines.append("")
        lines.append(f"fail-slow rounds ({len(fs['rounds'])} captures):")
        for r in fs["rounds"]:
            lines.append(f"  round {r['index']} (snapshot {r.get('snapshot', r['index'])}): {r['summary']}")
        deg = fs["degrader"]
        if deg and fs.get("degrader_is_suspicion"):
            lines.append(f"  suspect, not a verdict: {deg['evidence'][0]} (the job's collectives run on a GPU, where "
                         "every host waits at the same synchronisation call: the host's stacks alone are a suspicion; "
                         "`rankscope watch` weighs them with the counters)")
        else:
            lines.append(f"  degrader: {deg['evidence'][0] if deg else 'none'}")
    if out.get("rank_assignment"):
        lines.append("")
        lines.extend(_assignment_lines(out["rank_assignment"]))
    if out["missing_ranks"]:
        lines.append("")
        lines.append(f"could not see ranks: {_ranks(out['missing_ranks'])}")
    if out["notes"]:
        lines.append("")
        lines.extend(f"note: {n}" for n in out["notes"])
    return "\n".join(lines) + "\n"


def _assignment_lines(assignment: list[dict[str, Any]], limit: int = 20) -> list[str]:
    """Rank numbers and the rule that gave each, runs of one rule on one machine on one line."""
    runs: list[tuple[tuple[str, str], list[dict[str, Any]]]] = []
    for a in assignment:
        # A rank named by its own file needs no machine to be told apart; the others are per node.
        key = (a["rule"], "" if a["rule"] == "file-name" else a["machine"])
        if runs and runs[-1][0] == key:
            runs[-1][1].append(a)
        else:
            runs.append((key, [a]))
    lines = ["rank numbers (rule: how each was told):"]
    for (rule, machine), items in runs[:limit]:
        first = items[0]
        where = f" on {machine}" if machine else ""
        more = f"; {len(items) - 1} more alike" if len(items) > 1 else ""
        lines.append(f"  rank(s) {_ranks([a['rank'] for a in items])}{where}: {rule}"
                     f" (rank {first['rank']}, pid {first['pid']}: {first['source']}{more})")
    if len(runs) > limit:
        lines.append(f"  ... {len(runs) - limit} more runs (use --json)")
    return lines


def _render_fr_wavefront(out: dict[str, Any]) -> list[str]:
    """The flight recorder's wavefront: per group, the least-progressed ranks first."""
    waves = out.get("fr_wavefront")
    if waves is None:
        return []
    from rankscope.analyzers.flight_recorder import wavefront_line

    lines = ["", "flight-recorder wavefront (laggards first):"]
    lines.extend(f"  {wavefront_line(w)}" for w in waves[:20])
    if not waves:
        lines.append("  no collective recorded")
    if len(waves) > 20:
        lines.append(f"  ... {len(waves) - 20} more groups (use --json)")
    return lines


def _ranks(ranks: list[int]) -> str:
    """A rank set for a person: exact for a strided group of any size, else cut after 12 runs (--json has all)."""
    from rankscope.contract.ranks import compact_ranks

    return compact_ranks(ranks, 12)
