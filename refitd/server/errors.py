"""Errors the controller turns into gRPC status codes and HTTP 4xx JSON bodies."""

from __future__ import annotations

from enum import Enum


class ErrorKind(Enum):
    """Why a request was refused; mapped to gRPC codes and HTTP statuses by the front ends."""

    INVALID = "invalid_argument"
    PRECONDITION = "failed_precondition"
    NOT_FOUND = "not_found"
    DEADLINE = "deadline_exceeded"
    UNAVAILABLE = "unavailable"


class ControlError(Exception):
    """A refused request, with a message naming the field, tensor and rank at fault."""

    def __init__(
        self, kind: ErrorKind, message: str, trailers: tuple[tuple[str, bytes], ...] = ()
    ) -> None:
        """`trailers`: gRPC trailing metadata for a client that acts on the refusal."""
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.trailers = trailers


def invalid(message: str) -> ControlError:
    return ControlError(ErrorKind.INVALID, message)


def precondition(message: str, trailers: tuple[tuple[str, bytes], ...] = ()) -> ControlError:
    return ControlError(ErrorKind.PRECONDITION, message, trailers)


def not_found(message: str) -> ControlError:
    return ControlError(ErrorKind.NOT_FOUND, message)
