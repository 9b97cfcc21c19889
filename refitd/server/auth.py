"""Bearer-token checks of the controller's front ends (gRPC interceptor, HTTP dependency).

Default deny: with a token configured every gRPC method needs it except the read-only
ones (GetStatus, health, reflection). On HTTP the probes and metrics stay open; the status
JSON and page need the token (header, `?token=` query or the cookie the page sets).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from fastapi import HTTPException, Request

from refitd.security import (
    AUTH_HEADER,
    TOKEN_COOKIE,
    bearer_token,
    tokens_equal,
)

OPEN_METHOD_PREFIXES = (
    "/refitd.v1.Refit/GetStatus",
    "/grpc.health.v1.Health/",
    "/grpc.reflection.",
)


def method_is_open(method: str) -> bool:
    """True for read-only methods anyone reaching the port may call."""
    return method.startswith(OPEN_METHOD_PREFIXES)


def token_problem(presented: str, expected: str, what: str) -> str:
    """'' when `presented` is the token; otherwise why the call is refused."""
    if not presented:
        return (
            f"{what} requires 'authorization: Bearer <token>' (the controller's auth_token); "
            f"none was sent"
        )
    if not tokens_equal(presented, expected):
        return f"{what}: the bearer token presented is not the controller's auth_token"
    return ""


class TokenAuthInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """Refuses calls without the bearer token with UNAUTHENTICATED, before parsing them."""

    def __init__(self, token: str) -> None:
        self._token = token

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = details.method
        if method_is_open(method):
            return continuation(details)
        presented = ""
        for key, value in details.invocation_metadata or ():
            if key == AUTH_HEADER and isinstance(value, str):
                presented = bearer_token(value)
                break
        problem = token_problem(presented, self._token, f"method {method}")
        if not problem:
            return continuation(details)
        handler = continuation(details)
        if handler is None:
            return None
        return _denying_handler(handler, problem)


def _denying_handler(handler: grpc.RpcMethodHandler, problem: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape that aborts; the request bytes are never deserialized."""

    def deny(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)

    def deny_stream(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)
        yield  # pragma: no cover - abort raises

    ser = handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny_stream, None, ser)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, None, ser)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny_stream, None, ser)
    return grpc.unary_unary_rpc_method_handler(deny, None, ser)


def http_token_dependency(token: str) -> Callable[[Request], None]:
    """A FastAPI dependency enforcing the token (a no-op when none is configured)."""

    def require_token(request: Request) -> None:
        if not token:
            return
        presented = (
            bearer_token(request.headers.get(AUTH_HEADER, ""))
            or request.query_params.get("token", "")
            or request.cookies.get(TOKEN_COOKIE, "")
        )
        problem = token_problem(presented, token, f"{request.url.path}")
        if problem:
            raise HTTPException(401, problem, headers={"WWW-Authenticate": "Bearer"})

    return require_token
