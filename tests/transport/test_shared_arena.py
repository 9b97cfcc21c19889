"""Registering CPU tensors into shared memory keeps their values, aliases and sharing."""

from __future__ import annotations

import torch

from refitd.transport.memory import MemoryMapper, SharedTensorArena


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
