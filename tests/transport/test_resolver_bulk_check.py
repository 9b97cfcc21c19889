"""The transfer process's liveness check of many handles (read in bulk per state segment,
then one stale count per segment before each refit) passes while every registration is
live and names the tensor whose storage moved, in a slot's resolver and in a sender's
mapped peer."""

from __future__ import annotations

import pytest
import torch

from refitd.memory.arena import SharedTensorArena
from refitd.memory.errors import StorageMovedError
from refitd.memory.handles import STATE_STALE_COUNT
from refitd.memory.mapping import MemoryMapper
from refitd.transfer.mapped import MappedResolver
from refitd.transfer.mapped_path import MappedPeer, ShmDoorbell
from refitd.transport.errors import TransportError


@pytest.mark.parametrize("count", [1, 63, 192])
def test_bulk_liveness_check_names_the_moved_tensor(count: int) -> None:
    tensors = {f"t{i}": torch.full((16,), float(i)) for i in range(count)}
    arena = SharedTensorArena(prefix="refitd-test-bulk")
    mapper = MemoryMapper()
    try:
        handles = arena.register(tensors)
        resolver = MappedResolver(mapper, {i: handles[f"t{i}"] for i in range(count)}, {})
        indices = list(range(count))
        for _ in range(2):  # the second check reuses the cached word indices
            resolver.check(indices)
        assert torch.equal(resolver.resolve(count - 1).data, tensors[f"t{count - 1}"])
        moved = f"t{count // 2}"
        with torch.no_grad():
            tensors[moved].set_(torch.zeros(16))
        assert arena.check_unmoved() == [moved]
        with pytest.raises(StorageMovedError, match=moved):
            resolver.check(indices)
        resolver.check([i for i in indices if i != count // 2])  # the others are live
    finally:
        mapper.close()
        arena.close()


def test_a_prepared_check_sees_each_new_stale_mark_and_passes_the_live() -> None:
    """The per-refit check reads each state segment's stale count; a registration marked
    stale since (a count that moved) makes it read the words again: it names the moved
    tensor of its set, and passes a set whose tensors all stayed live, every time."""
    tensors = {f"t{i}": torch.full((16,), float(i)) for i in range(4)}
    arena = SharedTensorArena(prefix="refitd-test-count")
    mapper = MemoryMapper()
    try:
        handles = arena.register(tensors)
        assert STATE_STALE_COUNT not in {h.state_index for h in handles.values()}
        resolver = MappedResolver(mapper, {i: handles[f"t{i}"] for i in range(4)}, {})
        live, moving = frozenset({0, 1}), frozenset({2, 3})
        seg = handles["t0"].state_segment
        for _ in range(2):
            resolver.check(live)
            resolver.check(moving)
        for name in ("t3", "t2"):
            before = int(mapper.state_words(seg)[STATE_STALE_COUNT])
            with torch.no_grad():
                tensors[name].set_(torch.zeros(16))
            assert name in arena.check_unmoved()  # marks it (and t3 again) stale
            assert int(mapper.state_words(seg)[STATE_STALE_COUNT]) > before
            for _ in range(2):  # the moved count is taken again: still live, still checked
                resolver.check(live)
                with pytest.raises(StorageMovedError, match=name):
                    resolver.check(moving)
    finally:
        mapper.close()
        arena.close()


def test_a_mapped_peer_refuses_a_destination_whose_storage_moved() -> None:
    """A sender on a mapped link checks the destination tensors it maps before every
    refit: live ones pass, each check after one moved names it, until it is mapped again."""
    tensors = {f"d{i}": torch.full((16,), float(i)) for i in range(3)}
    arena = SharedTensorArena(prefix="refitd-test-peer")
    bell = ShmDoorbell.create(4, 1)
    try:
        handles = arena.register(tensors)
        raw = {i: (handles[f"d{i}"].to_bytes(), "plain") for i in range(3)}
        peer = MappedPeer(bell, raw, "slot 1")
        try:
            for i in range(3):
                assert torch.equal(peer.tensor(i).data, tensors[f"d{i}"])
            for _ in range(2):
                peer.check_live()
            with torch.no_grad():
                tensors["d1"].set_(torch.zeros(16))
            assert arena.check_unmoved() == ["d1"]
            for _ in range(2):
                with pytest.raises(TransportError, match=r"slot 1: .*d1"):
                    peer.check_live()
        finally:
            peer.close()
    finally:
        bell.close()
        arena.close()
