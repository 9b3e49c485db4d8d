"""A verdict as plain text: the one renderer of its headline, suspects and findings for a person.

``rankscope analyze`` prints it and the TUI's ``y`` copies it, so a ticket
reads the same whichever made it. The TUI's verdict panel draws the same
headline (``headline``) and the same suspects in colour from the same parts
(``labels``). What a verdict says is its ``status``; these are only its words.
"""

from __future__ import annotations

from collections.abc import Sequence

from rankscope.analyzers.findings import NOT_A_RANK, Finding, Suspect, Verdict
from rankscope.analyzers.labels import joined
from rankscope.contract.ranks import compact_ranks

RANKS_SHOWN = 12  # runs of a rank set before it is cut (--json has all)


def headline(verdict: Verdict) -> str:
    """The verdict's one line: its summary, or with no suspect left its "not a rank" finding's (never a tie-break's
    pick)."""
    return joined(*headline_parts(verdict))


def headline_parts(verdict: Verdict) -> tuple[str, str]:
    """``headline`` in two parts: what it names, and the root rank it names within it (``Verdict.summary_root``,
    empty when none), which the TUI's verdict panel draws on a line of its own."""
    if not verdict.suspects:
        stall = next((f.summary for f in verdict.findings if f.kind == NOT_A_RANK), None)
        if stall is not None:
            return stall, ""
    root = verdict.summary_root
    return (verdict.summary_head, root) if root else (verdict.summary, "")


def verdict_lines(verdict: Verdict, limit: int | None = None, apart: bool = False) -> list[str]:
    """Its suspects (the first ``limit``) and its findings; ``apart``: a blank line between the two."""
    lines = suspect_lines(verdict.suspects, limit)
    if verdict.findings:
        lines.extend([""] if apart else [])
        lines.extend(finding_lines(verdict.findings))
    return lines


def suspect_lines(suspects: Sequence[Suspect], limit: int | None = None) -> list[str]:
    """The suspects, most likely first, each with its evidence, the ranks that only wait on it and where its
    stacks leave the healthy ranks' path."""
    if not suspects:
        return ["suspects: none"]
    lines = ["suspects (most likely first):"]
    for i, s in enumerate(suspects[:limit], 1):
        state = f"  [{s.state}]" if s.state else ""
        lines.append(f"  {i}. [{s.kind}] score {s.score:.2f}  machines: {', '.join(s.machines) or '?'}{state}")
        lines.extend(f"       {e}" for e in s.evidence)
        if s.victims:
            lines.append(f"       victims (wait on it, not suspects): ranks {compact_ranks(s.victims, RANKS_SHOWN)}")
        if s.diverging_frame:
            lines.append(f"       diverges at: {s.diverging_frame}")
    return lines


def finding_lines(findings: Sequence[Finding]) -> list[str]:
    """Facts beyond "evict these machines" (a desync, a mismatch, "not a rank"), each with its advice."""
    if not findings:
        return []
    lines = ["findings:"]
    for f in findings:
        comm = f" on {f.communicator}" if f.communicator else ""
        lines.append(f"  [{f.kind}] ranks {compact_ranks(f.ranks, RANKS_SHOWN)}{comm}: {f.summary}")
        lines.extend(f"       {e}" for e in f.evidence)
        if f.advice:
            lines.append(f"       advice: {f.advice}")
    return lines


__all__ = ["RANKS_SHOWN", "finding_lines", "headline", "suspect_lines", "verdict_lines"]
