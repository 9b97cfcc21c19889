"""Registering CPU tensors into shared memory keeps their values, aliases and sharing."""

from __future__ import annotations

import numpy as np
import torch

from refitd.memory.arena import SharedTensorArena
from refitd.memory.mapping import MemoryMapper


def test_one_tensor_under_two_names_and_views_of_one_storage() -> None:
    base = torch.arange(64, dtype=torch.float32)
    w = base.view(8, 8)
    tail = base[32:]  # a view at a storage offset
    arena = SharedTensorArena(prefix="refitd-arenatest")
    try:
        handles = arena.register({"a": w, "b": w, "tail": tail})
        assert torch.equal(w.flatten(), torch.arange(64, dtype=torch.float32))  # values kept
        assert tail.data_ptr() == w.data_ptr() + 32 * 4  # still one storage
        mapper = MemoryMapper()
        a, b, t = (mapper.map_handle(handles[n]) for n in ("a", "b", "tail"))
        a[0, 0] = -1.0  # written through the mapping of "a"
        assert w[0, 0].item() == -1.0 and b[0, 0].item() == -1.0
        t[0] = -2.0
        assert w[4, 0].item() == -2.0
        assert torch.equal(b, w) and torch.equal(t, tail)
    finally:
        arena.close()


def test_a_storage_moves_in_place_for_views_that_were_not_registered() -> None:
    """Parameters that are views of one flat buffer (Megatron's distributed optimizer,
    FSDP2's padded shard): the buffer itself is not registered, yet writes through it must
    reach the registered memory, and writes there must reach it."""
    flat = torch.arange(24, dtype=torch.float32)
    first = flat[:6].view(2, 3)
    second = flat[6:20].view(7, 2).t()  # non-contiguous: a transposed view
    arena = SharedTensorArena(prefix="refitd-arenatest")
    try:
        handles = arena.register({"first": first, "second": second})
        assert flat.data_ptr() == first.data_ptr() == handles["first"].data_ptr
        assert not second.is_contiguous() and handles["second"].strides == (1, 2)
        mapper = MemoryMapper()
        mapped = {n: mapper.map_handle(h) for n, h in handles.items()}
        flat.mul_(2)  # e.g. the optimizer's all-gather into its flat buffer
        assert torch.equal(mapped["first"], torch.arange(6.0).view(2, 3) * 2)
        assert torch.equal(mapped["second"], torch.arange(6.0, 20.0).view(7, 2).t() * 2)
        mapped["second"][1, 0] = -1.0  # a refit writing the registered memory
        assert flat[7].item() == -1.0 and second[1, 0].item() == -1.0
    finally:
        arena.close()


def test_two_storage_objects_over_one_memory_still_share_after_registration() -> None:
    array = np.arange(8, dtype=np.float32)
    a, b = torch.from_numpy(array), torch.from_numpy(array)[2:]
    assert a.untyped_storage()._cdata != b.untyped_storage()._cdata
    arena = SharedTensorArena(prefix="refitd-arenatest")
    try:
        handles = arena.register({"a": a, "b": b})
        MemoryMapper().map_handle(handles["a"])[3] = -5.0
        assert a[3].item() == -5.0 and b[1].item() == -5.0
    finally:
        arena.close()
