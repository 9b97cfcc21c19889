"""The transfer process's liveness check of many handles (read in bulk per state segment)
passes while every registration is live and names the tensor whose storage moved."""

from __future__ import annotations

import pytest
import torch

from refitd.memory.arena import SharedTensorArena
from refitd.memory.errors import StorageMovedError
from refitd.memory.mapping import MemoryMapper
from refitd.transfer.mapped import MappedResolver


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
