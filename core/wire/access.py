"""Who may call what on an agent: the token check, made in one interceptor before any handler runs.

Each method names the role it needs (``METHOD_ROLES``); a method not listed
there needs the ``act`` role, so a state-changing RPC added later is protected
even if nobody remembers to list it. The standard health check needs no token.
An accepted token renews the agent's lease (``rankscope.wire.lease``).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
from rankscope.actions.journal import READ as JOURNAL_READ
from rankscope.wire.lease import Lease
from rankscope.wire.limits import MESSAGE_WAIT_S
from rankscope.wire.tokens import Role, TokenSet

SERVICE = "rankscope.v1.RankscopeAgent"
HEALTH_PREFIX = "/grpc.health.v1.Health/"
# What each call needs. Anything of the agent service not listed needs ACT.
METHOD_ROLES: dict[str, Role] = {
    f"/{SERVICE}/Describe": Role.READ,
    f"/{SERVICE}/Capture": Role.READ,
    f"/{SERVICE}/PlanAction": Role.READ,  # planning changes nothing
    f"/{SERVICE}/WatchAudit": Role.READ,  # a read-only TUI sees actions live
    JOURNAL_READ: Role.READ,  # a late view reads the incident's story (Append needs ACT)
    # RunAction is deliberately absent: it needs ACT.
}


def bearer_token(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    for key, value in metadata or ():
        if key.lower() == "authorization":
            text = value.decode() if isinstance(value, bytes) else str(value)
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer":
                return token.strip() or None
    return None


def _denying_handler(handler: Any, code: grpc.StatusCode, message: str) -> Any:
    """A handler that only rejects the call, at once: it takes the request as a stream it never reads, so a call
    that sends its headers and never its message is answered (and gives its place back) without waiting for it."""

    async def reject(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    async def reject_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(code, message)
        yield  # pragma: no cover - abort raises; this only makes it a generator

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(reject_stream)
    return grpc.stream_unary_rpc_method_handler(reject)


def _message_within(handler: Any, wait_s: float) -> Any:
    """``handler`` with its one request read under a time limit: a call that holds a place without sending its
    message is ended after ``wait_s``, saying so (gRPC itself would wait for it as long as the peer likes)."""
    if handler is None or handler.request_streaming:
        return handler
    late = (f"no request message within {wait_s:g} s of the call's start: the agent ends calls that hold a place "
            "without sending their request")

    async def first(context: grpc.aio.ServicerContext) -> Any:
        try:
            request = await asyncio.wait_for(context.read(), wait_s)
        except TimeoutError:
            request = grpc.aio.EOF
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, late)
        if request is grpc.aio.EOF:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call ended without its request message")
        return request

    if handler.response_streaming:
        behaviour = handler.unary_stream

        async def streamed(_: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for reply in behaviour(await first(context), context):
                yield reply

        return grpc.stream_stream_rpc_method_handler(streamed, handler.request_deserializer,
                                                     handler.response_serializer)
    single = handler.unary_unary

    async def answered(_: Any, context: grpc.aio.ServicerContext) -> Any:
        return await single(await first(context), context)

    return grpc.stream_unary_rpc_method_handler(answered, handler.request_deserializer, handler.response_serializer)


def token_fingerprint(secret: str) -> str:
    """Names a token in the audit log without revealing it: the first 8 hex digits of its SHA-256."""
    return hashlib.sha256(secret.encode("utf-8", "replace")).hexdigest()[:8]


def caller_of(tokens: TokenSet | None, metadata: Sequence[tuple[str, Any]] | None) -> str:
    """The token a call came with, as the audit log records it: its role and fingerprint, never the secret."""
    if tokens is None:
        return "no token: --insecure-no-token"
    presented = bearer_token(metadata)
    role = tokens.role_of(presented)
    if presented is None or role is None:
        return "no accepted token"  # not reached: the interceptor refuses such calls first
    return f"{role.value} token {token_fingerprint(presented)}"


class TokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Lets a call through only with a token whose role covers the method; an accepted token renews the lease."""

    def __init__(self, tokens: TokenSet | None, lease: Lease | None = None) -> None:
        self.tokens = tokens
        self.lease = lease

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], handler_call_details: Any
    ) -> Any:
        method: str = handler_call_details.method
        presented = bearer_token(handler_call_details.invocation_metadata)
        role = self.tokens.role_of(presented) if self.tokens is not None else None
        if self.lease is not None and (self.tokens is None or role is not None):
            self.lease.renew()
        if self.tokens is None or method.startswith(HEALTH_PREFIX):
            return _message_within(await continuation(handler_call_details), MESSAGE_WAIT_S)
        needed = METHOD_ROLES.get(method, Role.ACT)
        if role is not None and (role is Role.ACT or needed is Role.READ):
            return _message_within(await continuation(handler_call_details), MESSAGE_WAIT_S)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None  # unknown method: gRPC answers UNIMPLEMENTED
        if presented is None:
            return _denying_handler(
                handler, grpc.StatusCode.UNAUTHENTICATED,
                "no token sent: this agent needs 'authorization: Bearer <token>'",
            )
        if role is None:
            return _denying_handler(handler, grpc.StatusCode.UNAUTHENTICATED, "the token was not accepted")
        return _denying_handler(
            handler, grpc.StatusCode.PERMISSION_DENIED, f"{method} needs a token with the '{needed.value}' role"
        )
