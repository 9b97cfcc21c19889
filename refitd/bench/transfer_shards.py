"""The model of `refitd bench transfer`: global tensors from a known pattern, every slot's
shards placed in shared memory as its worker would hold them, and the bit-for-bit check of
what landed (MXFP8 destinations against the reference quantizer)."""

from __future__ import annotations

import dataclasses
import math
import time
from collections import defaultdict

import torch

from refitd.memory.arena import SharedTensorArena
from refitd.plan.layout import TensorSpec
from refitd.plan.wire import MXFP8, mxfp8_scale_shape


def pattern(k: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Global tensor k: distinct, exactly representable BF16 values from its index."""
    n = math.prod(shape)
    return ((torch.arange(n, dtype=torch.int32) * 7 + k * 13) % 2039 - 1019).to(
        torch.bfloat16
    ).reshape(shape) / 64


def block(g: torch.Tensor, s: TensorSpec) -> torch.Tensor:
    (b,) = s.boxes
    return g[tuple(slice(o, o + n) for o, n in zip(b.offset, b.shape, strict=True))]


@dataclasses.dataclass
class Shards:
    """Every slot's tensors (sources, then destinations, in plan tensor order), the MXFP8
    scales of destinations by tensor index, and the shared-memory handle of each by name
    (t{i}; the scales ride on their tensor's handle)."""

    tensors: list[torch.Tensor]
    scales: dict[int, torch.Tensor]
    mem: dict


def place_shards(
    src: list[TensorSpec],
    dst: list[TensorSpec],
    shapes: dict[str, tuple[int, int]],
    arenas: dict[int, SharedTensorArena],
) -> Shards:
    """Sources filled from the pattern and zeroed destinations, each in its slot's arena
    (created on first use into `arenas`, which the caller closes)."""

    def arena_of(slot: int) -> SharedTensorArena:
        if slot not in arenas:
            arenas[slot] = SharedTensorArena(prefix="refitd-bench")
        return arenas[slot]

    scales: dict[int, torch.Tensor] = {}
    by_name: dict[str, list[int]] = defaultdict(list)
    for i, s in enumerate(src):
        by_name[s.name].append(i)
    mem = {}
    tensors = [torch.empty(0)] * len(src)
    # each tensor goes to shared memory as soon as it exists: peak memory stays one tensor
    for k, name in enumerate(shapes):
        g = pattern(k, shapes[name])
        for i in by_name[name]:
            tensors[i] = block(g, src[i]).clone()
            mem |= arena_of(src[i].slot).register({f"t{i}": tensors[i]})
    for j, d in enumerate(dst):
        i = len(src) + j
        dtype = torch.uint8 if d.storage == MXFP8 else torch.bfloat16
        tensors.append(torch.zeros(d.local_shape, dtype=dtype))
        mem |= arena_of(d.slot).register({f"t{i}": tensors[i]})
        if d.storage == MXFP8:
            scales[i] = torch.zeros(mxfp8_scale_shape(d.local_shape), dtype=torch.uint8)
    smem = {}
    for i, t in scales.items():
        smem |= arena_of(dst[i - len(src)].slot).register({f"s{i}": t})
    for i in scales:
        mem[f"t{i}"] = dataclasses.replace(mem[f"t{i}"], scales=smem[f"s{i}"])
    return Shards(tensors, scales, mem)


def mxfp8_context(
    shard: torch.Tensor, model_bytes: int, src_slots: int, ref_seconds: float, seconds: float
) -> dict:
    """What bounds an MXFP8 refit here: the quantizer's speed, measured in this run on one
    source shard with the same code the sender runs (the CPU torch reference), and the
    ratio to quantizing each source slot's bytes then sending them raw (no overlap)."""
    from refitd.formats import mxfp8_quantize

    mxfp8_quantize(shard[:64])
    t0 = time.monotonic()
    mxfp8_quantize(shard)
    q = time.monotonic() - t0
    qgbps = shard.numel() * shard.element_size() / q / 1e9
    quantize_s = model_bytes / src_slots / (qgbps * 1e9)
    return {
        "quantize_bf16_gbps": round(qgbps, 3),
        "quantize_s_per_slot": round(quantize_s, 4),
        "ratio_to_quantize_then_send": round((quantize_s + ref_seconds) / seconds, 3),
        "note": (
            "CPU: the sender quantizes with the torch reference codec (about "
            f"{qgbps:.2f} GB/s of BF16 in this process), so the refit is quantizer-bound and "
            "`ratio` (to a raw send of the same wire bytes) is low; on a GPU the Triton "
            "kernels quantize at device bandwidth (refitd bench gpu)"
        ),
    }


def verify(args, src, dst, shapes, tensors, scales) -> bool:
    n_src = len(src)
    by_name: dict[str, list[int]] = defaultdict(list)
    for j, d in enumerate(dst):
        by_name[d.name].append(j)
    if args.wire == "mxfp8":
        from refitd.formats import mxfp8_quantize
    for k, name in enumerate(shapes):
        g = pattern(k, shapes[name])
        for j in by_name[name]:
            d = dst[j]
            want = block(g, d)
            got = tensors[n_src + j]
            if d.storage == MXFP8:
                values, sc = mxfp8_quantize(want)
                if not (
                    torch.equal(got, values.view(torch.uint8))
                    and torch.equal(scales[n_src + j], sc.view(torch.uint8))
                ):
                    return False
            elif not torch.equal(got, want):
                return False
    return True
