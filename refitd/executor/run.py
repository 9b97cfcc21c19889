"""Runs one slot's program for one refit: local copies, then every message, pipelined.

The program is read as columns (program.py); chunks.py cuts its messages into chunks (each
one send matched by one receive, computed identically on both ends from the program),
slotdata.py prepares, once, every view a refit needs, preparation.py the posting order,
staging ring slots and relay waits, and execution.py runs one refit (`RefitExecution`). Chunks are posted in (round, chunk
index, message id) order on every slot, so every pair of slots sees its common chunks in the
same order and the smallest unfinished chunk can always progress.

A chunk whose bytes are one contiguous run of memory on this end (a large contiguous copy,
or copies of adjacent regions) is sent or received in place (zero-copy); other chunks are
packed and unpacked through staging buffers (a ring of bounded total size), each with one
`torch._foreach_copy_` over prepared views. While chunk k is on the wire, k+1 is being
packed (poster thread) and k-1 unpacked (receiver thread). Local copies run as one
`_foreach_copy_` too (quantized destinations one by one).

Relays (program.py): a copy whose source is a destination tensor of this slot forwards
what an earlier round delivered. Before packing (or zero-copy sending) a chunk of a message
with relay copies, the poster waits until the receiver has completed (waited and unpacked)
the receives, in posting order, up to the last one writing what the message forwards (never
more than every receive of a smaller round); ordinary chunks never wait. Local relay copies run after
every receive completed. Sources are released once every chunk and local copy reading a
source tensor is done: relays don't hold the trainer.

Verification (run(verify=True), see checksums.py): the sender checksums each copy's source
block before the sources are released, the receiver reads each copy's destination block back
once it landed; both combine a message's copies in order into one checksum per message id,
returned in ExecReport.checksums for the controller to compare. A copy that the receiver
decodes (quantized wire or storage) is checked on its wire segment instead (sender after
encode, receiver before decode; a raw segment quantized on landing on a GPU is checksummed
by the quantizing kernel as it reads it, with no second read). Local copies are compared here (ExecutionError on a
mismatch); those into quantized storage are not checked.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from refitd.executor.chunks import DIRECT_MIN, WIRE_CHUNK, CopyInfo
from refitd.executor.errors import ExecutionError
from refitd.executor.execution import RefitExecution
from refitd.executor.onesided import OneSided, OneSidedLinks
from refitd.executor.prepare import (
    PreparedProgram,
    TensorResolver,
    resolve_tensors,
    touched_indices,
)
from refitd.executor.segments import ResolvedTensor
from refitd.executor.shares import Share
from refitd.executor.views import SlotViews
from refitd.memory.errors import StorageMovedError
from refitd.plan.program import SlotProgram
from refitd.slot_protocol import DEFAULTS, ExecReport
from refitd.transport.base import Transport


class DirectResolver:
    """Resolver over tensors of this process (tests, embedded use); detects moved storage
    by comparing data pointers with those seen at construction."""

    def __init__(self, tensors: dict[int, ResolvedTensor]) -> None:
        self.tensors = tensors
        self._ptrs = {i: t.data.data_ptr() for i, t in tensors.items()}

    def resolve(self, index: int) -> ResolvedTensor:
        try:
            return self.tensors[index]
        except KeyError:
            raise ExecutionError(f"no tensor registered for plan tensor {index}") from None

    def check(self, indices: Iterable[int]) -> None:
        moved = [
            self.tensors[i].name
            for i in indices
            if i in self.tensors and self.tensors[i].data.data_ptr() != self._ptrs[i]
        ]
        if moved:
            raise StorageMovedError(
                f"registered storage moved for {moved}: register these tensors again"
            )


@dataclass(frozen=True)
class ExecutorConfig:
    staging_bytes: int = DEFAULTS.staging_bytes
    wire_chunk: int = WIRE_CHUNK
    staged_chunk: int | None = None  # chunk of segments that go through staging
    direct_min: int = DIRECT_MIN  # a contiguous raw copy this large gets its own chunks


class Executor:
    """A prepared slot program: regions resolved and chunks cut once, run every refit."""

    def __init__(
        self,
        program: SlotProgram,
        resolver: TensorResolver,
        transport: Transport | None,
        slot_ranks: dict[int, int] | None = None,
        config: ExecutorConfig | None = None,
        device: torch.device | None = None,
        links: OneSidedLinks | None = None,
    ) -> None:
        """`links`: the one-sided paths of the program's messages on them (onesided.py)."""
        self.program = program
        self.resolver = resolver
        self.transport = transport
        self.slot_ranks = slot_ranks
        self.config = config or ExecutorConfig()
        self.info = CopyInfo.of(program, self.config.direct_min)
        self._index_list = touched_indices(program)
        self._checked = frozenset(self._index_list)  # one object: the resolver's check key
        tensors = resolve_tensors(program, resolver, self._index_list)
        first = next(iter(tensors.values()), None)
        self.device = device or (first.data.device if first else torch.device("cpu"))
        self.one_sided = OneSided(program, links)
        tensors.update(self.one_sided.remote_tensors())  # destinations the sends write
        self.data = SlotViews(program, self.info, tensors)
        self.one_sided.bind(self.data)
        self.prepared = PreparedProgram(
            program,
            self.info,
            self.data,
            self.device,
            self.config.staging_bytes,
            self.config.wire_chunk,
            self.config.staged_chunk,
            self.one_sided.mids,
            self.one_sided.joined(),
        )

    def _peer(self, slot: int) -> int:
        return slot if self.slot_ranks is None else self.slot_ranks[slot]

    def run(
        self,
        timeout_s: float,
        on_sources_released: Callable[[], None] | None = None,
        abort: threading.Event | None = None,
        verify: bool = False,
        skip: frozenset[int] = frozenset(),
        attempt: int = 0,
        share: Share | None = None,
    ) -> ExecReport:
        """One refit of this slot; raises ExecutionError (or StorageMovedError) on failure.
        With verify, fills report.checksums and checks local copies (module docstring).
        `skip`: message ids moved elsewhere this refit (delta refits), on both ends.
        `attempt`: the refit attempt's id, which one-sided doorbells carry (unique per
        attempt: a doorbell rung by another attempt never completes a wait). `share`: the
        lane and weight of this refit when refits of several models run at once."""
        t0 = time.monotonic()
        p = self.program
        relayed = (
            [
                int(p.send.id[k])
                for k in range(len(p.send))
                if int(p.send.id[k]) in skip
                and self.info.relay[int(p.send.start[k]) : int(p.send.end[k])].any()
            ]
            if skip
            else []
        )
        if relayed:  # a relay forwards what this refit delivered: it cannot go first
            raise ExecutionError(f"slot {p.slot}: relay messages {relayed[:4]} cannot be skipped")
        if skip & self.one_sided.mids:
            bad = sorted(skip & self.one_sided.mids)[:4]
            raise ExecutionError(f"slot {p.slot}: one-sided messages {bad} cannot be skipped")
        self.resolver.check(self._checked)
        self.one_sided.check(attempt)
        check_s = time.monotonic() - t0
        self.prepared.pool.reset()
        if self.prepared.has_messages and self.transport is None:
            raise ExecutionError(f"slot {p.slot}: program has messages but no transport")
        execution = RefitExecution(
            self.prepared,
            self.transport,
            self._peer,
            t0,
            timeout_s,
            on_sources_released,
            abort or threading.Event(),
            verify,
            skip,
            self.one_sided,
            attempt,
            share,
        )
        execution.report.phases["check_s"] = check_s
        try:
            return execution.run()
        finally:
            execution.share.leave()
