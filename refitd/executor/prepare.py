"""Program preparation: what an executor computes once per (program, mapped tensors) and
replays every refit.

`resolve_tensors` checks each tensor the slot touches against its registered shape and
dtype. `PreparedProgram` cuts the messages into chunks (chunks.py), groups them into posting
steps in (round, chunk index, message id) order, decides per chunk zero-copy or staged (and
which staging ring buffer a staged one uses), works out relay waits (which receive chunks
a relay send chunk must see complete, feeds.py), and builds the local-copy steps.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterable
from typing import Protocol

import numpy as np
import torch

from refitd.executor.chunks import Chunk, CopyInfo, chunk_messages, join_pieces
from refitd.executor.errors import ExecutionError
from refitd.executor.feeds import RelayFeeds
from refitd.executor.segments import ResolvedTensor
from refitd.executor.staging import StagingRing
from refitd.executor.views import LocalStep, SlotViews
from refitd.plan.program import SlotProgram
from refitd.plan.wire import PLAIN, storage_data_shape
from refitd.torch_dtypes import torch_dtype

GROUPED_ENV = "REFITD_GROUPED_LANDING"  # "0": land local copies one call each (comparisons)


class TensorResolver(Protocol):
    """Plan tensor index -> the registered tensor on this slot."""

    def resolve(self, index: int) -> ResolvedTensor: ...

    def check(self, indices: Iterable[int]) -> None:
        """Raise StorageMovedError naming every tensor whose registered storage moved."""
        ...


def touched_indices(p: SlotProgram) -> list[int]:
    """Tensors this slot touches: sources it sends, destinations it receives, both ends of
    its local copies."""
    c = p.copies
    recv_lo = int(p.recv.start[0]) if len(p.recv) else p.local_start
    send_hi = int(p.send.end[-1]) if len(p.send) else 0
    idx = np.unique(
        np.concatenate(
            [
                c.src[:send_hi],
                c.dst[recv_lo : p.local_start],
                c.src[p.local_start :],
                c.dst[p.local_start :],
            ]
        )
    )
    return idx.tolist()


def resolve_tensors(
    p: SlotProgram, resolver: TensorResolver, indices: list[int]
) -> dict[int, ResolvedTensor]:
    """Each touched tensor, checked against its registered local shape (and dtype when
    stored plainly)."""
    out: dict[int, ResolvedTensor] = {}
    for i in indices:
        spec = p.tensors[i]  # decode checked every copy's tensors are in the table
        t = resolver.resolve(i)
        want = storage_data_shape(spec.storage, tuple(spec.local_shape))
        if tuple(t.data.shape) != want:
            raise ExecutionError(
                f"tensor {t.name!r} (pool {spec.pool}, rank {spec.rank}): mapped shape "
                f"{tuple(t.data.shape)} != {want}, the data of registered local shape "
                f"{tuple(spec.local_shape)} in {spec.storage} storage"
            )
        if spec.storage == PLAIN and t.data.dtype != torch_dtype(spec.dtype):
            raise ExecutionError(
                f"tensor {t.name!r} (pool {spec.pool}, rank {spec.rank}): mapped dtype "
                f"{t.data.dtype} != registered {spec.dtype}"
            )
        out[i] = t
    return out


class PreparedProgram:
    """A slot program's chunks, posting steps, zero-copy views, ring slots, relay waits and
    local steps: everything a refit replays. Chunks are keyed by id() in the maps below
    (they live as long as this object)."""

    def __init__(
        self,
        program: SlotProgram,
        info: CopyInfo,
        data: SlotViews,
        device: torch.device,
        staging_bytes: int,
        wire_chunk: int,
        staged_chunk: int | None,
        one_sided: frozenset[int] = frozenset(),
        joined: frozenset[int] = frozenset(),
    ) -> None:
        """`one_sided`: ids of messages on one-sided paths (onesided.py): their chunks are
        written by the sender and waited for on a doorbell, never staged here. `joined`:
        sent messages among them whose pieces are written joined (chunks.join_pieces)."""
        self.program = program
        self.info = info
        self.data = data
        self.device = device
        p = program
        try:
            sent = chunk_messages(p.send, info, wire_chunk, staged_chunk)
            self.send_chunks = join_pieces(sent, joined, info.payload)
            self.recv_chunks = chunk_messages(p.recv, info, wire_chunk, staged_chunk)
        except ExecutionError as e:
            raise ExecutionError(f"slot {p.slot}: {e}") from e
        self.steps = self._group_steps()
        self.one_sided = frozenset(
            id(c) for c in self.send_chunks + self.recv_chunks if c.mid in one_sided
        )
        two = self.one_sided
        self.zc_send = {
            id(c): None if id(c) in two else self._zero_copy_send(c) for c in self.send_chunks
        }
        self.zc_recv = {
            id(c): None if id(c) in two else data.zero_copy_recv(c) for c in self.recv_chunks
        }
        self.pool, self.ring = self._staging(staging_bytes)
        # receive chunks in posting order, and each one's position in it
        self.recv_order = sorted(self.recv_chunks, key=lambda c: c.key)
        self.recv_pos = {id(c): k for k, c in enumerate(self.recv_order)}
        self.relay_wait = self._relay_waits()
        relay = info.relay.tolist()
        # send chunk -> whether it reads a source tensor (not only relayed destinations)
        self.reads_source = {id(c): any(not relay[i] for i in c.rows) for c in self.send_chunks}
        self.source_chunks = sum(self.reads_source.values())
        local = range(p.local_start, len(p.copies))
        self.local_direct = self._local_plan([i for i in local if not relay[i]])
        self.local_relay = self._local_plan([i for i in local if relay[i]])
        self._events: dict[int, tuple[torch.cuda.Event, torch.cuda.Event]] = {}

    @property
    def has_messages(self) -> bool:
        return bool(self.send_chunks or self.recv_chunks)

    def timing_events(self, step: LocalStep) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """The pair of CUDA timing events of a local step, made on its first refit and
        recorded again by every later one (each refit waits for them before the next)."""
        key = id(step)
        pair = self._events.get(key)
        if pair is None:
            pair = self._events[key] = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
        return pair

    def _group_steps(self) -> list[tuple[list[Chunk], list[Chunk]]]:
        """(sends, receives) per chunk key, in key order: the order every slot posts in."""
        steps: dict[tuple[int, int, int], tuple[list[Chunk], list[Chunk]]] = {}
        for c in self.send_chunks:
            steps.setdefault(c.key, ([], []))[0].append(c)
        for c in self.recv_chunks:
            steps.setdefault(c.key, ([], []))[1].append(c)
        return [steps[k] for k in sorted(steps)]

    def _zero_copy_send(self, ch: Chunk) -> torch.Tensor | None:
        """The chunk's source bytes as one view to send in place, or None (staged). A host
        snapshot of GPU sources lives off the executor's device: it is staged to it."""
        view = self.data.zero_copy_send(ch)
        return None if view is None or view.device != self.device else view

    def _staging(self, staging_bytes: int) -> tuple[StagingRing, dict[int, int]]:
        """The staging ring, sized for the largest staged chunk, and each staged chunk's
        ring slot (the k-th staged chunk of a side, in posting order, uses slot k mod n)."""
        staged_send = [c.nbytes for c in self.send_chunks if self._staged(c, self.zc_send)]
        staged_recv = [c.nbytes for c in self.recv_chunks if self._staged(c, self.zc_recv)]
        buf_bytes = -(-max(staged_send + staged_recv, default=16) // 16) * 16
        pool = StagingRing(
            staging_bytes, buf_bytes, self.device, max(len(staged_send), len(staged_recv))
        )
        ring: dict[int, int] = {}
        n_send = n_recv = 0
        for sends, recvs in self.steps:
            for ch in recvs:
                if self._staged(ch, self.zc_recv):
                    ring[id(ch)] = pool.slot_of(n_recv)
                    n_recv += 1
            for ch in sends:
                if self._staged(ch, self.zc_send):
                    ring[id(ch)] = pool.slot_of(n_send)
                    n_send += 1
        return pool, ring

    def _staged(self, ch: Chunk, zero_copy: dict[int, torch.Tensor | None]) -> bool:
        """Whether a chunk goes through a staging buffer (neither zero-copy nor one-sided)."""
        return zero_copy[id(ch)] is None and id(ch) not in self.one_sided

    def _relay_waits(self) -> dict[int, np.ndarray]:
        """Send chunk forwarding relay copies -> the receive chunks (positions in posting
        order) to complete first: those writing part of what the chunk itself forwards
        (feeds.py), so a relay forwards each piece once it landed, whatever landed before or
        after it. Only receives of a smaller round count (they hold everything it may
        forward); a row whose feeds name none of them waits for all of them."""
        relay = self.info.relay.tolist()
        recv_rounds = [c.round for c in self.recv_order]
        feeds = RelayFeeds(self.program, self.info.payload, self.recv_order)
        waits: dict[int, np.ndarray] = {}
        for ch in self.send_chunks:
            rows = [i for i in ch.rows if relay[i]]
            if rows:
                n = bisect.bisect_left(recv_rounds, ch.round)
                need: set[int] = set()
                for i in rows:
                    fed = {k for k in feeds.feeding(ch, i) or () if k < n}
                    if not fed:  # this row waits for all of them: so does the chunk
                        need = set(range(n))
                        break
                    need |= fed
                waits[id(ch)] = np.array(sorted(need), np.int64)
        return waits

    def _local_plan(self, rows: list[int]) -> LocalStep:
        """The local copies as a ready-to-run step (SlotViews.local_plan); on CUDA with
        triton the grouped kernels take every copy they can (REFITD_GROUPED_LANDING=0: off)."""
        grouped = None
        if rows and self.device.type == "cuda" and os.environ.get(GROUPED_ENV, "1") != "0":
            from refitd.formats import grouped as grouped_mod

            if grouped_mod.available(self.device):
                grouped = grouped_mod.GroupedLanding(self.device)
        return self.data.local_plan(rows, grouped)
