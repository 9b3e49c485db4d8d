"""Reading 16,384 ranks of saved py-spy dumps, text beside JSON: `python benchmarks/bench_text_dumps.py`.

Builds (untimed) the 16k-rank job of bench_analyze.py (TP=8, PP=16, DP=128,
~40-frame Megatron-like main threads plus an idle pin-memory thread, a stalled
pipeline and a lone compute rank mixed in) and saves its main processes twice:

- as text, the way `pgrep ... | xargs -n1 py-spy dump --pid` prints them: one
  file per node, 8 processes each, their command lines carrying --local_rank;
- as JSON, one ``rank<R>.json`` per rank (``py-spy dump --json``).

Then it runs `rankscope analyze` on each folder, the command a user runs, in a
fresh process (--json to /dev/null), alternating text and JSON, and prints the
wall time and peak RSS of each run, the medians side by side and their ratio,
plus the time spent reading the dumps alone (``load_pyspy_dir``, in process).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_analyze import WORLD, build_snapshot
from rankscope.contract.snapshot import ProcessStack
from rankscope.formats.pyspy_dir import load_pyspy_dir
from rankscope.probes.pyspy_text import format_pyspy_text

FLAGS = ["--tp", "8", "--pp", "16", "--dp", "128", "--order", "tp-pp-dp", "--ranks-per-machine", "8"]


def _json_dump(stack: ProcessStack) -> list[dict[str, object]]:
    """A process as `py-spy dump --json` writes it."""
    return [{"pid": stack.pid, "thread_id": t.thread_id, "thread_name": t.thread_name,
             "os_thread_id": t.os_thread_id, "active": t.active, "owns_gil": t.owns_gil,
             "frames": [{"name": f.name, "filename": f.filename, "module": f.module,
                         "short_filename": f.filename.rsplit("/", 1)[-1], "line": f.line or 0, "locals": None,
                         "is_entry": False} for f in t.frames]}
            for t in stack.threads or ()]


def write_dumps(text_dir: Path, json_dir: Path) -> tuple[int, int]:
    snap, _, _ = build_snapshot()
    text_bytes = json_bytes = 0
    for index, machine in enumerate(snap.machines):
        parts = []
        for local, rs in enumerate(machine.stacks):
            parts.append(format_pyspy_text(rs.main, cmdline=f"/opt/venv/bin/python pretrain_gpt.py "
                                                                f"--local_rank={local} --tensor-model-parallel-size 8"))
            data = json.dumps(_json_dump(rs.main))
            (json_dir / f"rank{rs.rank}.json").write_text(data)
            json_bytes += len(data)
        text = "".join(parts)
        # machine-<i>.txt: the machine names the JSON path gives (rank // 8), so both verdicts read the same
        (text_dir / f"machine-{index}.txt").write_text(text)
        text_bytes += len(text)
    return text_bytes, json_bytes


# A fresh parent per run, so that RUSAGE_CHILDREN's maximum is this run's alone.
_WRAPPER = """
import json, resource, subprocess, sys, time
t0 = time.perf_counter()
out = subprocess.run(sys.argv[1:], capture_output=True, check=True).stdout
wall = time.perf_counter() - t0
use = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps([wall, use.ru_utime + use.ru_stime, use.ru_maxrss / 1024, json.loads(out)["summary"]]))
"""


def run_analyze(folder: Path) -> tuple[float, float, float, str]:
    """Wall and CPU seconds and peak RSS (MiB) of `rankscope analyze FOLDER --json` in a fresh process, and its
    verdict. On a shared machine the CPU time is the steadier figure."""
    proc = subprocess.run([sys.executable, "-c", _WRAPPER, sys.executable, "-m", "rankscope", "analyze", str(folder),
                           *FLAGS, "--json"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"rankscope analyze {folder} failed: {proc.stderr[-2000:]}")
    wall, cpu, rss, summary = json.loads(proc.stdout)
    return float(wall), float(cpu), float(rss), str(summary)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        text_dir, json_dir = Path(tmp, "text"), Path(tmp, "json")
        text_dir.mkdir()
        json_dir.mkdir()
        t0 = time.perf_counter()
        text_bytes, json_bytes = write_dumps(text_dir, json_dir)
        print(f"wrote {WORLD} ranks: {len(os.listdir(text_dir))} node text files ({text_bytes / 2**20:.0f} MiB), "
              f"{len(os.listdir(json_dir))} JSON files ({json_bytes / 2**20:.0f} MiB) in "
              f"{time.perf_counter() - t0:.1f} s (untimed); python {sys.version.split()[0]}, {os.cpu_count()} CPUs")

        # reading alone, in process (the first read of each also warms the page cache)
        for name, folder in (("text", text_dir), ("json", json_dir)):
            t0, c0 = time.perf_counter(), time.process_time()
            snap = load_pyspy_dir(folder)
            print(f"  load_pyspy_dir({name}) alone: CPU {time.process_time() - c0:.2f} s, "
                  f"wall {time.perf_counter() - t0:.2f} s, {snap.world_size} ranks")

        walls: dict[str, list[float]] = {"text": [], "json": []}
        cpus: dict[str, list[float]] = {"text": [], "json": []}
        peaks: dict[str, list[float]] = {"text": [], "json": []}
        summaries: dict[str, str] = {}
        for _ in range(args.repeat):
            for name, folder in (("text", text_dir), ("json", json_dir)):
                wall, cpu, rss, summaries[name] = run_analyze(folder)
                walls[name].append(wall)
                cpus[name].append(cpu)
                peaks[name].append(rss)

    load = os.getloadavg()[0]
    print(f"\n`rankscope analyze` over {WORLD} ranks, {args.repeat} runs each (load average {load:.1f}):")
    for name in ("text", "json"):
        print(f"  {name:4s}: CPU median {statistics.median(cpus[name]):6.2f} s (best {min(cpus[name]):5.2f}), "
              f"wall median {statistics.median(walls[name]):6.2f} s (best {min(walls[name]):5.2f}), "
              f"peak RSS {max(peaks[name]):5.0f} MiB")
        print(f"        verdict: {summaries[name]}")
    cpu_ratio = statistics.median(cpus["text"]) / statistics.median(cpus["json"])
    wall_ratio = statistics.median(walls["text"]) / statistics.median(walls["json"])
    print(f"  ratio text / json: CPU {cpu_ratio:.2f}x, wall {wall_ratio:.2f}x, "
          f"peak RSS {max(peaks['text']) / max(peaks['json']):.2f}x")
    same = summaries["text"] == summaries["json"]
    print(f"  same verdict from both: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
