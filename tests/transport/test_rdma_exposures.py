"""The rdma path's exposures (real Mooncake engines over TCP on loopback, in one process): a
new program load reuses the engines of the exposure it replaces, a sender holding the old
descriptor is refused, and writes through the new one land bit for bit."""

from __future__ import annotations

import time

import msgpack
import pytest
import torch

from refitd.transport.errors import TransportError
from refitd.transport.mooncake import SegmentDescriptor
from refitd.transport.mooncake_env import mooncake_unavailable_reason
from refitd.transport.paths import Exposed, PathSettings

REASON = mooncake_unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"rdma path: {REASON}")


def _sessions(body: bytes) -> tuple[str, ...]:
    segment = msgpack.unpackb(body, raw=False, strict_map_key=False)["segment"]
    return SegmentDescriptor.decode(segment).sessions


def test_a_reload_reuses_the_exposure_engines_and_refuses_the_old_descriptor() -> None:
    from refitd.transfer.rdma_path import RdmaPath

    dest, sender = RdmaPath(PathSettings(slot=1)), RdmaPath(PathSettings(slot=0))
    try:
        first_memory = torch.zeros(64, 256, dtype=torch.bfloat16)
        first = dest.expose({0: Exposed(first_memory, None, "plain", b"h")}, 1, 5)
        first.close()  # a new program load replaces the exposure
        memory = torch.zeros(64, 256, dtype=torch.bfloat16)
        second = dest.expose({0: Exposed(memory, None, "plain", b"h")}, 1, 6)
        assert _sessions(second.body) == _sessions(first.body)  # the same engines
        with pytest.raises(TransportError, match="slot 1"):
            sender.attach(first.body, "message 0 to slot 1")
        peer = sender.attach(second.body, "message 0 to slot 1")
        assert peer.generation() == 6
        src = torch.randn(64, 256, generator=torch.Generator().manual_seed(3)).bfloat16()
        # one contiguous write: one request (the engine reports a batch of several done
        # when its first request is)
        peer.write([peer.tensor(0).data], [src], time.monotonic() + 30)
        assert torch.equal(memory, src)
        peer.close()
        second.close()
    finally:
        sender.close()
        dest.close()
