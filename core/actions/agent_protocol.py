"""What the action protocol adds around H8's model: confirmations and per-agent events.

The model (:mod:`rankscope.actions.model`) says what an action is. This
module holds the few shapes the wire and the TUI need on top of it, without
importing grpc, so the TUI can build a confirmation and read events while it
reaches the agents only through ``rankscope.wire.client``:

- :class:`Confirmation`: what the person confirmed -- the exact machines and
  ranks the plan named and, for eviction, the phrase they typed. An agent
  carries out nothing unless the confirmation names exactly the targets of
  the plan it makes at that moment (``ConfirmationRule.problem``, in
  :mod:`rankscope.actions.model`).
- :class:`ActionUpdate`: one progress line or the result of one agent, with
  the agent it came from (an action over several machines runs on several
  agents at once).
- :class:`ActionError` / :class:`AgentLost`: an agent that could not plan, or
  a watched agent that went away; never an exception for the whole call.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from rankscope.actions.model import (
    ActionKind,
    ActionPlan,
    ActionProgress,
    ActionResult,
    AuditRecord,
    ConfirmationRule,
)

# An agent's refusal travels as gRPC status details "<message>\nfix: <what to do>".
FIX_SEPARATOR = "\nfix: "


def split_fix(details: str) -> tuple[str, str]:
    """Status details -> (message, fix)."""
    message, _, fix = details.partition(FIX_SEPARATOR)
    return message.strip(), fix.strip()


@dataclass(frozen=True, slots=True)
class Confirmation:
    """The targets a person confirmed, as the plan named them, and the phrase typed for eviction."""

    machines: tuple[str, ...] = ()
    ranks: tuple[int, ...] = ()
    typed: str = ""


@dataclass(frozen=True, slots=True)
class ActionError:
    """An agent that gave no plan (refused the targets, lost, no actions configured)."""

    address: str
    message: str
    fix: str = ""


@dataclass(frozen=True, slots=True)
class ActionUpdate:
    """One event of a running action, from the agent at ``address``."""

    address: str
    event: ActionProgress | ActionResult

    @property
    def final(self) -> bool:
        return isinstance(self.event, ActionResult)


@dataclass(frozen=True, slots=True)
class AgentLost:
    """A watched agent's audit stream broke. ``retrying``: the client reconnects by itself."""

    address: str
    message: str
    fix: str = ""
    retrying: bool = True


@dataclass(frozen=True, slots=True)
class AuditResumed:
    """A watched agent's audit stream is open again after an ``AgentLost`` (before any new record: an agent that
    restarted may have none to send, and its lost note must not stay)."""

    address: str


# What a merged watch of every agent's audit stream yields: a record with its agent's address, or news of a stream.
AuditItem = tuple[str, AuditRecord] | AgentLost | AuditResumed

# The initial metadata an agent sends once it accepted an audit stream, so that a client knows the stream is open.
AUDIT_OPEN = ("rankscope-audit", "open")


def confirmation_for(plans: Iterable[ActionPlan], ranks: Iterable[int] = (), typed: str = "") -> Confirmation:
    """The confirmation of exactly these plans' targets (what a confirm modal sends after 'yes')."""
    return Confirmation(ConfirmationRule.of(plans).machines, tuple(sorted(set(ranks))), typed)


def combined_phrase(kind: ActionKind, plans: Iterable[ActionPlan]) -> str:
    """The phrase a person types to evict the machines of several agents' plans together."""
    return ConfirmationRule.phrase_for(kind, ConfirmationRule.of(plans).machines)
