"""The action client: plans and runs actions on the agents that own their targets.

An agent acts only on its own machine, so ``plan_action`` splits a
request by the machines and ranks each agent reports (one ``describe``) and
asks each owner for its plan; ``run_action`` sends each owner its part with a
confirmation naming exactly that agent's planned targets, only after the
confirmation rule (``rankscope.actions.model``) holds for the whole action. Only a
client made with ``acting=True`` (and a token of the 'act' role) ever sends RunAction.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from rankscope.actions.agent_protocol import (
    ActionError,
    ActionUpdate,
    Confirmation,
    split_fix,
)
from rankscope.actions.journal import JournalEntry
from rankscope.actions.model import (
    ActionKind,
    ActionPlan,
    ActionRequest,
    ActionResult,
    ActionState,
    ConfirmationRule,
    EvictArgs,
    Targets,
)
from rankscope.contract.errors import RankscopeError
from rankscope.contract.snapshot import CaptureError, CaptureErrorKind
from rankscope.wire.action_messages import (
    confirmation_to_proto,
    event_from_proto,
    plan_from_proto,
    request_to_proto,
)
from rankscope.wire.fanout import FanOut, error_for_rpc
from rankscope.wire.proto import rankscope_pb2 as pb

UNOWNED = "unowned"  # plan_action's key for targets no agent reports
# A plan is asked once, by a person who waits for it: the poll deadline (made for readings repeated every
# second) must not fail it. An agent's first plan after it (re)started imports its planning code and scans
# /proc; on a loaded machine that took over 10 s and every agent answered "no answer" (the e2e tmux test).
PLAN_DEADLINE_S = 30.0


class ActionClient(FanOut):
    """The fan-out, and the actions: plans, runs, the incident journal."""

    def __init__(self, agents: Sequence[str], token: str | None, *, acting: bool = False, **options: Any) -> None:
        """``acting``: this client may run actions (its token was loaded with ``role=Role.ACT``).

        A read-only client (the default, and what ``--read-only`` gives) refuses
        ``run_action`` before anything is sent. ``options``: as ``FanOut``'s.
        """
        super().__init__(agents, token, **options)
        self.acting = acting
        # action id -> (each owner's part of the request, the plans they gave): what run_action sends
        self._planned: dict[str, tuple[dict[str, ActionRequest], dict[str, ActionPlan | ActionError]]] = {}

    async def plan_action(self, request: ActionRequest) -> dict[str, ActionPlan | ActionError]:
        """Each owning agent's plan (or why it gave none), by agent address.

        Targets that no reachable agent reports come back under the key
        ``UNOWNED``; an agent that refuses its part (targets outside its job,
        no actions configured) or cannot be reached gives an ActionError.
        Planning changes nothing and needs only the 'read' role.
        """
        parts, answers = await self._split(request)
        deadline_s = max(self.deadline_s, PLAN_DEADLINE_S)

        async def one(address: str, part: ActionRequest) -> tuple[str, ActionPlan | ActionError]:
            try:
                reply = await self._conn(address).stub.PlanAction(
                    request_to_proto(part), metadata=self._metadata, timeout=deadline_s)
                return address, plan_from_proto(reply)
            except grpc.aio.AioRpcError as exc:
                return address, action_error(address, exc, deadline_s, using_tls=self.tls is not None)

        for address, answer in await asyncio.gather(*(one(a, p) for a, p in parts.items())):
            answers[address] = answer
        self._planned[request.action_id] = (parts, answers)
        return answers

    async def run_action(self, request: ActionRequest, confirmation: Confirmation) -> AsyncIterator[ActionUpdate]:
        """Run a confirmed action on every owning agent at once: their progress, then one result each.

        ``confirmation`` is what the person confirmed for the whole action:
        every planned machine (``confirmation_for(plans)``) and, for eviction,
        the phrase ``combined_phrase(kind, plans)`` they typed. It must match
        the plans exactly or nothing is sent (RankscopeError). Each agent gets
        its own part and a confirmation of exactly its planned targets, plans
        again and refuses on any difference. An agent lost mid-way gives a
        failed result saying the outcome there is unknown; it never raises.
        """
        if not self.acting:
            raise RankscopeError("this client is read-only: it does not send actions",
                                 "attach without --read-only, with a token of the 'act' role")
        if request.action_id not in self._planned:
            await self.plan_action(request)
        parts, answers = self._planned[request.action_id]
        plans = {a: p for a, p in answers.items() if isinstance(p, ActionPlan)}
        problems = [f"{a}: {e.message}" for a, e in answers.items() if isinstance(e, ActionError)]
        if problems or not plans:
            raise RankscopeError(f"not every target has a plan, so nothing was sent: {'; '.join(problems) or 'none'}",
                                 "fix the targets (or the agents) and plan again")
        self._check_confirmation(request, list(plans.values()), confirmation)
        del self._planned[request.action_id]  # the next call with this id replays; it does not reuse a stale split

        queue: asyncio.Queue[ActionUpdate | None] = asyncio.Queue()

        async def one(address: str) -> None:
            part, plan = parts[address], plans[address]
            mine = Confirmation(plan.machines, tuple(sorted(set(part.targets.ranks))),
                                plan.confirm_phrase if plan.typed_confirmation else "")
            message = pb.RunActionRequest(request=request_to_proto(part), confirmation=confirmation_to_proto(mine))
            ended = heard = False
            try:
                async for reply in self._conn(address).stub.RunAction(message, metadata=self._metadata):
                    event = event_from_proto(reply)
                    ended, heard = isinstance(event, ActionResult), True
                    await queue.put(ActionUpdate(address, event))
                    if ended:
                        return
                reason = "the agent ended the stream without a result"
            except grpc.aio.AioRpcError as exc:
                error = action_error(address, exc, 0.0, using_tls=self.tls is not None)
                if not heard and exc.code() in REFUSED_BEFORE_ACTING:
                    await queue.put(ActionUpdate(address, refused_result(request, error)))
                    return
                reason = error.message
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a reply that does not fit: say so, keep the other agents going
                reason = f"{type(exc).__name__}: {exc}"
            if not ended:
                await queue.put(ActionUpdate(address, lost_result(request, address, reason)))

        tasks = [asyncio.create_task(one(a)) for a in plans]
        gathered = asyncio.gather(*tasks)
        gathered.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            while (update := await queue.get()) is not None:
                yield update
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def journal(self, entries: Sequence[JournalEntry] = ()) -> tuple[JournalEntry, ...]:
        """The incident journal of every agent of the job as one story (``rankscope.actions.journal``); with
        ``entries``, first add them to every agent's (that needs the 'act' role). Agents that keep none (no
        actions configured, older agents) or do not answer add nothing."""
        from rankscope.actions.journal import APPEND, READ, entries_from_bytes, entries_to_bytes, merge

        method, body = (APPEND, entries_to_bytes(entries)) if entries else (READ, b"")
        live = [a for a in self.agents if a not in self.retired]

        async def one(address: str) -> tuple[JournalEntry, ...]:
            call = self._conn(address).channel.unary_unary(method, request_serializer=None,
                                                           response_deserializer=None)
            try:
                return entries_from_bytes(await call(body, metadata=self._metadata, timeout=self.deadline_s))
            except (grpc.aio.AioRpcError, ValueError):
                return ()

        return merge(*await asyncio.gather(*(one(a) for a in live)))

    async def _split(self, request: ActionRequest) -> tuple[dict[str, ActionRequest], dict[str, ActionPlan | ActionError]]:
        """Each owning agent's part of ``request`` (from one describe, with a plan's deadline), and errors for what
        has no owner."""
        job = await self._fan_out(self._versioned("Describe", pb.DescribeRequest()),
                                  max(self.deadline_s, PLAN_DEADLINE_S))
        parts: dict[str, ActionRequest] = {}
        errors: dict[str, ActionPlan | ActionError] = {}
        members = [m for m in job.machines if m.address not in self.retired]  # evicted machines take no part
        reachable = [m for m in members if m.reachable]
        lost = [m for m in members if not m.reachable]
        wanted_machines = set(request.targets.machines)
        wanted_ranks = set(request.targets.ranks)
        whole_job = not wanted_machines and not wanted_ranks
        if whole_job:  # every agent should take part: a lost one means the action cannot be whole
            for m in lost:
                error = m.error or CaptureError(CaptureErrorKind.UNREACHABLE, f"agent at {m.address} is lost")
                errors[m.address] = ActionError(m.address, error.message, error.fix)
        # In rank order, not the order the agents were listed in (the order they came up in): the plans, the
        # phrase to type and the confirmation all follow it, and the drill's phrase read "machine-3 machine-1".
        for m in sorted(reachable, key=lambda m: (min((i.rank for i in m.ranks), default=1 << 62), m.machine)):
            machines = tuple(n for n in request.targets.machines if n in (m.machine, m.address))
            ranks = tuple(r for r in request.targets.ranks if r in {i.rank for i in m.ranks})
            if not (whole_job or machines or ranks):
                continue
            if machines and machines != (m.machine,):
                machines = (m.machine,)  # named by its address: the agent knows itself by name
            if request.kind == ActionKind.EVICT and not machines:
                machines = (m.machine,)  # an eviction takes the machine of the ranks named
            wanted_machines -= {m.machine, m.address}
            wanted_ranks -= set(ranks)
            parts[m.address] = dataclasses.replace(request, targets=Targets(machines, ranks))
        if request.kind == ActionKind.EVICT and len(parts) > 1:
            # Each agent learns which machines go with its own (a whole-job restart must take them all at once).
            evicted = [m for part in parts.values() for m in part.targets.machines]
            for address, part in parts.items():
                assert isinstance(part.args, EvictArgs)
                others = tuple(m for m in evicted if m not in part.targets.machines)
                parts[address] = dataclasses.replace(part, args=dataclasses.replace(part.args, together=others))
        if wanted_machines or wanted_ranks:
            names = [f"machine {n}" for n in sorted(wanted_machines)] + [f"rank {r}" for r in sorted(wanted_ranks)]
            unreachable = f" (unreachable: {' '.join(m.address for m in lost)})" if lost else ""
            errors[UNOWNED] = ActionError(
                UNOWNED, f"no reachable agent of this job reports {', '.join(names)}{unreachable}",
                "target the machines and ranks the agents list (a lost agent's machine cannot act)")
        return parts, errors

    @staticmethod
    def _check_confirmation(request: ActionRequest, plans: list[ActionPlan], confirmation: Confirmation) -> None:
        rule = ConfirmationRule.of(plans)  # the agents apply the same rule, each to its own plan
        problem = rule.problem(confirmation, request.targets.ranks)
        if problem is not None:
            raise RankscopeError(f"{problem}; nothing was sent", "confirm exactly the targets the plan shows"
                                 + (f" and type exactly: {rule.phrase}" if rule.phrase is not None else ""))


def action_error(address: str, exc: grpc.aio.AioRpcError, timeout_s: float, *, using_tls: bool = False) -> ActionError:
    """A failed action call -> what happened and the fix (an agent's refusal carries its own fix)."""
    code = exc.code()
    if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
        message, fix = split_fix(exc.details() or "")
        return ActionError(address, f"agent at {address}: {message}", fix)
    error = error_for_rpc(address, exc, timeout_s, using_tls=using_tls).error
    assert error is not None
    return ActionError(address, error.message, error.fix)


# Codes an agent answers before it does anything (the token's role, a malformed request, no actions configured):
# such a run was refused, not lost.
REFUSED_BEFORE_ACTING = frozenset({grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
                                   grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION})


def refused_result(request: ActionRequest, error: ActionError) -> ActionResult:
    """The result shown for an agent that refused the run before acting: nothing ran there."""
    return ActionResult(request.action_id, request.kind, ActionState.REFUSED,
                        f"refused: {error.message}; nothing was done", None, time.time(),
                        (f"fix: {error.fix}",) if error.fix else ())


def lost_result(request: ActionRequest, address: str, reason: str) -> ActionResult:
    """The result shown for an agent whose run stream broke: the outcome there is unknown, not failed-and-undone."""
    now = time.time()
    return ActionResult(
        request.action_id, request.kind, ActionState.FAILED,
        f"{reason}; the outcome on {address} is unknown: the agent records it in its audit log",
        None, now, (f"send the same action id {request.action_id} again to get the recorded result",))
