"""Input checks of the planner: casts, covers without holes or overlaps, whole blocks,
whole tensors where a format's scale spans the tensor."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from refitd.plan.config import PlanConfig
from refitd.plan.copies import CopyTable
from refitd.plan.errors import PlanError
from refitd.plan.layout import TensorSpec
from refitd.plan.sides import Side
from refitd.plan.wire import CAST_DTYPES, PLAIN, WireRegistry

CAST_SETTING = (
    "set allow_dtype_cast (refitd serve --allow-dtype-cast, env REFITD_ALLOW_DTYPE_CAST, "
    "config file key allow_dtype_cast; PlanConfig.allow_dtype_cast when planning directly)"
)


def check_cast(cfg: PlanConfig, src_dtype: str, dst_dtype: str, dst: str, src: str) -> None:
    """A destination of another dtype than its source: allowed only between float dtypes
    (the executor casts those on landing), and only when the configuration turns casts on."""
    what = f"dtype mismatch: {dst} is {dst_dtype}, source {src} is {src_dtype}"
    if src_dtype not in CAST_DTYPES or dst_dtype not in CAST_DTYPES:
        raise PlanError(f"{what}; casts exist only between {', '.join(CAST_DTYPES)}")
    if not cfg.allow_dtype_cast:
        raise PlanError(f"{what}, and dtype casts are off: to land it cast, {CAST_SETTING}")


def check_cover(side: Side, members: np.ndarray, geo_ids: list[int], what: str) -> None:
    """The distinct covers of these geometries tile the global tensor exactly."""
    gshape = side.geos[geo_ids[0]].global_shape
    cover_of = {g: side.geos[g].cover for g in set(geo_ids)}  # a few geometries
    covers: dict[tuple, int] = {}
    for k, g in enumerate(geo_ids):
        covers.setdefault(cover_of[g], k)
    boxes = [(k, o, s) for c, k in covers.items() for o, s in c]
    total = int(np.prod(gshape)) if gshape else 1
    vol = sum(int(np.prod(s)) if s else 1 for _, _, s in boxes)
    if len(boxes) > 1 and gshape:
        lo = np.array([o for _, o, _ in boxes])
        hi = lo + np.array([s for _, _, s in boxes])
        a = np.maximum(lo[:, None], lo[None]) < np.minimum(hi[:, None], hi[None])
        hit = a.all(axis=2)
        np.fill_diagonal(hit, False)
        if hit.any():
            i, j = np.argwhere(hit)[0]
            ki, kj = boxes[i][0], boxes[j][0]
            raise PlanError(
                f"overlapping boxes in the {what}: {side.who(int(members[ki]))} holds "
                f"{boxes[i][1:]} and {side.who(int(members[kj]))} holds {boxes[j][1:]} "
                f"of global shape {gshape}"
            )
    if vol != total:
        missing = _first_missing(gshape, [(o, s) for _, o, s in boxes])
        raise PlanError(
            f"holes in the {what}: {side.who(int(members[0]))} and the other shards of "
            f"global shape {gshape} cover {vol} of {total} elements"
            + (
                f"; no shard holds the block at offset {missing[0]} of shape {missing[1]}"
                if missing is not None
                else ""
            )
        )


def _first_missing(
    gshape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """A block of the global tensor that no box covers (the first cell of the grid the box
    edges cut), for a hole's error message; None if the grid is too large to enumerate."""
    if not gshape:
        return ((), ()) if not boxes else None
    edges = [
        np.unique(np.array([0, n] + [o[d] for o, _ in boxes] + [o[d] + s[d] for o, s in boxes]))
        for d, n in enumerate(gshape)
    ]
    grid = tuple(e.size - 1 for e in edges)
    if int(np.prod(grid)) > 1 << 22:
        return None
    covered = np.zeros(grid, dtype=bool)
    for o, s in boxes:
        covered[
            tuple(
                slice(int(np.searchsorted(e, a)), int(np.searchsorted(e, a + n)))
                for e, a, n in zip(edges, o, s, strict=True)
            )
        ] = True
    holes = np.argwhere(~covered)
    if not holes.size:
        return None
    cell = holes[0].tolist()
    return (
        tuple(int(e[i]) for e, i in zip(edges, cell, strict=True)),
        tuple(int(e[i + 1] - e[i]) for e, i in zip(edges, cell, strict=True)),
    )


def check_blocks(t: CopyTable, tensors: Sequence[TensorSpec], wires: WireRegistry) -> None:
    """With a blocked (quantized) wire every copy carries whole blocks of its destination
    (of a stamped table, CopyTable.period, the first pool's copies: every pool's are theirs)."""
    blocked = np.array([bool(f.block) for f in wires.formats])
    q = np.flatnonzero(blocked[t.wire]) if t.wire.size else t.wire
    for i in q.tolist():  # few distinct tensors in practice; clarity over speed here
        nd = int(t.ndim[i])
        spec = tensors[int(t.dst[i])]
        fmt = wires.formats[int(t.wire[i])]
        for dd in range(max(nd - len(fmt.block), 0), nd):
            b = fmt.block_of_dim(dd, nd)
            off, n, full = int(t.dst_loc[i, dd]), int(t.shape[i, dd]), spec.local_shape[dd]
            if off % b or (n % b and off + n != full):
                raise PlanError(
                    f"quantized block not whole: copy into tensor {spec.name!r}, pool "
                    f"{spec.pool!r}, rank {spec.rank} covers [{off}, {off + n}) of dim {dd} "
                    f"(local size {full}), not whole {fmt.name} blocks of "
                    f"{b}; the source layout splits a block"
                )


def check_whole_tensors(t: CopyTable, dst: Side, wires: WireRegistry) -> None:
    """A destination whose storage keeps a format with a tensor scale (NVFP4's FP32 global
    scale, computed from the amax of the whole tensor) is landed by exactly one copy of
    its whole local tensor, with an even last dim when values are packed two per byte: a
    tensor fed by several source blocks has no place where its whole amax is known before
    its first block is quantized, so it cannot be quantized bit-exactly."""
    storages = {
        f.storage: f
        for f in wires.formats
        if f.tensor_scale_bytes and f.storage not in (None, PLAIN)
    }
    whole_geo = np.array([g.storage in storages for g in dst.geos], dtype=bool)
    if not whole_geo.any():
        return
    specs = np.flatnonzero(whole_geo[dst.geo])
    copies = np.flatnonzero(whole_geo[dst.geo[t.dst - dst.base]]) if t.dst.size else t.dst
    count = np.bincount(t.dst[copies] - dst.base, minlength=len(dst.specs))
    landed = dict(zip((t.dst[copies] - dst.base).tolist(), copies.tolist(), strict=True))
    for k in specs.tolist():
        spec = dst.specs[k]
        fmt = storages[spec.storage]
        why = ""
        if not spec.local_shape:
            why = "it has no dims (values are packed along the last dim)"
        elif fmt.values_per_byte > 1 and spec.local_shape[-1] % fmt.values_per_byte:
            why = f"its last dim {spec.local_shape[-1]} is odd (values are packed two per byte)"
        elif count[k] > 1:
            why = f"{int(count[k])} copies feed it (source shards or its own boxes split it)"
        elif count[k] == 1 and math.prod(spec.local_shape):
            c = landed[k]
            shape = tuple(t.shape[c, : t.ndim[c]].tolist())
            if shape != tuple(spec.local_shape):
                why = f"its one copy lands {shape}, not all of it (its boxes leave part of it unwritten)"
        if why:
            raise PlanError(
                f"{fmt.name} storage needs the whole tensor in one copy: {dst.who(k)} "
                f"(local shape {spec.local_shape}): {why}. Its FP32 global scale is computed "
                "from the amax of the whole tensor, so the tensor must reach one place whole "
                "before it is quantized; register the source so one rank holds this shard "
                "whole, or keep this destination in mxfp8, fp8_block or plain storage"
            )
