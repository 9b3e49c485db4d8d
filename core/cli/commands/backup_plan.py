"""`rankscope backup-plan`: which peer keeps each rank's checkpoint backup.

Prints the over-eviction-aware pairing of ByteRobust §6.3 (Fig. 9) for a
layout typed on the command line, so a team can check it before a run and the
TUI's plan can be reproduced offline::

    rankscope backup-plan --tp 2 --pp 4 --dp 2 --ranks-per-machine 2 --json
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from rankscope.cli.options import add_layout_args, layout_from_args


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "backup-plan",
        help="pair each rank with a checkpoint backup peer outside its TP/PP/DP groups (ByteRobust Fig. 9)",
        description=(
            "Pair each rank with the peer that keeps its checkpoint backup: on another machine, sharing none "
            "of its parallel groups, so over-evicting any one group never loses both copies."
        ),
    )
    add_layout_args(p, "parallel layout (every size 1 unless given; ranks per machine: the TP size)")
    p.add_argument("--world-size", type=int, default=None, metavar="N",
                   help="check the sizes against the job's world size (default: their product)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rankscope.analyzers.backup_plan import BackupPlan, backup_plan
    from rankscope.contract.snapshot import Layout

    layout = layout_from_args(args, Layout()) or Layout()
    plan: BackupPlan = backup_plan(layout, world_size=args.world_size, ranks_per_machine=layout.ranks_per_machine)
    if args.json:
        print(json.dumps(plan_to_json(plan, layout), indent=2))
    else:
        print(render_text(plan, layout))
    return 0


def plan_to_json(plan: Any, layout: Any) -> dict[str, Any]:
    """The plan as the JSON the CLI prints; ``pairs`` is a list of ``{rank, peer}``."""
    return {
        "layout": {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "cp": layout.cp, "ep": layout.ep,
                   "order": layout.order},
        "world_size": plan.world_size,
        "pairs": [{"rank": p.rank, "peer": p.peer} for p in plan.pairs],
        "machines": [{"machine": m, "ranks": list(ranks)} for m, ranks in plan.machines],
        "rule": plan.rule,
        "safe": plan.safe,
        "unsafe": [{"rank": r, "peer": p, "groups": list(kinds)} for r, p, kinds in plan.unsafe],
        "notes": list(plan.notes),
    }


def render_text(plan: Any, layout: Any) -> str:
    sizes = layout.sizes_text("all sizes 1")
    lines = [f"checkpoint backup plan: {sizes}, order {layout.order}, {plan.world_size} ranks "
             f"on {len(plan.machines)} machines (rule: {plan.rule})"]
    width = len(str(plan.world_size - 1))
    for p in plan.pairs:
        lines.append(f"  rank {p.rank:>{width}} ({p.machine}) -> rank {p.peer:>{width}} "
                     f"({p.peer_machine})")
    lines.append("safe: over-evicting any one parallel group keeps at least one copy of every shard" if plan.safe
                 else "NOT safe: see notes")
    lines.extend(f"note: {n}" for n in plan.notes)
    return "\n".join(lines)
