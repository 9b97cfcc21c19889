"""Where each registered local tensor sits in its global tensor.

Every parallel layout (TP with strides, partition_sizes packing, EP, PP, DP replicas,
uneven DTensor chunks, several sharded dims) reduces to a list of boxes: blocks of the
global tensor, each with the place it occupies inside the local tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from refitd.plan.wire import PLAIN


@dataclass(frozen=True, slots=True)
class Box:
    """A block of the global tensor held by one shard.

    offset/shape are in global coordinates; local_offset is where the block starts in the
    local tensor (the block has the same shape there).
    """

    offset: tuple[int, ...]
    shape: tuple[int, ...]
    local_offset: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One registered local tensor of one worker rank.

    dtype is the element dtype by torch name without the prefix ("bfloat16", "float32").
    storage is how the destination keeps it (wire.STORAGE_FORMATS): "plain", or a quantized
    persistent layout ("mxfp8": uint8 E4M3 data of local_shape plus uint8 E8M0 scales of
    local_shape[:-1] + (ceil(local_shape[-1] / 32),); "fp8_block": uint8 E4M3 data plus
    float32 scales of local_shape[:-2] + (ceil(r / 128), ceil(c / 128)); "nvfp4": uint8
    E2M1 data of local_shape[:-1] + (local_shape[-1] / 2,) (two values per byte, an even
    last dim), uint8 E4M3 scales of local_shape[:-1] + (ceil(local_shape[-1] / 16),) and
    one float32 global scale of the whole tensor). local_shape is in elements either way.
    """

    model: str
    pool: str
    rank: int
    slot: int
    name: str
    canonical: str
    global_shape: tuple[int, ...]
    dtype: str
    local_shape: tuple[int, ...]
    boxes: tuple[Box, ...]
    storage: str = PLAIN
    meta: tuple[tuple[str, str], ...] = field(default=())

    @property
    def key(self) -> tuple[str, int, str]:
        """(pool, rank, local name): unique within a model."""
        return (self.pool, self.rank, self.name)
