"""A small GPT-style model in Megatron-Core naming, its parallel layouts and its weights.

The demo and the end-to-end tests need weights that any process can produce for any block
of any tensor without holding the global tensor: element g of tensor `canonical` at
`version` is table[(flat(g) * STEP) mod TABLE] where `table` is a small BF16 table drawn from
a seed made of (seed, version, canonical). A trainer rank fills its shards from its boxes;
an inference rank checks every landed shard bit for bit against the same function.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from refitd.plan.layout import Box

TABLE = 65521  # prime: neighbouring elements and neighbouring rows get unrelated values
STEP = 40503
ROWS_PER_CHUNK_ELEMS = 1 << 22  # bound on the temporaries of one fill or check


@dataclass(frozen=True, slots=True)
class GptConfig:
    """Shape of a GPT-style decoder (gated MLP, untied output layer)."""

    layers: int = 8
    hidden: int = 1024
    ffn: int = 4096
    vocab: int = 32000

    def global_shapes(self) -> dict[str, tuple[int, ...]]:
        """Canonical name -> global shape, in Megatron-Core naming."""
        h, f = self.hidden, self.ffn
        shapes: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (self.vocab, h)}
        for i in range(self.layers):
            p = f"decoder.layers.{i}."
            shapes[p + "self_attention.linear_qkv.layer_norm_weight"] = (h,)
            shapes[p + "self_attention.linear_qkv.weight"] = (3 * h, h)
            shapes[p + "self_attention.linear_proj.weight"] = (h, h)
            shapes[p + "mlp.linear_fc1.layer_norm_weight"] = (h,)
            shapes[p + "mlp.linear_fc1.weight"] = (2 * f, h)
            shapes[p + "mlp.linear_fc2.weight"] = (h, f)
        shapes["decoder.final_layernorm.weight"] = (h,)
        shapes["output_layer.weight"] = (self.vocab, h)
        return shapes

    @property
    def nbytes(self) -> int:
        """BF16 bytes of the whole model."""
        return 2 * sum(math.prod(s) for s in self.global_shapes().values())

    @classmethod
    def for_megabytes(cls, mb: float, layers: int = 8) -> GptConfig:
        """The config whose BF16 size is closest to `mb` MB (hidden a multiple of 64)."""
        vocab = 32000 if mb >= 128 else 4096
        candidates = [cls(layers, h, 4 * h, vocab) for h in range(64, 16385, 64)]
        return min(candidates, key=lambda c: abs(c.nbytes - mb * 1e6))


# Megatron TP attributes per tensor kind: (partition_dim, partition_stride); None: replicated.
def _tp_split(canonical: str) -> tuple[int, int] | None:
    if canonical.endswith("layer_norm_weight") or canonical.endswith("final_layernorm.weight"):
        return None
    if canonical.endswith("linear_fc1.weight"):
        return (0, 2)  # gated: [gate; up], each half split across TP ranks
    if canonical.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return (1, 1)
    return (0, 1)  # embedding, output layer, qkv


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    """tp x dp x pp ranks in Megatron's default order (tp fastest, then dp, then pp)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, dp_rank, pp_rank) of a global rank."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside a world of {self.world}")
        return rank % self.tp, (rank // self.tp) % self.dp, rank // (self.tp * self.dp)


@dataclass(frozen=True, slots=True)
class RankTensor:
    """One local tensor of one rank: local name, canonical name, placement."""

    name: str
    canonical: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    boxes: tuple[Box, ...]
    partition_dim: int  # -1: replicated across TP
    partition_stride: int
    layer_offset: int


def megatron_parameter(shard: RankTensor) -> torch.nn.Parameter:
    """A zeroed BF16 parameter for `shard`, carrying the Megatron TP attributes
    (tensor_model_parallel, partition_dim, partition_stride) when it is split over TP."""
    p = torch.nn.Parameter(torch.zeros(shard.local_shape, dtype=torch.bfloat16), False)
    if shard.partition_dim >= 0:
        p.tensor_model_parallel = True  # type: ignore[attr-defined]
        p.partition_dim = shard.partition_dim  # type: ignore[attr-defined]
        p.partition_stride = shard.partition_stride  # type: ignore[attr-defined]
    return p


def stage_layers(cfg: GptConfig, pp: int, pp_rank: int) -> range:
    """Global layer indices of a PP stage (the first stages take one more if uneven)."""
    base, extra = divmod(cfg.layers, pp)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


def _on_stage(canonical: str, pp_rank: int, pp: int) -> bool:
    """Whether a non-layer tensor lives on this PP stage (embedding first, head last)."""
    if canonical.startswith("embedding."):
        return pp_rank == 0
    if canonical.startswith(("output_layer.", "decoder.final_layernorm.")):
        return pp_rank == pp - 1
    return True


def rank_shards(cfg: GptConfig, layout: ParallelLayout, rank: int) -> list[RankTensor]:
    """Every local tensor of `rank`, with Megatron local names (layer index within the stage)."""
    tp_rank, _, pp_rank = layout.coords(rank)
    layers = stage_layers(cfg, layout.pp, pp_rank)
    shards = []
    for canonical, shape in cfg.global_shapes().items():
        local_name = canonical
        if canonical.startswith("decoder.layers."):
            layer = int(canonical.split(".")[2])
            if layer not in layers:
                continue
            local_name = canonical.replace(f"layers.{layer}.", f"layers.{layer - layers.start}.", 1)
        elif not _on_stage(canonical, pp_rank, layout.pp):
            continue
        split = _tp_split(canonical)
        dim, stride = split if split and layout.tp > 1 else (-1, 1)
        local_shape, boxes = tp_boxes(shape, dim, stride, layout.tp, tp_rank)
        shards.append(
            RankTensor(local_name, canonical, shape, local_shape, boxes, dim, stride, layers.start)
        )
    return shards


def tp_boxes(
    shape: tuple[int, ...], dim: int, stride: int, tp: int, tp_rank: int
) -> tuple[tuple[int, ...], tuple[Box, ...]]:
    """Local shape and boxes of a TP shard split along `dim` with `stride` (dim -1: replica)."""
    zeros = (0,) * len(shape)
    if dim < 0:
        return shape, (Box(zeros, shape, zeros),)
    if shape[dim] % (tp * stride):
        raise ValueError(f"dim {dim} of shape {shape} does not divide into {tp} x {stride}")
    chunk = shape[dim] // (tp * stride)
    local = list(shape)
    local[dim] = chunk * stride
    boxes = []
    for k in range(stride):
        off = list(zeros)
        off[dim] = k * (shape[dim] // stride) + tp_rank * chunk
        loc = list(zeros)
        loc[dim] = k * chunk
        bshape = list(shape)
        bshape[dim] = chunk
        boxes.append(Box(tuple(off), tuple(bshape), tuple(loc)))
    return tuple(local), tuple(boxes)


class WeightGenerator:
    """Weights of (seed, version) for any block of any tensor, without the global tensor."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def table(self, canonical: str, version: int) -> torch.Tensor:
        """The BF16 value table of one tensor at one version."""
        digest = hashlib.blake2b(f"{self.seed}/{version}/{canonical}".encode(), digest_size=8)
        gen = torch.Generator().manual_seed(int.from_bytes(digest.digest(), "little") >> 1)
        return (torch.randn(TABLE, generator=gen) * 0.02).to(torch.bfloat16)

    def fill(self, out: torch.Tensor, shard: RankTensor, version: int) -> None:
        """Write the shard's blocks of `version` into the local tensor `out`."""
        table = self.table(shard.canonical, version)
        for region, index in self._blocks(out, shard):
            region.copy_(table[index])

    def mismatch(self, local: torch.Tensor, shard: RankTensor, version: int) -> str | None:
        """None if `local` equals the shard of `version` bit for bit, else what differs."""
        if tuple(local.shape) != shard.local_shape or local.dtype != torch.bfloat16:
            return f"{shard.name}: {tuple(local.shape)} {local.dtype}, expected {shard.local_shape} bfloat16"
        table = self.table(shard.canonical, version)
        for region, index in self._blocks(local, shard):
            expected = table[index]
            if not torch.equal(region.view(torch.int16), expected.view(torch.int16)):
                bad = (region.view(torch.int16) != expected.view(torch.int16)).sum().item()
                return f"{shard.name}: {bad} elements differ from version {version}"
        return None

    def _blocks(self, local: torch.Tensor, shard: RankTensor):
        """(view of local, table index tensor) per chunk of rows of every box."""
        gshape = shard.global_shape
        strides = [math.prod(gshape[k + 1 :]) for k in range(len(gshape))]
        for box in shard.boxes:
            rest = math.prod(box.shape[1:]) if len(box.shape) > 1 else 1
            rows = max(1, ROWS_PER_CHUNK_ELEMS // max(rest, 1))
            for r0 in range(0, box.shape[0], rows):
                r1 = min(box.shape[0], r0 + rows)
                index = torch.zeros((), dtype=torch.int64)
                view = local
                for k in range(len(gshape)):
                    lo, n = box.offset[k], box.shape[k]
                    llo = box.local_offset[k]
                    if k == 0:
                        lo, n, llo = lo + r0, r1 - r0, llo + r0
                    coord = torch.arange(lo, lo + n, dtype=torch.int64)
                    part = (coord * ((strides[k] * STEP) % TABLE)) % TABLE
                    index = index.unsqueeze(-1) + part if k else part
                    view = view.narrow(k, llo, n)
                yield view, index % TABLE
