"""Layout constructors: every parallel layout reduced to the boxes of a TensorSpec.

Megatron-style (TP dim with a partition stride, block-interleaved `partition_sizes`,
expert and pipeline coordinates), DTensor-style (a device mesh with Shard/Replicate
placements and torch.chunk's uneven split; explicit uneven chunks) and explicit boxes.
Each constructor returns a Layout (local shape + boxes); `make_spec` turns one into a
TensorSpec after checking it. Errors name the tensor, pool and rank.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from refitd.plan.errors import PlanError
from refitd.plan.layout import Box, TensorSpec
from refitd.plan.wire import PLAIN, STORAGE_FORMATS

# One run along one dim: (global offset, length, local offset).
Run = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class Layout:
    """Where a local tensor sits in its global tensor: its shape and its boxes."""

    local_shape: tuple[int, ...]
    boxes: tuple[Box, ...]


@dataclass(frozen=True, slots=True)
class Shard:
    """DTensor placement: this mesh dim splits tensor dim `dim` (torch.chunk semantics)."""

    dim: int


@dataclass(frozen=True, slots=True)
class Replicate:
    """DTensor placement: every coordinate of this mesh dim holds the same data."""


def _where(label: str) -> str:
    return f" ({label})" if label else ""


def boxes_from_runs(per_dim: Sequence[Sequence[Run]]) -> Layout:
    """The cartesian product of per-dim runs as boxes; the local shape is the sum of each
    dim's run lengths (runs of a dim are laid end to end locally)."""
    local_shape = tuple(sum(r[1] for r in runs) for runs in per_dim)
    boxes = tuple(
        Box(
            offset=tuple(r[0] for r in combo),
            shape=tuple(r[1] for r in combo),
            local_offset=tuple(r[2] for r in combo),
        )
        for combo in itertools.product(*per_dim)
        if all(r[1] > 0 for r in combo)
    )
    return Layout(local_shape, boxes)


def _merge_runs(runs: list[Run]) -> list[Run]:
    """Merge runs contiguous both globally and locally (stride 1 gives one run)."""
    out: list[Run] = []
    for g, n, lo in runs:
        if out and out[-1][0] + out[-1][1] == g and out[-1][2] + out[-1][1] == lo:
            pg, pn, plo = out[-1]
            out[-1] = (pg, pn + n, plo)
        else:
            out.append((g, n, lo))
    return out


def strided_runs(
    size: int, parts: int, index: int, stride: int = 1, base: int = 0, label: str = ""
) -> list[Run]:
    """Megatron partition stride: `size` cut into parts*stride equal chunks; part `index`
    holds chunks index, index+parts, ... concatenated locally."""
    if parts < 1 or not 0 <= index < parts:
        raise PlanError(f"partition index {index} outside 0..{parts - 1}{_where(label)}")
    if stride < 1:
        raise PlanError(f"partition stride {stride} must be >= 1{_where(label)}")
    if size % (parts * stride):
        raise PlanError(
            f"stride does not divide: dim of size {size} cannot be cut into "
            f"{parts} parts x stride {stride}{_where(label)}"
        )
    chunk = size // (parts * stride)
    runs = [(base + (index + j * parts) * chunk, chunk, j * chunk) for j in range(stride)]
    return _merge_runs(runs)


def packed_runs(
    size: int, parts: int, index: int, partition_sizes: Sequence[int], label: str = ""
) -> list[Run]:
    """Megatron `partition_sizes`: each segment split evenly over `parts`; part `index`
    holds its piece of every segment, concatenated locally."""
    if sum(partition_sizes) != size:
        raise PlanError(
            f"partition_sizes {list(partition_sizes)} sum to {sum(partition_sizes)}, "
            f"the dim has {size}{_where(label)}"
        )
    runs: list[Run] = []
    start = local = 0
    for seg in partition_sizes:
        if seg % parts:
            raise PlanError(
                f"stride does not divide: partition size {seg} not divisible by "
                f"{parts} parts{_where(label)}"
            )
        piece = seg // parts
        runs.append((start + index * piece, piece, local))
        start += seg
        local += piece
    return _merge_runs(runs)


def megatron_layout(
    global_shape: Sequence[int],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    partition_dim: int | None = None,
    partition_stride: int = 1,
    partition_sizes: Sequence[int] | None = None,
    expert_dim: int | None = None,
    ep_rank: int = 0,
    ep_size: int = 1,
    label: str = "",
) -> Layout:
    """A Megatron shard: TP (or ETP) along `partition_dim` with a stride or block-packed
    `partition_sizes`; for grouped expert tensors, `expert_dim` is split contiguously over
    EP (rank e holds experts e*E/ep ...). partition_dim None means replicated over TP."""
    shape = tuple(int(s) for s in global_shape)
    per_dim: list[list[Run]] = [[(0, s, 0)] for s in shape]
    if expert_dim is not None:
        _check_dim(expert_dim, shape, "expert_dim", label)
        per_dim[expert_dim] = strided_runs(shape[expert_dim], ep_size, ep_rank, 1, 0, label)
    if partition_dim is not None and tp_size > 1:
        _check_dim(partition_dim, shape, "partition_dim", label)
        if partition_dim == expert_dim:
            raise PlanError(f"partition_dim and expert_dim are both {expert_dim}{_where(label)}")
        n = shape[partition_dim]
        if partition_sizes is not None:
            if partition_stride != 1:
                raise PlanError(f"partition_sizes with partition_stride != 1{_where(label)}")
            runs = packed_runs(n, tp_size, tp_rank, partition_sizes, label)
        else:
            runs = strided_runs(n, tp_size, tp_rank, partition_stride, 0, label)
        per_dim[partition_dim] = runs
    elif not 0 <= tp_rank < max(tp_size, 1):
        raise PlanError(f"tp_rank {tp_rank} outside 0..{tp_size - 1}{_where(label)}")
    return boxes_from_runs(per_dim)


def _check_dim(dim: int, shape: tuple[int, ...], what: str, label: str) -> None:
    if not 0 <= dim < len(shape):
        raise PlanError(f"{what} {dim} out of range for shape {shape}{_where(label)}")


def torch_chunk_bounds(size: int, chunks: int, index: int) -> tuple[int, int]:
    """(offset, length) of chunk `index` when torch.chunk splits `size` into `chunks`:
    chunks of ceil(size/chunks), the last ones shorter or empty."""
    step = -(-size // chunks) if size else 0
    start = min(index * step, size)
    return start, min(step, size - start)


def dtensor_layout(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    mesh_coord: Sequence[int],
    placements: Sequence[Shard | Replicate],
    label: str = "",
) -> Layout:
    """A DTensor shard: mesh dims applied left to right; Shard(d) chunks the current extent
    of tensor dim d like torch.chunk (several mesh dims may shard the same tensor dim)."""
    shape = tuple(int(s) for s in global_shape)
    if not len(mesh_shape) == len(mesh_coord) == len(placements):
        raise PlanError(
            f"mesh shape {tuple(mesh_shape)}, coordinate {tuple(mesh_coord)} and "
            f"{len(placements)} placements disagree{_where(label)}"
        )
    start = [0] * len(shape)
    length = list(shape)
    for size, coord, p in zip(mesh_shape, mesh_coord, placements, strict=True):
        if not 0 <= coord < size:
            raise PlanError(f"mesh coordinate {coord} outside 0..{size - 1}{_where(label)}")
        if isinstance(p, Shard):
            _check_dim(p.dim, shape, "Shard dim", label)
            off, n = torch_chunk_bounds(length[p.dim], size, coord)
            start[p.dim] += off
            length[p.dim] = n
    return boxes_from_runs([[(s, n, 0)] for s, n in zip(start, length, strict=True)])


def chunk_layout(
    global_shape: Sequence[int],
    offsets: Sequence[int],
    sizes: Sequence[int],
    label: str = "",
) -> Layout:
    """An explicit (possibly uneven) chunk: global offsets and sizes of this rank's block,
    as in uneven-DTensor chunk metadata."""
    if not len(global_shape) == len(offsets) == len(sizes):
        raise PlanError(
            f"chunk offsets {tuple(offsets)} / sizes {tuple(sizes)} do not match "
            f"shape {tuple(global_shape)}{_where(label)}"
        )
    return boxes_from_runs([[(o, n, 0)] for o, n in zip(offsets, sizes, strict=True)])


def explicit_layout(
    local_shape: Sequence[int], boxes: Sequence[Box | tuple[Sequence[int], ...]]
) -> Layout:
    """Explicit boxes, as Box or (offset, shape, local_offset) triples. Boxes with a
    length of 0 hold nothing and are dropped: an empty shard has no boxes."""
    out = tuple(
        b if isinstance(b, Box) else Box(tuple(b[0]), tuple(b[1]), tuple(b[2])) for b in boxes
    )
    return Layout(tuple(int(s) for s in local_shape), tuple(b for b in out if all(b.shape)))


def check_layout(global_shape: tuple[int, ...], layout: Layout, label: str = "") -> None:
    """Boxes inside the global and local tensors, no two overlapping on either side."""
    nd = len(global_shape)
    if len(layout.local_shape) != nd:
        raise PlanError(
            f"local shape {layout.local_shape} has a different rank than global shape "
            f"{global_shape}{_where(label)}"
        )
    if not layout.boxes and all(layout.local_shape):
        raise PlanError(
            f"no boxes, but local shape {layout.local_shape} is not empty (only an empty "
            f"shard, a local dim of 0, may hold no part of the tensor){_where(label)}"
        )
    for b in layout.boxes:
        if not len(b.offset) == len(b.shape) == len(b.local_offset) == nd:
            raise PlanError(f"box {b} does not have {nd} dims{_where(label)}")
        for d in range(nd):
            if b.shape[d] < 0 or b.offset[d] < 0 or b.offset[d] + b.shape[d] > global_shape[d]:
                raise PlanError(
                    f"box {b} lies outside the global shape {global_shape}{_where(label)}"
                )
            if b.local_offset[d] < 0 or b.local_offset[d] + b.shape[d] > layout.local_shape[d]:
                raise PlanError(
                    f"box {b} lies outside the local shape {layout.local_shape}{_where(label)}"
                )
    for a, b in itertools.combinations(layout.boxes, 2):
        if _overlap(a.offset, b.offset, a.shape, b.shape):
            raise PlanError(f"overlapping boxes {a} and {b} (global){_where(label)}")
        if _overlap(a.local_offset, b.local_offset, a.shape, b.shape):
            raise PlanError(f"overlapping boxes {a} and {b} (local){_where(label)}")


def _overlap(
    o1: tuple[int, ...], o2: tuple[int, ...], s1: tuple[int, ...], s2: tuple[int, ...]
) -> bool:
    return all(max(a, b) < min(a + n, b + m) for a, b, n, m in zip(o1, o2, s1, s2, strict=True))


def make_spec(
    *,
    model: str,
    pool: str,
    rank: int,
    slot: int,
    name: str,
    global_shape: Sequence[int],
    dtype: str,
    layout: Layout,
    canonical: str | None = None,
    storage: str = PLAIN,
    meta: tuple[tuple[str, str], ...] = (),
    check: bool = True,
) -> TensorSpec:
    """A TensorSpec from a layout, validated (check=False skips it for trusted bulk
    builders such as the benchmark presets)."""
    shape = tuple(int(s) for s in global_shape)
    label = f"tensor {name!r}, pool {pool!r}, rank {rank}"
    if check:
        if storage not in STORAGE_FORMATS:
            raise PlanError(f"unknown storage {storage!r}; known {STORAGE_FORMATS} ({label})")
        check_layout(shape, layout, label)
    return TensorSpec(
        model=model,
        pool=pool,
        rank=rank,
        slot=slot,
        name=name,
        canonical=canonical if canonical is not None else name,
        global_shape=shape,
        dtype=dtype,
        local_shape=layout.local_shape,
        boxes=layout.boxes,
        storage=storage,
        meta=meta,
    )
