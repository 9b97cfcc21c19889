"""A gRPC connection to the controller, shared by workers and node agents.

Every unary call carries a deadline; a failed call raises RefitError with the controller's
own message, so users see "tensor X of rank 3: ..." instead of a gRPC traceback. TLS and
the bearer token come from `ClientSecurity` (by default from the REFITD_* settings).
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field
from typing import Any

import grpc

from refitd._proto import refitd_pb2_grpc as pb_grpc
from refitd.security import ClientSecurity

# Codes after which retrying the same call later can succeed (controller restarting, overloaded).
TRANSIENT_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)
MAX_MESSAGE_BYTES = 256 << 20


class RefitError(RuntimeError):
    """A request to the controller failed; `code` is the gRPC status code when one came back.

    The text is the controller's message (which tensor, which rank, what is inconsistent).
    """

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code

    @classmethod
    def from_rpc(cls, err: grpc.RpcError, what: str) -> RefitError:
        code = err.code() if hasattr(err, "code") else None
        details = err.details() if hasattr(err, "details") else str(err)
        name = code.name if code is not None else "ERROR"
        return cls(f"{what}: {name}: {details}", code)

    @property
    def transient(self) -> bool:
        """True when the same request may succeed later (controller unreachable or busy)."""
        return self.code in TRANSIENT_CODES


@dataclass
class Backoff:
    """Exponential backoff with jitter, waiting on a stop event so shutdown is immediate.

    The 1 s cap keeps reconnection within about a second of a controller restart (a
    failed call on a channel that is still reconnecting costs nothing on the wire)."""

    initial_s: float = 0.1
    maximum_s: float = 1.0
    _next_s: float = field(default=0.0, init=False)

    def reset(self) -> None:
        self._next_s = 0.0

    def wait(self, stop: threading.Event) -> bool:
        """Sleep the next delay; True if `stop` was set meanwhile."""
        self._next_s = min(self.maximum_s, max(self.initial_s, self._next_s * 2))
        return stop.wait(self._next_s * random.uniform(0.75, 1.25))


class ControllerConnection:
    """One channel to the controller with both service stubs and deadline-bound calls."""

    def __init__(
        self, address: str, rpc_timeout_s: float = 30.0, security: ClientSecurity | None = None
    ) -> None:
        if ":" not in address:
            raise ValueError(f"controller address {address!r} must be HOST:PORT")
        self.address = address
        self.rpc_timeout_s = rpc_timeout_s
        self.security = security if security is not None else default_security()
        self.channel = self.security.channel(
            address,
            options=[
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.enable_retries", 0),
                # Reconnect soon after a controller restart (the default backoff grows to
                # minutes; workers and agents re-register only once they are connected).
                ("grpc.initial_reconnect_backoff_ms", 200),
                ("grpc.max_reconnect_backoff_ms", 1000),
            ],
        )
        self.refit = pb_grpc.RefitStub(self.channel)
        self.agents = pb_grpc.AgentControlStub(self.channel)

    def call(self, method: Any, request: Any, what: str, timeout_s: float | None = None) -> Any:
        """Call a unary stub method with a deadline; RefitError on failure."""
        try:
            return method(request, timeout=timeout_s or self.rpc_timeout_s)
        except grpc.RpcError as err:
            raise RefitError.from_rpc(err, what) from None

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the channel connects; RefitError naming the address otherwise."""
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise RefitError(
                f"controller {self.address} unreachable after {timeout_s:.0f} s",
                grpc.StatusCode.UNAVAILABLE,
            ) from None

    def close(self) -> None:
        self.channel.close()


def default_security() -> ClientSecurity:
    """TLS and token settings from REFITD_* env vars and $REFITD_CONFIG (none: plaintext)."""
    from refitd.config import load_settings

    return ClientSecurity.from_settings(load_settings())


def security_for(settings: Any) -> ClientSecurity:
    """ClientSecurity of `settings` (a refitd.config.Settings), else the default."""
    return ClientSecurity.from_settings(settings) if settings is not None else default_security()
