"""A transport by the name a ConnectCommand carries: the one place that knows every backend."""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping

from refitd.transport.base import Transport
from refitd.transport.gloo import GlooTransport
from refitd.transport.local import LocalTransport
from refitd.transport.nccl import NcclTransport

TRANSPORTS: Mapping[str, Callable[[], Transport]] = types.MappingProxyType(
    {
        "local": LocalTransport,
        "gloo": GlooTransport,
        "nccl": NcclTransport,
    }
)


def create_transport(name: str) -> Transport:
    """A new transport of this name: local, gloo or nccl."""
    try:
        make = TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"unknown transport {name!r}; known: {', '.join(TRANSPORTS)}") from None
    return make()
