"""The drill: a real PyTorch job (TP x PP x DP on gloo) spread over local "machines".

Each machine is one ``torchrun`` node and one rankscope agent on loopback. A
named fault is injected at a chosen rank (or machine) and step, and the drill
knows the ground truth, so it can score what rankscope captured.

Nothing here imports torch at import time: the orchestrator side
(``launcher``, ``session``, ``progress``, ``faults``) runs without it; only the
training script (``worker``) and ``model`` need it.
"""

from __future__ import annotations

from rankscope.drill.faults import FAULTS, DrillLayout, FaultPlan, FaultSpec, GroundTruth

__all__ = ["FAULTS", "DrillLayout", "FaultPlan", "FaultSpec", "GroundTruth"]
