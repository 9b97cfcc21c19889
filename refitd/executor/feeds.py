"""Which receive chunks feed a relay chunk: the receives (in posting order) that write part
of what one send chunk forwards, down to the piece of a copy the chunk carries.

A piece of a raw segment is a row-major range of its block's elements, so the tensor
elements it covers lie between the flat indices of its first and last element; a receive
piece and a relay piece can share bytes only where their blocks overlap and these flat
spans do. A piece whose bytes are not its block's elements in order (a coded wire), or
one that lands only once its segment is whole (raw bytes into quantized storage), counts
as its whole block. Every test errs towards waiting longer, never shorter.
"""

from __future__ import annotations

import numpy as np

from refitd.executor.chunks import Chunk
from refitd.plan.program import SlotProgram
from refitd.plan.rowwise import row_prod
from refitd.plan.wire import PLAIN, RAW_CODE

_ALL = (0, 1 << 62)  # a span covering any tensor


class RelayFeeds:
    """Built once per prepared program over its receive chunks in posting order; `feeding`
    answers per relay row of a send chunk."""

    def __init__(self, program: SlotProgram, payload: np.ndarray, order: list[Chunk]) -> None:
        c = program.copies
        self._src_t, self._dst_t = c.src.tolist(), c.dst.tolist()
        self._nd = c.ndim.tolist()
        self._src_off, self._dst_off = c.src_off.tolist(), c.dst_off.tolist()
        self._shape = c.shape.tolist()
        self._raw = (c.wire == RAW_CODE).tolist()
        self._count = row_prod(c.shape).tolist()
        self._payload = payload.tolist()
        self._dims: dict[int, list[int] | None] = {}  # a plain tensor's shape, else None
        self._tensors = program.tensors
        self.receives = len(order)
        rows: dict[int, list[tuple[int, int, int, int]]] = {}  # tensor -> (k, row, lo, hi)
        for k, ch in enumerate(order):
            for i in ch.rows:
                dst = self._dst_t[i]
                lo, hi = self._span(ch, i, dst, self._dst_off[i])
                rows.setdefault(dst, []).append((k, i, lo, hi))
        self._writes = {d: np.array(w, np.int64).reshape(-1, 4) for d, w in rows.items()}

    def feeding(self, ch: Chunk, i: int) -> set[int] | None:
        """The receive chunks (positions in posting order) writing part of what send chunk
        `ch` forwards of relay copy row i; None when none does (then it waits for all)."""
        src = self._src_t[i]
        w = self._writes.get(src)
        if w is None:
            return None
        lo, hi = self._span(ch, i, src, self._src_off[i])
        cand = w[(w[:, 2] < hi) & (lo < w[:, 3])]
        hits = {int(k) for k, j, _, _ in cand.tolist() if self._boxes_meet(i, j)}
        return hits or None

    def _boxes_meet(self, i: int, j: int) -> bool:
        """Row i's source block and row j's destination block share an element."""
        n = self._nd[i]
        a, b, sa, sb = self._src_off[i], self._dst_off[j], self._shape[i], self._shape[j]
        return all(a[d] < b[d] + sb[d] and b[d] < a[d] + sa[d] for d in range(n))

    def _span(self, ch: Chunk, i: int, tensor: int, off: list[int]) -> tuple[int, int]:
        """[lo, hi) flat indices in `tensor` holding every element of row i's block that
        chunk `ch` carries: a piece's own elements where the tensor is plain and the wire
        raw, else the whole block (a tensor in another storage: all of it)."""
        if tensor not in self._dims:
            spec = self._tensors[tensor]
            self._dims[tensor] = list(spec.local_shape) if spec.storage == PLAIN else None
        dims = self._dims[tensor]
        if dims is None:
            return _ALL
        count = self._count[i]
        e0, e1 = 0, count
        if self._raw[i] and ch.split and count:
            size = self._payload[i] // count  # bytes per element on the wire
            e0 = min(count, ch.seg_start // size)
            e1 = min(count, -(-(ch.seg_start + ch.nbytes) // size))
        if e1 <= e0:
            return 0, 0
        nd = self._nd[i]
        shape = self._shape[i][:nd]
        return _flat(off, shape, dims, e0), _flat(off, shape, dims, e1 - 1) + 1


def _flat(off: list[int], shape: list[int], dims: list[int], e: int) -> int:
    """The flat (row-major) index in a tensor of `dims` of element e (row-major) of the
    block of `shape` at `off`."""
    flat, stride = 0, 1
    for d in range(len(shape) - 1, -1, -1):
        e, r = divmod(e, shape[d])
        flat += (off[d] + r) * stride
        stride *= dims[d]
    return flat
