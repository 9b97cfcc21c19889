"""The transport layer's errors, in a module of their own so that processes that only relay
them (the node agent, the client's error mapping) need not import torch."""

from __future__ import annotations


class TransportError(RuntimeError):
    """A connect, send or receive failed or timed out."""
