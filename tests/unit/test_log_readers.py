"""The incident-log readers (formats.incident_logs, nccl_ras, nccl_inspector) and their rules (analyzers.log_evidence).

Public examples live in tests/data/logs/<case>/ as short excerpts; each test
names the thread it comes from. Synthetic cases follow the formats' sources
(NVIDIA/nccl src/ras/client_support.cc for RAS text and JSON,
plugins/profiler/inspector/README.md for Inspector records).
"""

from __future__ import annotations

import json
import string

from hypothesis import given, settings
from hypothesis import strategies as st
from rankscope.analyzers.findings import NOT_A_RANK, SuspectKind, Verdict, VerdictStatus
from rankscope.analyzers.log_evidence import analyze_logs
from rankscope.contract.log_records import LogEvidence
from rankscope.formats.incident_logs import log_files, read_log_text, read_logs
from rankscope.formats.nccl_inspector import parse_inspector
from rankscope.formats.nccl_ras import parse_ras_json, parse_ras_text
from repo_paths import DATA

LOGS = DATA / "logs"


def _verdict(case: str) -> tuple[LogEvidence, Verdict]:
    ev = read_logs(log_files(LOGS / case))
    return ev, analyze_logs(ev)


def _suspect_ranks(v: Verdict) -> set[int]:
    return {r for s in v.suspects for r in s.ranks}


def _watchdog_line(rank: int, seq: int, enq: int, comp: int, op: str = "ALLREDUCE", new: bool = True) -> str:
    head = f"[rank{rank}]:[E603 17:48:01.005271823 ProcessGroupNCCL.cpp:632] [Rank {rank}] "
    timeout = (f"{head}Watchdog caught collective operation timeout: WorkNCCL(SeqNum={seq}, OpType={op}, "
               "NumelIn=8, NumelOut=8, Timeout(ms)=600000) ran for 600068 milliseconds before timing out.\n")
    pg = f"[rank{rank}]:[E603 17:48:01.005538748 ProcessGroupNCCL.cpp:2268] [PG ID 0 PG GUID 0(default_pg) Rank {rank}] "
    status = (f"{pg} failure detected by watchdog at work sequence id: {seq} PG status: last enqueued work: {enq}, "
              f"last completed work: {comp}\n" if new else
              f"{pg}Exception (either an error or timeout) detected by watchdog at work: {seq}, last enqueued NCCL "
              f"work: {enq}, last completed NCCL work: {comp}.\n")
    return timeout + status


def _dump_line(rank: int, enq: int, comp: int, by: int) -> str:
    return (f"[rank{rank}]:[E901 05:20:03.118859045 ProcessGroupNCCL.cpp:1746] [PG ID 0 PG GUID 0(default_pg) Rank "
            f"{rank}] Received a dump signal due to a collective timeout from  rank {by} and we will try our best to "
            f"dump the debug info. Last enqueued NCCL work: {enq}, last completed NCCL work: {comp}.This is most "
            "likely caused by incorrect usages of collectives\n")


# --------------------------------------------------------------------------
# Public examples
# --------------------------------------------------------------------------


def test_ras_lists_the_minority_ahead_so_the_others_are_behind() -> None:
    """NVIDIA/nccl#1911 (NCCL 2.26.2 `ncclras`, 32 ranks): "30 ranks have launched up to operation 640 / 2 ranks
    have launched up to operation 641 / Rank 12 ... Rank 13 ...". The listed ranks are ahead: the author asks RAS to
    print the 30 stragglers instead. The verdict blames the 30, never ranks 12 and 13."""
    ev, v = _verdict("nccl-1911-ras-minority-ahead")
    assert len(ev.ras) == 1 and ev.ras[0].processes == 32
    assert _suspect_ranks(v) == set(range(32)) - {12, 13}
    assert v.suspects[0].victims == (12, 13)
    assert "not to blame: 12-13" in " ".join(v.suspects[0].evidence)


def test_detail_mismatch_is_a_desync_of_both_ranks() -> None:
    """speechbrain/speechbrain#2401: DETAIL check at SequenceNumber=485, rank 1 in ALLREDUCE [25] Float, rank 0 in
    BROADCAST [1] Long. Two ranks: a program mismatch of both, neither picked as the root."""
    ev, v = _verdict("speechbrain-2401-detail")
    assert [(s.rank, s.op, s.shape, s.dtype) for s in ev.mismatches[0].sides] == [
        (1, "ALLREDUCE", "25", "Float"), (0, "BROADCAST", "1", "Long")]
    assert v.suspects[0].kind is SuspectKind.DESYNC and v.suspects[0].ranks == (0, 1) and v.suspects[0].roots == ()
    assert v.findings[0].kind == "log-collective-mismatch"
    assert "op type ALLREDUCE vs BROADCAST, shapes [25] vs [1], dtypes Float vs Long" in v.findings[0].summary


def test_fr_trace_missing_ranks_are_the_suspects() -> None:
    """pytorch/pytorch#140969 (fr_trace output in the PR's test plan): "Not all ranks joining collective: sequence
    number: 31117 ... missing ranks: {3, 4, 5, 6, 7}", world size 8."""
    ev, v = _verdict("pytorch-140969-fr-missing")
    assert ev.fr[0].seq == 31117 and ev.fr[0].missing_ranks == (3, 4, 5, 6, 7)
    assert v.suspects[0].ranks == (3, 4, 5, 6, 7) and v.suspects[0].victims == (0, 1, 2)


def test_launcher_prefix_and_absent_ranks_give_no_verdict() -> None:
    """hiyouga/LlamaFactory#7396: `[80746] [rank0]:` (a launcher's line number before torchrun's prefix), PG 1,
    the older "last enqueued NCCL work" form. Ranks 0, 3, 4 wait in 1580; ranks 1-2 are not in the excerpt, so the
    rank behind may be among them: no suspect and no "not a rank"."""
    ev, v = _verdict("llamafactory-7396-launcher-prefix")
    assert {r.rank for r in ev.watchdog} == {0, 3, 4} and {r.pg for r in ev.watchdog} == {"PG 1"}
    assert not v.suspects and not any(f.kind == NOT_A_RANK for f in v.findings)
    assert any("ranks 1-2 (group ranks) are not in the logs" in n for n in v.notes)


def test_ray_prefix_single_rank_cannot_be_judged() -> None:
    """verl-project/verl#2995: Ray's `(WorkerDict pid=835, ip=...)` before `[rank38]:`; one rank's lines only."""
    ev, v = _verdict("verl-2995-ray-prefix")
    assert {(r.rank, r.seq, r.enqueued, r.completed) for r in ev.watchdog if r.kind == "status"} == {(38, 10, 10, 9)}
    assert not v.suspects and not v.findings and any("only rank 38" in n for n in v.notes)


def test_old_lines_without_rank_or_seqnum_are_said() -> None:
    """WongKinYiu/yolov9#539: old PyTorch, `WorkNCCL(OpType=ALLREDUCE, Timeout(ms)=...)`, no SeqNum, `[Rank N]` only
    (a group rank of an unnamed group): read, not tied to a rank, and said."""
    ev, v = _verdict("yolov9-539-no-seqnum")
    assert len(ev.watchdog) == 2 and all(r.rank is None and r.op == "ALLREDUCE" for r in ev.watchdog)
    assert not v.suspects and any("not tied to a rank" in n for n in v.notes)


# --------------------------------------------------------------------------
# Synthetic cases of each rule
# --------------------------------------------------------------------------


def test_a_rank_that_never_issued_the_work_is_behind() -> None:
    text = "".join(_watchdog_line(r, 78, 80, 77, "BROADCAST") for r in (0, 1, 3)) + _dump_line(2, 77, 77, 0)
    v = analyze_logs(read_log_text(text))
    assert v.suspects[0].ranks == (2,) and v.suspects[0].victims == (0, 1, 3)
    assert "last enqueued work 77 < work 78 (BROADCAST)" in v.suspects[0].evidence[0]


def test_every_rank_at_the_same_work_is_not_a_rank() -> None:
    text = "".join(_watchdog_line(r, 78, 78, 77, new=r % 2 == 0) for r in range(4))
    v = analyze_logs(read_log_text(text))
    assert not v.suspects and v.summary.startswith("not a rank: ")
    f = v.findings[0]
    assert f.kind == NOT_A_RANK and f.ranks == (0, 1, 2, 3) and "Xid" in f.advice and "NVLink" in f.advice


def test_one_ranks_timeout_alone_is_no_verdict_not_a_stall_of_its_group() -> None:
    # One rank's lines cannot tell that every member waits: its reason is said, "not a rank" is not concluded.
    v = analyze_logs(read_log_text(_watchdog_line(1, 78, 78, 77)))
    assert not v.suspects and v.status == VerdictStatus.NO_VERDICT
    assert not [f for f in v.findings if f.kind == NOT_A_RANK]
    assert v.summary.startswith("no verdict: the logs name no rank behind its peers (rank 1's watchdog timed out in ")


def test_ras_ok_with_a_timeout_is_not_a_rank_and_ras_alone_is_no_verdict() -> None:
    ras = ("Job summary\n===========\n\n  Nodes  Processes         GPUs  Processes     GPUs\n(total)   per node  per "
           "process    (total)  (total)\n      1          2            1          2        2\n\nCommunicators... "
           "(0.00s)\n=============\n\nGroup     Comms     Nodes     Ranks     Ranks     Ranks    Status  Errors\n"
           "    #  in group  per comm  per node  per comm  in group\n    0         1         1         2         2  "
           "       2   RUNNING      OK\n\nErrors\n======\n\nWarnings\n========\n")
    assert not analyze_logs(read_log_text(ras)).findings
    v = analyze_logs(read_log_text(ras + _watchdog_line(1, 5, 5, 4)))
    assert v.findings[0].kind == NOT_A_RANK and "RUNNING with errors OK" in v.summary


def test_ras_json_names_the_rank_behind_and_the_missing_one() -> None:
    """The JSON `ncclras -f json` writes (NVIDIA/nccl src/ras/client_support.cc, jsonWrite*)."""
    def rank(r: int, count: int) -> dict[str, object]:
        return {"rank": r, "host": f"node{r // 4}", "pid": 100 + r, "cuda_dev": r % 4, "nvml_dev": r % 4,
                "status": {"init_state": 0, "async_error": 0, "finalize_called": False, "destroy_flag": False,
                           "abort_flag": False},
                "collective_counts": {"Broadcast": 0, "AllReduce": count, "AllGather": 3}}
    doc = {"nccl_version": "2.28.7", "cuda_runtime_version": 12090, "cuda_driver_version": 12090,
           "timestamp": "x", "communicators_count": 1,
           "communicators": [{"hash": "0xabc", "secondary_hash": "0x1:0x2", "size": 8, "ranks_count": 7,
                              "missing_ranks_count": 1,
                              "ranks": [rank(r, 40 if r == 5 else 41) for r in range(7)],
                              "missing_ranks": [{"rank": 7, "host": "node1", "pid": 107, "cuda_dev": 3, "nvml_dev": 3,
                                                 "status": {"unresponsive": True, "considered_dead": False}}]}],
           "ras": {"collection_time_sec": 0.1, "timeouts_count": 0}}
    ev = read_log_text(json.dumps(doc, indent=2), "ras.json")
    v = analyze_logs(ev)
    assert ev.ras[0].comms[0].size == 8
    behind = next(s for s in v.suspects if s.state.startswith("behind"))
    assert behind.ranks == (5,) and behind.machines == ("node1",)
    missing = next(s for s in v.suspects if s.state == "not answering RAS")
    assert missing.ranks == (7,)


def test_ras_text_incomplete_dead_and_a_cut_report() -> None:
    text = ("INCOMPLETE\n  Missing communicator data from 2 job processes\n  Process 60004 on node h1 managing GPU 0\n"
            "\nDEAD\n  1 job process is considered dead (unreachable via the RAS network)\n"
            "  Process 70001 on node h2 managing GPU 1\n\n#0-0 (b3398875b8b2a063) INCOMPLETE\n"
            "  Missing communicator data from 3 ranks\n  Rank 1 -- GPU 0 managed by process 60004 on node h1\n")
    text = "Job summary\n===========\n\nErrors\n======\n\n" + text
    report, _ = parse_ras_text(text, "ras.txt")
    assert report.missing_process_count == 2 and report.dead_process_count == 1 and not report.complete
    v = analyze_logs(LogEvidence(ras=(report,)))
    assert {s.machines for s in v.suspects} == {("h1",), ("h2",)}
    assert any("run `ncclras -v`" in n for n in v.notes) and any("cannot be tied to a rank" in n for n in v.notes)


def _inspector(rank: int, sn: int, us: float, comm: str = "0x7f8c496ae9f661") -> str:
    return json.dumps({"header": {"id": comm, "rank": rank, "n_ranks": 4, "nnodes": 1},
                       "metadata": {"inspector_output_format_version": "v4.0", "hostname": f"h{rank}", "pid": rank},
                       "coll_perf": {"coll": "AllReduce", "coll_sn": sn, "coll_msg_size_bytes": 1 << 20,
                                     "coll_exec_time_us": us}}, indent=2)


def test_inspector_behind_rank_and_last_arriver() -> None:
    """Records shaped as NVIDIA/nccl plugins/profiler/inspector/README.md shows them."""
    behind = "\n".join(_inspector(r, sn, 100.0) for r in range(4) for sn in range(1, 6 if r == 2 else 8))
    v = analyze_logs(read_log_text(behind, "inspector.log"))
    assert v.suspects[0].ranks == (2,) and v.suspects[0].machines == ("h2",)
    slow = "\n".join(_inspector(r, sn, 50.0 if r == 3 else 900.0 + r) for r in range(4) for sn in range(1, 9))
    v = analyze_logs(read_log_text(slow, "inspector.log"))
    assert v.suspects[0].ranks == (3,) and v.suspects[0].state == "arrives last"
    ranks, notes = parse_inspector("nccl_collective_exec_time_microseconds{node=\"n1\",gpu=\"GPU0\"} 10\n"
                                   "nccl_collective_exec_time_microseconds{node=\"n2\",gpu=\"GPU1\"} 99\n", "prom")
    assert ranks == [] and "no rank" in notes[0] and "node n2 GPU GPU1" in notes[0]


def test_detail_minority_is_the_root_and_the_old_one_rank_form_is_said() -> None:
    fp = ("[rank{r}]: RuntimeError: Detected mismatch between collectives on ranks. Rank {r} is running collective: "
          "CollectiveFingerPrint(SequenceNumber=21, OpType={a}, TensorShape=[1]), but Rank {o} is running collective: "
          "CollectiveFingerPrint(SequenceNumber=21, OpType={b}, TensorShape=[1]).\n")
    text = fp.format(r=0, o=2, a="BROADCAST", b="ALLREDUCE") + fp.format(r=1, o=2, a="BROADCAST", b="ALLREDUCE")
    v = analyze_logs(read_log_text(text))
    assert v.suspects[0].ranks == (0, 1, 2) and v.suspects[0].roots == (2,)
    old = ("Detected mismatch between collectives on ranks. Rank 1 is running inconsistent collective: "
           "CollectiveFingerPrint(OpType=ALLREDUCE, TensorShape=[20, 10]). The sequence number is: 0\n")
    ev = read_log_text(old)
    assert ev.mismatches[0].sides[0].seq == 0
    assert any("other side is not in the logs" in n for n in analyze_logs(ev).notes)


def test_interleaved_and_cut_logs_are_read_and_flagged() -> None:
    a, b = _watchdog_line(0, 9, 9, 8).splitlines()
    c = _watchdog_line(1, 9, 8, 8).splitlines()[1]
    text = f"{a}\n{b[:60]}{c}\n{b}\n{c[:-20]}"
    ev = read_log_text(text, "job.log")
    assert any("interleaved" in n for n in ev.notes) and any("cut off" in n for n in ev.notes)
    assert {(r.rank, r.enqueued) for r in ev.watchdog if r.enqueued is not None} >= {(0, 9), (1, 8)}


def test_fr_state_mismatch_blames_the_rank_less_far_along() -> None:
    text = ("Collective sequence number: 7 has errors\ninternal record id: 6\ngroup info: 0:default_pg\n"
            "collective: nccl:all_reduce\nworld size: 3\nexpected ranks: {0, 1, 2}\ncollective state: completed\n"
            "error msg: Culprit rank 2; Error type: COLLECTIVE_STATE_MISMATCH, Expected state: 'completed' does not "
            "match found state: 'scheduled'\n")
    v = analyze_logs(read_log_text(text))
    assert v.suspects[0].ranks == (2,)


# --------------------------------------------------------------------------
# Properties and fuzzing: any input is read, never a traceback
# --------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 40), seq=st.integers(1, 10**9), behind=st.sets(st.integers(0, 39), max_size=5),
       old=st.booleans())
def test_watchdog_rule_names_exactly_the_ranks_behind(n: int, seq: int, behind: set[int], old: bool) -> None:
    behind = {r for r in behind if r < n}
    if len(behind) == n:
        behind = set()
    text = "".join(_dump_line(r, seq - 1, seq - 1, 0) if r in behind else _watchdog_line(r, seq, seq + 2, seq - 1,
                                                                                          new=not old)
                   for r in range(n))
    v = analyze_logs(read_log_text(text))
    if behind:
        assert _suspect_ranks(v) == behind and not any(f.kind == NOT_A_RANK for f in v.findings)
    else:
        assert not v.suspects and v.findings[0].kind == NOT_A_RANK


_SAMPLES = [p.read_text() for p in sorted(LOGS.glob("*/*")) if p.is_file()]
_MARKERS = ["WorkNCCL(SeqNum=", "last enqueued work: ", "Rank 3 -- GPU 1 managed by process 9 on node x\n",
            "Missing communicator data from 4 ranks\n", "#0-0 (ab) MISMATCH\n", "[rank7]:", "Culprit rank 9; ",
            "Not all ranks joining collective\n", "missing ranks: {1,\n", "Detected mismatch between collectives on "
            "ranks. Rank 1 is running collective: ", '{"header": {"rank": 1}, "coll_perf": {"coll_sn": 3}}',
            "Job summary\n", "Communicators...\n", "    0   1   1   1   2   2   RUNNING  OK\n",
            'nccl_collective_exec_time_microseconds{node="n",gpu="g"} 7\n']


@settings(max_examples=150, deadline=None)
@given(base=st.sampled_from(_SAMPLES), cut=st.integers(0, 4000), junk=st.lists(
    st.one_of(st.sampled_from(_MARKERS), st.text(string.printable + "←卡", max_size=40)), max_size=8),
    at=st.integers(0, 4000))
def test_readers_never_raise_on_mangled_logs(base: str, cut: int, junk: list[str], at: int) -> None:
    text = base[:cut]
    text = text[:at] + "".join(junk) + text[at:]
    ev = read_log_text(text, "fuzz.log")
    analyze_logs(ev, world=8)


@settings(max_examples=300, deadline=None)
@given(doc=st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-5, 10**12), st.text(max_size=8)),
                        lambda kids: st.one_of(st.lists(kids, max_size=4),
                                               st.dictionaries(st.sampled_from(
                                                   ["communicators", "ranks", "rank", "size", "missing_ranks",
                                                    "collective_counts", "AllReduce", "status", "host", "pid",
                                                    "header", "coll_perf", "coll_sn", "id", "metadata",
                                                    "coll_exec_time_us", "nccl_version"]), kids, max_size=6)),
                        max_leaves=30))
def test_json_readers_never_raise(doc: object) -> None:
    text = json.dumps({"nccl_version": "2.28.7", "communicators": [doc, doc]})
    try:
        report, _ = parse_ras_json(text, "x.json")
    except ValueError:
        return
    analyze_logs(LogEvidence(ras=(report,)))
    ranks, _ = parse_inspector(json.dumps({"header": doc, "coll_perf": doc}) + "\n{cut", "i.json")
    analyze_logs(LogEvidence(inspector=tuple(ranks)))


def test_watchdog_status_becomes_counters_the_ccl_rules_read() -> None:
    """The PG status as CL/WR/WC per group and rank: the existing CCL rule names the rank behind from them."""
    import time

    from rankscope.analyzers.ccl import analyze_counters
    from rankscope.analyzers.log_evidence import watchdog_counters
    from rankscope.contract.snapshot import Instant, JobSnapshot, MachineSnapshot

    text = "".join(_watchdog_line(r, 78, 80, 77) for r in (0, 1, 3)) + _dump_line(2, 77, 77, 0)
    counters = watchdog_counters(read_log_text(text).watchdog)
    assert [(c.rank, c.ops[0].cl, c.ops[0].wc) for c in counters] == [(0, 80, 77), (1, 80, 77), (2, 77, 77),
                                                                        (3, 80, 77)]
    assert counters[0].communicators[0].ranks == (0, 1, 2, 3)
    now = Instant(wall=time.time(), mono=time.monotonic())
    snap = JobSnapshot(now, (MachineSnapshot("m0", "logs", True, now, counters=counters),))
    v = analyze_counters(snap)
    assert v.top is not None and v.top.ranks == (2,)


def test_dump_signals_without_a_timeout_of_their_own_are_read_not_blamed() -> None:
    """OpenRLHF/OpenRLHF#1126: ranks 0, 1, 3 only "Observed flight recorder dump signal", ranks 2 and 5 "Received a
    dump signal ... from rank 34 / 6" with work 460631 pending, rank 7 timed out in it. The paste holds no rank
    behind and misses ranks 4 and 6: no suspect, no "not a rank", and both said."""
    ev, v = _verdict("openrlhf-1126-dump-signals")
    assert {(r.rank, r.signalled_by) for r in ev.watchdog if r.signalled_by is not None} == {(5, 34), (2, 6)}
    assert not v.suspects and not v.findings
    assert any(n.startswith("ranks 0-1,3 of PG 0 (default_pg) are in the logs") for n in v.notes)
    assert any(n.startswith("ranks 4,6 of PG 0 (default_pg) are not in the logs") for n in v.notes)


def test_old_detail_form_without_comma_is_one_desync() -> None:
    """pytorch/pytorch#100207 (the message before the fix): `CollectiveFingerPrint(SequenceNumber=513876813OpType=
    BROADCAST)` on rank 1 against rank 26's full fingerprint: both ranks in one desync finding."""
    ev, v = _verdict("pytorch-100207-detail-old")
    assert [(s.rank, s.seq, s.op) for s in ev.mismatches[0].sides] == [(26, 683057617, "BROADCAST"),
                                                                        (1, 513876813, "BROADCAST")]
    assert v.suspects[0].ranks == (1, 26) and v.suspects[0].kind is SuspectKind.DESYNC


def _ras_text(n: int, value: int, minority: dict[int, int]) -> str:
    """A `ncclras` MISMATCH block as NCCL prints it (src/ras/client_support.cc): groups by count, most frequent
    first, the ranks of the small groups listed, a group of one on its own line."""
    lines = ["Job summary", "===========", "", "  Nodes  Processes         GPUs  Processes     GPUs",
             "(total)   per node  per process    (total)  (total)", f"      1  {n:9d}            1  {n:9d}  {n:7d}", "",
             "Communicators... (0.00s)", "=============", "",
             "Group     Comms     Nodes     Ranks     Ranks     Ranks    Status  Errors",
             "    #  in group  per comm  per node  per comm  in group",
             f"    0         1         1  {n:8d}  {n:8d}  {n:8d}   RUNNING  MISMATCH", "", "Errors", "======", "",
             "#0-0 (fa93daea854b060b) MISMATCH", "  Communicator ranks have different AllReduce operation counts",
             f"  {n - len(minority)} ranks have launched up to operation {value}"]
    by_value: dict[int, list[int]] = {}
    for r, v in minority.items():
        by_value.setdefault(v, []).append(r)
    for v, rs in sorted(by_value.items(), key=lambda kv: -len(kv[1])):
        if len(rs) == 1:
            lines.append(f"  Rank {rs[0]} has launched up to operation {v} -- GPU 0 managed by process {rs[0]} on node h")
            continue
        lines.append(f"  {len(rs)} ranks have launched up to operation {v}")
        lines.extend(f"  Rank {r} -- GPU 0 managed by process {r} on node h" for r in sorted(rs))
    return "\n".join(lines) + "\n"


@settings(max_examples=60, deadline=None)
@given(n=st.integers(4, 300), value=st.integers(2, 10**6), ahead=st.booleans(), data=st.data())
def test_ras_blames_the_ranks_behind_whichever_side_it_lists(n: int, value: int, ahead: bool,
                                                             data: st.DataObject) -> None:
    listed = data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=max(1, n // 3)))
    minority = {r: value + 1 if ahead else value - 1 for r in listed}
    v = analyze_logs(read_log_text(_ras_text(n, value, minority), "ras.txt"))
    behind = set(range(n)) - listed if ahead else listed
    assert _suspect_ranks(v) == behind
