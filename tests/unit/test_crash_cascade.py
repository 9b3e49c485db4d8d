"""Where a crash began (formats.crash_logs reading, analyzers.crash_cascade judging), on texts written from the
sources' formats:

- NCCL: ``host:pid:tid [dev] file:line NCCL WARN NET/IB : Got completion from peer %s with status=%d opcode=%d
  len=%d vendor err %d (%s) localGid %s remoteGids %s`` (transport/net_ib.cc), ``Call to recv from %s failed :
  %s`` with strerror's "Connection reset by peer" (misc/socket.cc), ``Cuda failure '%s'``, the INFO lines
  ``Bootstrap : Using %s:%s<0>``;
- PyTorch: the watchdog's ``Watchdog caught collective operation timeout: WorkNCCL(...)``,
  ``torch.distributed.DistBackendError: NCCL error in: ...``, ``CUDA error: an illegal memory access was
  encountered``; torchelastic's ChildFailedError summary (``Root Cause (first observed failure):``, ``[0]:``, then
  ``time``, ``host``, ``rank``, ``exitcode``, ``error_file``, ``traceback`` fields);
- the kernel: ``NVRM: Xid (PCI:%s): %d, pid=%d, name=%s, ...`` in syslog and ``dmesg -T`` forms, a mlx5 link down.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rankscope.analyzers.crash_cascade import CRASH_ORIGIN, analyze_crash
from rankscope.analyzers.findings import NOT_A_RANK, SuspectKind
from rankscope.cli.main import main
from rankscope.contract.crash_records import CrashEvidence, CrashKind
from rankscope.formats.crash_logs import crash_files, looks_like_crash, read_crash_logs, read_crash_text


def _nccl(rank: int, host: str, ip_last: int) -> str:
    return f"[rank{rank}]:{host}:{1000 + rank}:{1000 + rank} [{rank % 2}] NCCL INFO Bootstrap : Using eth0:10.0.0.{ip_last}<0>\n"


def _ib_error(rank: int, host: str, own: int, peer: int) -> str:
    return (f"[rank{rank}]:{host}:{1000 + rank}:{1090 + rank} [{rank % 2}] transport/net_ib.cc:1696 NCCL WARN NET/IB : "
            f"Got completion from peer 10.0.0.{peer}<4{peer}21> with status=12 opcode=0 len=0 vendor err 129 (Recv) "
            f"localGid ::ffff:10.0.0.{own} remoteGids::ffff:10.0.0.{peer}\n")


def _reset(rank: int, host: str, peer: int) -> str:
    return (f"[rank{rank}]:{host}:{1000 + rank}:{1095 + rank} [{rank % 2}] misc/socket.cc:50 NCCL WARN socketProgressOpt: "
            f"Call to recv from 10.0.0.{peer}<35112> failed : Connection reset by peer\n")


def _dist(rank: int, t: str) -> str:
    return (f"[rank{rank}]:[E502 {t}.101000000 ProcessGroupNCCL.cpp:1834] [PG ID 0 PG GUID 0(default_pg) Rank {rank}] "
            "Process group watchdog thread terminated with exception: NCCL error: remote process exited or there was "
            "a network error, NCCL version 2.21.5\n"
            f"[rank{rank}]:torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/"
            "NCCLUtils.hpp:317, remote process exited or there was a network error, NCCL version 2.21.5\n")


def _timeout(rank: int, t: str) -> str:
    return (f"[rank{rank}]:[E502 {t}.500000000 ProcessGroupNCCL.cpp:632] [Rank {rank}] Watchdog caught collective "
            "operation timeout: WorkNCCL(SeqNum=812, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) "
            "ran for 600010 milliseconds before timing out.\n")


def _elastic(root_rank: int, root_host: str, others: list[tuple[int, str]]) -> str:
    def rec(i: int, rank: int, host: str, t: str) -> str:
        return (f"[{i}]:\n  time      : 2024-05-02_{t}\n  host      : {host}\n  rank      : {rank} (local_rank: "
                f"{rank % 2})\n  exitcode  : -6 (pid: {5000 + rank})\n  error_file: <N/A>\n  traceback : Signal 6 "
                f"(SIGABRT) received by PID {5000 + rank}\n")
    fails = "".join(rec(i + 1, r, h, "10:11:31") for i, (r, h) in enumerate(others)) or "  <NO_OTHER_FAILURES>\n"
    return ("=" * 60 + "\ntrain.py FAILED\n" + "-" * 60 + "\nFailures:\n" + fails + "-" * 60
            + "\nRoot Cause (first observed failure):\n" + rec(0, root_rank, root_host, "10:11:30") + "=" * 60 + "\n")


def _write(folder: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


def _judge(folder: Path):  # type: ignore[no-untyped-def]
    ev = read_crash_logs(crash_files(folder), folder)
    return ev, analyze_crash(ev)


def test_a_nic_error_is_the_host_its_peers_connections_point_to(tmp_path: Path) -> None:
    """Ranks on node0 and node2 get IB completion errors from 10.0.0.11; node1's Bootstrap line ties that address
    to node1, whose own rank only timed out later: the crash began at node1."""
    _write(tmp_path, {
        "rank0.log": _nccl(0, "node0", 10) + _ib_error(0, "node0", 10, 11) + _dist(0, "10:11:20"),
        "rank2.log": _nccl(2, "node1", 11) + _timeout(2, "10:11:25"),
        "rank4.log": _nccl(4, "node2", 12) + _ib_error(4, "node2", 12, 11) + _dist(4, "10:11:21"),
    })
    ev, v = _judge(tmp_path)
    assert v is not None
    top = v.suspects[0]
    assert top.kind is SuspectKind.MACHINE and top.machines == ("node1",) and top.victims == (0, 4)
    assert v.summary.startswith("crash began at node1 (rank 2 there)")
    assert "named by 2 host(s): node0, node2" in top.evidence[0]
    assert v.findings[0].kind == CRASH_ORIGIN and v.findings[0].ranks == (2,)
    assert any(e.peer == "node1" for e in ev.events)


def test_a_nic_link_down_in_the_kernel_log_is_critical_hardware(tmp_path: Path) -> None:
    _write(tmp_path, {
        "node1/kern.log": "May  2 10:11:02 node1 kernel: mlx5_core 0000:5e:00.0 ib0: Link down\n",
        "node0/rank0.log": _nccl(0, "node0", 10) + _ib_error(0, "node0", 10, 11),
    })
    _, v = _judge(tmp_path)
    assert v is not None and v.suspects[0].machines == ("node1",)
    assert "critical hardware" in v.suspects[0].evidence[0] and "NIC link down" in v.summary


def test_an_xid_is_where_it_began_before_the_others_errors(tmp_path: Path) -> None:
    """node2's kernel logs Xid 79 at 10:11:05; a non-fatal Xid 13 on node0 and the ranks' CUDA failures, reset
    connections and DistBackendErrors come after: the first critical hardware error is the origin."""
    _write(tmp_path, {
        "node2/dmesg.txt": "[Thu May  2 10:11:01 2024] NVRM: GPU at PCI:0000:3b:00: GPU-1f2e3d4c\n"
                           "[Thu May  2 10:11:05 2024] NVRM: Xid (PCI:0000:3b:00): 79, pid=5004, name=python, GPU has "
                           "fallen off the bus.\n",
        "node0/dmesg.txt": "[Thu May  2 10:11:09 2024] NVRM: Xid (PCI:0000:1a:00): 13, pid=5000, name=python, Graphics "
                           "SM Warp Exception on (GPC 0, TPC 1, SM 0)\n",
        "node2/rank4.log": _nccl(4, "node2", 12) + "[rank4]:node2:1004:1004 [0] enqueue.cc:1556 NCCL WARN Cuda failure "
                           "'unspecified launch failure'\n" + _dist(4, "10:11:12"),
        "node0/rank0.log": _nccl(0, "node0", 10) + _reset(0, "node0", 12) + _dist(0, "10:11:14"),
    })
    _, v = _judge(tmp_path)
    assert v is not None
    top = v.suspects[0]
    assert top.machines == ("node2",) and top.kind is SuspectKind.MACHINE
    assert v.summary == "crash began at GPU PCI:0000:3b:00 on node2 (rank 4 there): Xid 79 (GPU has fallen off the bus.)"
    assert "the first critical hardware error by time" in top.evidence[0]
    folded = "\n".join(top.evidence)
    assert "gpu on node0" in folded and "Xid 13" in folded and "network on node0 rank 0" in folded


def test_a_peer_reset_cascade_leads_to_the_host_with_an_error_of_its_own(tmp_path: Path) -> None:
    """Three hosts' sockets are reset by 10.0.0.12 (node2), where rank 4 ran out of memory first."""
    files = {f"rank{r}.log": _nccl(r, f"node{r // 2}", 10 + r // 2) + _reset(r, f"node{r // 2}", 12)
             + _dist(r, "10:11:20") for r in (0, 1, 2, 3, 6, 7)}
    files["rank4.log"] = (_nccl(4, "node2", 12) + "[rank4]:[E502 10:11:10.000000000 train.py:88] torch.OutOfMemoryError: "
                          "CUDA out of memory. Tried to allocate 2.00 GiB\n" + _dist(4, "10:11:11"))
    _write(tmp_path, files)
    _, v = _judge(tmp_path)
    assert v is not None
    top = v.suspects[0]
    assert top.kind is SuspectKind.RANK and top.ranks == (4,) and top.machines == ("node2",)
    assert v.summary == "crash began at rank 4 on node2: CUDA out of memory"
    assert "point to (named by 3 host(s): node0, node1, node3)" in top.evidence[0]
    assert set(top.victims) == {0, 1, 2, 3, 6, 7}


def test_torchelastics_root_cause_that_is_a_victim_is_said_and_not_blamed(tmp_path: Path) -> None:
    """torchelastic's first observed failure is rank 8's SIGABRT at 10:11:30 (the watchdog's abort); rank 3 hit an
    illegal memory access at 10:11:08: the cascade began there."""
    _write(tmp_path, {
        "launcher.out": _elastic(8, "node4", [(9, "node4")]),
        "rank3.log": _nccl(3, "node1", 11) + "[rank3]:[E502 10:11:08.000000000 train.py:120] RuntimeError: CUDA error: "
                     "an illegal memory access was encountered\n",
        "rank8.log": _nccl(8, "node4", 14) + _timeout(8, "10:11:29"),
    })
    _, v = _judge(tmp_path)
    assert v is not None
    assert v.suspects[0].ranks == (3,) and v.suspects[0].machines == ("node1",)
    assert v.summary == "crash began at rank 3 on node1: CUDA failure: an illegal memory access was encountered"
    note = next(n for n in v.notes if "Root Cause" in n)
    assert "rank 8 on node4" in note and "a victim" in note and "the cascade began at rank 3 on node1" in note


def test_connection_errors_with_no_common_peer_are_not_a_rank(tmp_path: Path) -> None:
    _write(tmp_path, {
        "rank0.log": _nccl(0, "node0", 10) + _reset(0, "node0", 11),
        "rank2.log": _nccl(2, "node1", 11) + _reset(2, "node1", 12),
        "rank4.log": _nccl(4, "node2", 12) + _reset(4, "node2", 10),
    })
    _, v = _judge(tmp_path)
    assert v is not None and v.suspects == ()
    assert v.findings[0].kind == NOT_A_RANK and v.summary.startswith("not a rank: connection errors on 3 hosts")


def test_timeouts_alone_are_a_hang_not_a_crash(tmp_path: Path) -> None:
    _write(tmp_path, {f"rank{r}.log": _timeout(r, "10:11:25") + _dist(r, "10:11:26") for r in range(4)})
    assert _judge(tmp_path)[1] is None


def test_analyze_names_the_origin_through_the_sniffing_route(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A folder per machine, no flag: `rankscope analyze FOLDER` reads it as a crash's logs."""
    _write(tmp_path, {
        "node1/kern.log": "May  2 10:11:02 node1 kernel: NVRM: Xid (PCI:0000:b7:00): 74, pid=7001, name=python, "
                          "NVLink: fatal error detected on link 3(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)\n",
        "node0/rank0.log": _nccl(0, "node0", 10) + _ib_error(0, "node0", 10, 11) + _dist(0, "10:11:20"),
    })
    assert main(["analyze", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert str(data["summary"]).startswith("crash began at GPU PCI:0000:b7:00 on node1: Xid 74")
    assert data["suspects"][0]["machines"] == ["node1"]
    assert data["logs"]["crash_events"] >= 3 and data["logs"]["crash_files"] == ["node0/rank0.log", "node1/kern.log"]


def test_per_file_notes_say_what_was_read_and_what_was_not() -> None:
    lines, notes = read_crash_text("node3:1:1 [0] NCCL WARN something new entirely\n" + _reset(1, "node3", 9),
                                   "rank1.log")
    assert [x.event.kind for x in lines] == [CrashKind.NETWORK]
    assert notes == ["rank1.log: read 1 error(s) of a crash (1 network)",
                     "rank1.log: 1 NCCL WARN / NVRM line(s) not in a shape this reader knows, skipped"]


_SAMPLES = [_nccl(0, "node0", 10) + _ib_error(0, "node0", 10, 11) + _dist(0, "10:11:20"), _elastic(8, "n4", [(9, "n4")]),
            "[Thu May  2 10:11:05 2024] NVRM: Xid (PCI:0000:3b:00): 79, pid=5004, name=python, GPU has fallen off\n",
            _reset(3, "node1", 12) + _timeout(3, "10:11:29")]


@settings(max_examples=150, deadline=None)
@given(base=st.sampled_from(_SAMPLES), cut=st.integers(0, 2000), at=st.integers(0, 2000),
       junk=st.lists(st.one_of(st.sampled_from(["NCCL WARN ", "NVRM: Xid (", "): 99999999999999999999, ", "[0]:\n",
                                                "  rank      : x\n", "exitcode  : -", "<1>", "peer 1.2.3.4<",
                                                "\x00\x01\xff", "2024-13-45_99:99:99", "[E1399 25:61:61.1] "]),
                             st.text(string.printable, max_size=30)), max_size=8),
       other=st.sampled_from(_SAMPLES))
def test_the_crash_reader_takes_truncated_prefixed_interleaved_and_binary_text(base: str, cut: int, at: int,
                                                                                junk: list[str], other: str) -> None:
    text = base[:cut]
    text = text[:at] + "".join(junk) + text[at:]
    mixed = "".join(a + b for a, b in zip(text.split("\n"), other.split("\n"), strict=False))  # two logs interleaved
    for t in (text, mixed):
        lines, notes = read_crash_text(t, "fuzz.log")
        assert all(isinstance(n, str) for n in notes)
        looks_like_crash(t)
        analyze_crash(CrashEvidence(tuple(x.event for x in lines)))


def test_binary_files_are_said_not_read(tmp_path: Path) -> None:
    (tmp_path / "core.bin").write_bytes(b"\x7fELF\x00\x00NCCL WARN" * 100)
    ev = read_crash_logs([tmp_path / "core.bin"])
    assert ev.events == () and ev.notes == ("core.bin: not readable, skipped",)
