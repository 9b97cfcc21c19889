"""Relay waits per chunk: a relay send chunk waits for the receive chunks that write what
it forwards (never fewer), not for everything its message forwards."""

from __future__ import annotations

import torch
from _transport_layouts import megatron_side

from refitd.executor.chunks import flat_range_views
from refitd.executor.run import DirectResolver, Executor, ExecutorConfig
from refitd.executor.segments import ResolvedTensor
from refitd.plan.planner import PlanConfig, build_plan

# (name, global shape, TP dim): dim 0 splits are contiguous row ranges, dim 1 strided
MODEL = [("w", (96, 40), 0), ("r", (30, 64), 1), ("b", (72,), 0)]


def _piece(block: torch.Tensor, ch, esize: int) -> list[torch.Tensor]:
    """The elements of a copy's block that chunk `ch` carries (raw bf16 segments)."""
    if not ch.split:
        return [block]
    return flat_range_views(block, ch.seg_start // esize, (ch.seg_start + ch.nbytes) // esize)


def _block(t: torch.Tensor, off: list[int], shape: list[int]) -> torch.Tensor:
    return t[tuple(slice(o, o + n) for o, n in zip(off, shape, strict=True))]


def test_relay_chunks_wait_for_what_they_forward_only() -> None:
    src = megatron_side("train", 1, 1, MODEL, [0])
    dst = [
        *megatron_side("a", 2, 1, MODEL, [1, 2]),
        *megatron_side("b", 2, 2, MODEL, [2, 1, 1, 2]),
    ]
    plan = build_plan("m", 1, src, dst, PlanConfig(bucket_bytes=1024, relay=True))
    specs = [*src, *dst]
    # relay chunks; relay messages whose chunks wait differently; relay chunks that skip
    # an earlier receive not feeding them
    checked = early = gaps = 0
    for slot in plan.slots():
        p = plan.program(slot)
        tensors = {
            i: ResolvedTensor(str(i), torch.zeros(specs[i].local_shape, dtype=torch.bfloat16))
            for i in p.tensors
        }
        ex = Executor(p, DirectResolver(tensors), None, config=ExecutorConfig(wire_chunk=256))
        prep, c = ex.prepared, p.copies
        # per element: the last receive chunk (in posting order) that writes it, -1: none
        label = {i: torch.full(t.data.shape, -1, dtype=torch.int64) for i, t in tensors.items()}
        order = sorted(prep.recv_chunks, key=lambda ch: ch.key)
        for k, ch in enumerate(order):
            for i in ch.rows:
                nd = int(c.ndim[i])
                block = _block(label[int(c.dst[i])], c.dst_off[i, :nd], c.shape[i, :nd])
                for v in _piece(block, ch, 2):
                    v.fill_(k)
        by_message: dict[int, list[set[int]]] = {}
        for ch in prep.send_chunks:
            wait = prep.relay_wait.get(id(ch))
            if wait is None:
                continue
            feeds: set[int] = set()  # the receive chunks writing what the chunk forwards
            for i in ch.rows:
                if int(c.src[i]) in label and bool(ex.info.relay[i]):
                    nd = int(c.ndim[i])
                    block = _block(label[int(c.src[i])], c.src_off[i, :nd], c.shape[i, :nd])
                    for v in _piece(block, ch, 2):
                        feeds |= set(v.unique().tolist()) - {-1}
            earlier = sum(r.round < ch.round for r in order)  # hold all it may forward
            want = {k for k in feeds if k < earlier}
            assert want <= set(wait.tolist()), (slot, ch.mid, ch.index, wait, want)
            by_message.setdefault(ch.mid, []).append(set(wait.tolist()))
            gaps += len(wait) > 0 and len(wait) < int(wait.max()) + 1
            checked += 1
        early += sum(any(w < set().union(*ws) for w in ws) for ws in by_message.values())
    assert checked and early, "no relay chunk goes before the last feed of its message"
    assert gaps, "every relay chunk waits for a prefix of the receives, fed or not"
