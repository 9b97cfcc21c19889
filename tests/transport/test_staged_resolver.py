"""A staged pool's registrations over one tensor (the pieces of an engine's fused qkv or
gate_up: one registration per piece, all on the same memory) land together: writing each
piece's rows into its staging and applying gives every piece's new rows in the live
tensor, none written back as it was when the program was loaded."""

from __future__ import annotations

import torch

from refitd.memory.arena import SharedTensorArena
from refitd.memory.mapping import MemoryMapper
from refitd.transfer.mapped import MappedResolver


def test_pieces_of_one_staged_tensor_apply_together() -> None:
    fused = torch.zeros(6, 4)  # rows 0..3: the q piece, rows 4..5: the kv piece
    other = torch.zeros(3)
    arena = SharedTensorArena(prefix="refitd-test-staged-pieces")
    mapper = MemoryMapper()
    try:
        handles = arena.register({"fused": fused, "fused@kv": fused, "other": other})
        resolver = MappedResolver(
            mapper,
            {0: handles["fused"], 1: handles["fused@kv"], 2: handles["other"]},
            {},
            staged=frozenset({0, 1, 2}),
        )
        resolver.stage()
        try:
            resolver.resolve(0).data[:4] = 1.0  # what a refit writes through each piece
            resolver.resolve(1).data[4:] = 2.0
            resolver.resolve(2).data[:] = 3.0
            assert int(fused.count_nonzero()) == 0  # live untouched until apply
            copied = resolver.apply()
        finally:
            resolver.close()
        assert torch.equal(fused, torch.tensor([[1.0] * 4] * 4 + [[2.0] * 4] * 2))
        assert torch.equal(other, torch.full((3,), 3.0))
        assert copied == fused.numel() * 4 + other.numel() * 4  # each memory once
    finally:
        mapper.close()
        arena.close()
