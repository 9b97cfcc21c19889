"""Small layouts for data-plane tests: tensors split over ranks along one dim (uneven allowed)."""

from __future__ import annotations

import zlib

import torch

from refitd.plan.layout import Box, TensorSpec

# name -> (global shape, split dim on the source side, split dim on the destination side)
MODEL: dict[str, tuple[tuple[int, ...], int, int]] = {
    "col": ((40, 24), 0, 0),
    "row": ((24, 40), 1, 0),
    "qkv": ((3, 20, 16), 1, 2),
    "bias": ((37,), 0, 0),
}


def bounds(n: int, parts: int, index: int) -> tuple[int, int]:
    """Contiguous uneven split: the first n % parts parts get one more."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def spec(
    pool: str,
    name: str,
    shape: tuple[int, ...],
    dim: int,
    parts: int,
    rank: int,
    slot: int,
    dtype: str,
) -> TensorSpec:
    lo, hi = bounds(shape[dim], parts, rank)
    local = tuple(hi - lo if d == dim else s for d, s in enumerate(shape))
    offset = tuple(lo if d == dim else 0 for d in range(len(shape)))
    box = Box(offset, local, (0,) * len(shape))
    return TensorSpec("m", pool, rank, slot, name, name, shape, dtype, local, (box,))


def global_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{seed}".encode()))
    return torch.randn(shape, generator=g, dtype=torch.float32).to(torch.bfloat16)


def shard(g: torch.Tensor, s: TensorSpec) -> torch.Tensor:
    b = s.boxes[0]
    return g[tuple(slice(o, o + n) for o, n in zip(b.offset, b.shape, strict=True))]


def make_model(
    src_parts: int,
    dst_parts: int,
    src_slots: list[int],
    dst_slots: list[int],
    dst_dtypes: dict[str, str] | None = None,
) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Specs of MODEL split over src_parts source ranks and dst_parts destination ranks."""
    dst_dtypes = dst_dtypes or {}
    src = [
        spec("train", n, shape, sd, src_parts, r, src_slots[r], "bfloat16")
        for n, (shape, sd, _) in MODEL.items()
        for r in range(src_parts)
    ]
    dst = [
        spec("infer", n, shape, dd, dst_parts, r, dst_slots[r], dst_dtypes.get(n, "bfloat16"))
        for n, (shape, _, dd) in MODEL.items()
        for r in range(dst_parts)
    ]
    return src, dst


def globals_for(seed: int) -> dict[str, torch.Tensor]:
    return {n: global_tensor(n, shape, seed) for n, (shape, _, _) in MODEL.items()}


def fill_sources(src: list[TensorSpec], globals_: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [shard(globals_[s.name], s).clone() for s in src]


def expected(d: TensorSpec, globals_: dict[str, torch.Tensor]) -> torch.Tensor:
    return shard(globals_[d.name], d).to(getattr(torch, d.dtype))


def local_from_global(s: TensorSpec, g: torch.Tensor) -> torch.Tensor:
    """The local tensor of spec `s` (every box) cut from global tensor `g`, in s.dtype."""
    out = torch.zeros(s.local_shape, dtype=getattr(torch, s.dtype))
    for b in s.boxes:
        dst = tuple(slice(o, o + n) for o, n in zip(b.local_offset, b.shape, strict=True))
        src = tuple(slice(o, o + n) for o, n in zip(b.offset, b.shape, strict=True))
        out[dst] = g[src].to(out.dtype)
    return out


def megatron_side(
    pool: str,
    tp: int,
    dp: int,
    model: list[tuple[str, tuple[int, ...], int]],
    slots: list[int],
    stride: int = 1,
) -> list[TensorSpec]:
    """Specs of (name, global shape, TP dim) tensors over dp replicas of TP=tp (rank d*tp+t
    on slots[rank]), through the planner's Megatron layout helpers."""
    from refitd.plan.layouts import make_spec, megatron_layout

    return [
        make_spec(
            model="m",
            pool=pool,
            rank=d * tp + t,
            slot=slots[d * tp + t],
            name=name,
            global_shape=shape,
            dtype="bfloat16",
            layout=megatron_layout(
                shape, tp_rank=t, tp_size=tp, partition_dim=dim, partition_stride=stride
            ),
        )
        for name, shape, dim in model
        for d in range(dp)
        for t in range(tp)
    ]
