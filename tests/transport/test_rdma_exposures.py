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


def test_a_strided_write_has_landed_in_full_when_it_returns() -> None:
    """The rows of a strided region are many small requests: every one of them has landed
    when the write returns (the doorbell is rung right after)."""
    from refitd.transfer.rdma_path import RdmaPath

    dest, sender = RdmaPath(PathSettings(slot=1)), RdmaPath(PathSettings(slot=0))
    try:
        memory = torch.zeros(256, 1024, dtype=torch.bfloat16)
        exposure = dest.expose({0: Exposed(memory, None, "plain", b"h")}, 1, 7)
        peer = sender.attach(exposure.body, "message 0 to slot 1")
        view = peer.tensor(0).data
        src = torch.randn(256, 1024, generator=torch.Generator().manual_seed(5)).bfloat16()
        want = torch.zeros_like(memory)
        for k in range(4):  # each time the engine may report a batch done early
            rows = slice(64 * k, 64 * k + 60)
            peer.write([view[rows, 8:1000]], [src[rows, 8:1000]], time.monotonic() + 30)
            want[rows, 8:1000] = src[rows, 8:1000]
            assert torch.equal(memory, want), f"write {k}: rows missing when it returned"
        peer.close()
        exposure.close()
    finally:
        sender.close()
        dest.close()


def test_rings_of_many_messages_in_one_call_each_reach_their_own_word() -> None:
    """A sender confirms whatever landed meanwhile in one exchange: more rings than one
    control post carries, to adjacent doorbell words, each word gets its own value; with
    the generation read (`ring_current`) a stale destination is told."""
    from refitd.transfer.rdma_path import RINGS, RdmaPath
    from refitd.transport.doorbell import HEADER_WORDS, value

    dest, sender = RdmaPath(PathSettings(slot=1)), RdmaPath(PathSettings(slot=0))
    entries = RINGS + 9
    try:
        memory = torch.zeros(16, dtype=torch.bfloat16)
        exposure = dest.expose({0: Exposed(memory, None, "plain", b"h")}, entries, 9)
        peer = sender.attach(exposure.body, "message 0 to slot 1")
        rings = [(e, 3 + e % 2, 1 + 7 * e) for e in range(entries) if e != 5]
        peer.ring_many(rings)
        words = exposure.doorbell.words[HEADER_WORDS:].tolist()
        assert words == [0 if e == 5 else value(3 + e % 2, 1 + 7 * e) for e in range(entries)]
        assert peer.generation() == 9
        # rings posted with the generation read (one exchange): all land while it is the
        # descriptor's; another generation, or a retired doorbell, is told to the sender
        fresh = [(e, 6, 1 + e) for e in range(entries)]
        assert peer.ring_current(9, fresh)
        words = exposure.doorbell.words[HEADER_WORDS:].tolist()
        assert words == [value(6, 1 + e) for e in range(entries)]
        assert not peer.ring_current(10, fresh[:1])
        exposure.doorbell.retire()
        assert not peer.ring_current(9, fresh[:1])
        peer.close()
        exposure.close()
    finally:
        sender.close()
        dest.close()
