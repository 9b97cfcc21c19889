"""Bearer-token checks of the controller's front ends (gRPC calls, HTTP dependency).

Default deny: with a token configured every gRPC method needs it except the read-only
ones (GetStatus, health, reflection). On HTTP the probes and metrics stay open; the status
JSON and page need the token (header, `?token=` query or the cookie the page sets).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

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


def call_token_problem(
    metadata: Iterable[tuple[str, str | bytes]] | None, token: str, method: str
) -> str:
    """'' when a gRPC call of `method` may go on: no token is configured, the method is
    open, or its metadata presents the token; otherwise why it is refused
    (UNAUTHENTICATED, before its request is parsed)."""
    if not token or method_is_open(method):
        return ""
    presented = ""
    for key, value in metadata or ():
        if key == AUTH_HEADER and isinstance(value, str):
            presented = bearer_token(value)
            break
    return token_problem(presented, token, f"method {method}")


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
