"""The interface every transport implements: connect once per membership epoch, then post
sends and receives of flat uint8 tensors to peer ranks and wait on them with a timeout.

Transports move bytes only; they know nothing of plans, formats or gRPC.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Protocol

import torch

from refitd.transport.errors import TransportError


class Work(Protocol):
    """An operation in flight."""

    def wait(self, timeout_s: float) -> None:
        """Block until done; raise TransportError on failure or after timeout_s seconds."""
        ...


@dataclass(frozen=True, slots=True)
class ConnectInfo:
    """Where and how to join the refit communicator of one membership epoch."""

    epoch: int
    store_host: str
    store_port: int
    rank: int
    world_size: int
    timeout_s: float
    store_token: str = ""
    local_address: str = ""  # the agent's data-plane address: peers connect to it
    local_interface: str = ""  # or its interface (chosen by name)


@dataclass(frozen=True, slots=True)
class P2POp:
    """One point-to-point operation of a batch: send or recv `tensor` to/from rank `peer`."""

    send: bool
    tensor: torch.Tensor
    peer: int
    tag: int


class Transport(abc.ABC):
    """One rank of a refit communicator."""

    name: str = ""

    @abc.abstractmethod
    def connect(self, info: ConnectInfo) -> None:
        """Join the communicator of info.epoch; fails within info.timeout_s if peers are absent."""

    @property
    @abc.abstractmethod
    def rank(self) -> int: ...

    @abc.abstractmethod
    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        """Post a send of a contiguous uint8 tensor to rank `peer`."""

    @abc.abstractmethod
    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        """Post a receive into a contiguous uint8 tensor from rank `peer`."""

    def batch(self, ops: list[P2POp]) -> list[Work]:
        """Post several operations at once (NCCL groups them); default: one by one."""
        return [
            self.isend(op.tensor, op.peer, op.tag)
            if op.send
            else self.irecv(op.tensor, op.peer, op.tag)
            for op in ops
        ]

    @abc.abstractmethod
    def close(self) -> None:
        """Drop the communicator (idempotent)."""


class DoneWork:
    """A Work that finished when it was created."""

    def wait(self, timeout_s: float) -> None:
        del timeout_s


def check_buffer(tensor: torch.Tensor, what: str) -> None:
    if tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous():
        raise TransportError(
            f"{what}: buffers must be contiguous 1-D uint8 tensors, got "
            f"{tensor.dtype} shape {tuple(tensor.shape)} contiguous={tensor.is_contiguous()}"
        )
