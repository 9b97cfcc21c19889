"""Messages on one-sided paths (refitd.transport.paths): the sender writes every chunk
straight into the destination's memory and rings the destination's doorbell; the receiver
waits on its doorbell, then reads back what landed (checksums) and goes on as if it had
received the chunk (relays, local relay copies, DONE).

`OneSidedLinks` is what the executor's owner hands over: per destination slot of a
one-sided send its `Peer` and `Descriptor` (doorbell entries, generation), and this slot's
own doorbell with the entry of every one-sided message it receives. `OneSided` prepares,
once per executor, the destination tensors the sends write (checked against the program:
an error names the peer slot and the message) and runs the per-chunk work. Both ends cut
messages into the same chunks (chunks.py), so a chunk count on the doorbell means the same
bytes to both.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from refitd.executor.chunks import Chunk
from refitd.executor.errors import ExecutionError
from refitd.executor.segments import ResolvedTensor
from refitd.executor.views import SlotViews
from refitd.plan.links import ONE_SIDED, PATHS
from refitd.plan.program import DTYPES, SlotProgram
from refitd.plan.wire import NVFP4, PLAIN
from refitd.torch_dtypes import torch_dtype
from refitd.transport.base import Work
from refitd.transport.doorbell import RETIRED, Doorbell
from refitd.transport.errors import TransportError
from refitd.transport.paths import Descriptor, Peer

_Sums = dict[tuple[int, int], torch.Tensor]
# one-sided bytes posted to one destination and not yet landed (one chunk at least). Across
# hosts, a few chunks: the engine sends everything posted at once, so a chunk posted far
# ahead shares the link with all the others and lands late, which holds up the destination's
# relays. On one host nothing queues on a link, and more in flight keeps the engine's
# threads busy while the sender's waiter, on a loaded host, is slow to see a landing.
WINDOW = 4 << 20
WINDOW_ONE_HOST = 16 << 20


class _Refit(Protocol):
    """What a write needs of the running refit."""

    attempt: int
    deadline: float  # monotonic
    abort: threading.Event
    prep: Any  # its device
    ringer: Ringer  # confirms the chunks that landed


class _Window:
    """Per destination, the one-sided bytes of one refit posted and not yet landed."""

    def __init__(self) -> None:
        self._held: dict[int, int] = {}
        self._cond = threading.Condition()

    def _full(self, dst: int, nbytes: int, limit: int) -> bool:
        held = self._held.get(dst, 0)
        return held > 0 and held + nbytes > limit

    def take(self, ch: Chunk, refit: _Refit, flush: Callable[[], None], limit: int) -> None:
        """Wait until the chunk fits (after `flush`: the writes the caller holds back must
        reach the send-waiter, whose landings make room), then count it in."""
        with self._cond:
            full = self._full(ch.dst_slot, ch.nbytes, limit)
        if full:
            flush()
        with self._cond:
            while self._full(ch.dst_slot, ch.nbytes, limit):
                left = refit.deadline - time.monotonic()
                if refit.abort.is_set() or left <= 0:
                    why = "aborted" if left > 0 else "timed out waiting for earlier writes"
                    raise ExecutionError(f"{why} (to slot {ch.dst_slot})")
                self._cond.wait(min(left, 0.1))
            self._held[ch.dst_slot] = self._held.get(ch.dst_slot, 0) + ch.nbytes

    def landed(self, ch: Chunk) -> None:
        with self._cond:
            self._held[ch.dst_slot] -= ch.nbytes
            self._cond.notify_all()


class _Packs:
    """A sender's buffers for packed chunks (power-of-two sizes), reused once their writes
    landed; all held until the pool goes (a write that failed may still read its buffer)."""

    def __init__(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = {}
        self._all: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def get(self, nbytes: int) -> torch.Tensor:
        size = max(1 << 16, 1 << (nbytes - 1).bit_length())
        with self._lock:
            free = self._free.get(size)
            if free:
                return free.pop()
            buf = torch.empty(size, dtype=torch.uint8)
            self._all.append(buf)
            return buf

    def put(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.setdefault(buf.numel(), []).append(buf)


@dataclass
class OneSidedLinks:
    """One-sided paths of one loaded plan in one transfer process (see the module doc)."""

    peers: dict[int, tuple[Peer, Descriptor]] = field(default_factory=dict)
    # message id -> (doorbell, entry): a slot has a doorbell per path kind it receives on
    recv: dict[int, tuple[Doorbell, int]] = field(default_factory=dict)
    # message id -> the landing area its packed chunks arrive in (received, see `OneSided`)
    landing: dict[int, torch.Tensor] = field(default_factory=dict)
    # the sends' packed chunks (kept until the peers, which hold them registered, close)
    packs: _Packs = field(default_factory=_Packs)

    def stale(self) -> list[int]:
        """Destination slots whose doorbell no longer shows the descriptor's generation
        (they reloaded or unloaded the plan since it was fetched) or cannot be read (a
        remote one that went away: attaching afresh says why)."""
        out = []
        for slot, (peer, d) in self.peers.items():
            try:
                gen = peer.generation()
            except TransportError:
                gen = RETIRED
            if gen != d.generation:
                out.append(slot)
        return out

    def close(self) -> None:
        for peer, _ in self.peers.values():
            peer.close()
        self.peers.clear()
        self.packs = _Packs()


def one_sided_messages(p: SlotProgram) -> tuple[frozenset[int], frozenset[int]]:
    """(ids of sent, ids of received) messages of a program on one-sided paths."""
    codes = np.array([k for k, name in enumerate(PATHS) if name in ONE_SIDED], np.uint8)
    send = p.send.id[np.isin(p.send.path, codes)]
    recv = p.recv.id[np.isin(p.recv.path, codes)]
    return frozenset(send.tolist()), frozenset(recv.tolist())


class BellWork:
    """A receive chunk of a one-sided message: done once the doorbell shows it (`landed`
    asks without waiting, `finish` then puts a packed chunk into place)."""

    def __init__(
        self, bell: Doorbell, entry: int, attempt: int, chunks: int, abort: threading.Event,
        what: str, scatter: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        self.bell, self.entry, self.attempt, self.chunks = bell, entry, attempt, chunks
        self.abort, self.what, self.scatter = abort, what, scatter

    def landed(self) -> bool:
        return self.bell.shows(self.entry, self.attempt, self.chunks)

    def expire(self) -> None:
        """The wait is over (deadline or abort): TransportError naming the chunk unless
        it landed meanwhile."""
        now = time.monotonic()
        self.bell.wait(self.entry, self.attempt, self.chunks, now, self.abort, self.what)

    def finish(self) -> None:
        if self.scatter is not None:  # a packed chunk: into place before anyone reads it
            try:
                self.scatter()
            except Exception as e:
                raise ExecutionError(f"{self.what}: scattering its landed chunk failed: {e}") from e


class _Landing:
    """A send chunk's writes in flight: `wait` returns once they landed and hands the chunk
    to the ringer, which tells the destination (`confirm`)."""

    def __init__(
        self, slot: int, ch: Chunk, posted: Work, peer: Peer, desc: Descriptor, attempt: int,
        window: _Window | None, ringer: Ringer, packed: tuple[_Packs, torch.Tensor] | None,
    ) -> None:  # fmt: skip
        self.slot, self.ch, self.posted, self.peer, self.desc = slot, ch, posted, peer, desc
        self.attempt, self.window, self.ringer, self.packed = attempt, window, ringer, packed

    def wait(self, timeout_s: float) -> None:
        self.posted.wait(timeout_s)
        if self.packed is not None:
            self.packed[0].put(self.packed[1])
        if self.window is not None:
            self.window.landed(self.ch)
        self.ringer.put(self)


def confirm(landed: list[_Landing]) -> None:
    """Tell the destinations that these chunks landed: per destination each message's
    doorbell word is rung with its highest chunk count, and the doorbell's generation is
    read (it still holds the plan: the writes went where the descriptor said), all in one
    exchange (`Peer.ring_current`). Chunks of a message land in posting order, so the
    highest count covers the others."""
    by_peer: dict[int, list[_Landing]] = {}
    for la in landed:
        by_peer.setdefault(id(la.peer), []).append(la)
    for group in by_peer.values():
        first = group[0]
        rings: dict[int, tuple[int, int]] = {}
        for la in group:
            entry = first.desc.entry[la.ch.mid]
            rings[entry] = max(rings.get(entry, (0, 0)), (la.ch.index + 1, la.attempt))
        words = [(e, a, n) for e, (n, a) in rings.items()]
        if not first.peer.ring_current(first.desc.generation, words):
            ch = first.ch
            raise ExecutionError(
                f"slot {first.slot}: message {ch.mid} to slot {ch.dst_slot}: stale descriptor "
                "(the destination unloaded or reloaded the plan while it was written)"
            )


class Ringer:
    """Confirms landed one-sided chunks on a thread of its own (`run`), so the send-waiter
    goes on to the next landing meanwhile; whatever landed while one confirmation was on
    the wire is confirmed together (`confirm`)."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[_Landing | None] = queue.SimpleQueue()

    def put(self, landed: _Landing | None) -> None:
        """A landed chunk to confirm; None: no more (run returns once the rest is done)."""
        self._q.put(landed)

    def run(
        self, fail: Callable[[BaseException], None], describe: Callable[[Chunk, str], str]
    ) -> None:
        """Confirm until None arrives; the first error (with `describe` of its send) goes
        to `fail`, later chunks are dropped unconfirmed (the refit failed)."""
        failed, more = False, True
        while more:
            batch = [self._q.get()]
            while not self._q.empty():
                batch.append(self._q.get())
            more = None not in batch
            landed = [la for la in batch if la is not None]
            if failed or not landed:
                continue
            try:
                confirm(landed)
            except Exception as e:
                failed = True
                fail(ExecutionError(f"{describe(landed[0].ch, 'send')}: {e}"))


class OneSided:
    """The one-sided messages of one executor: remote tensors checked, chunks written and
    waited for."""

    def __init__(self, program: SlotProgram, links: OneSidedLinks | None) -> None:
        self.p = program
        self.links = links or OneSidedLinks()
        self.devices: set[torch.device] = set()  # of the destinations the sends write
        self.send, self.recv = one_sided_messages(program)
        self.window = _Window()
        self.data: SlotViews | None = None  # set by `bind`
        missing = sorted({int(s) for s, m in zip(program.send.dst_slot, program.send.id,
                                                   strict=True)
                          if int(m) in self.send and int(s) not in self.links.peers})  # fmt: skip
        if missing:
            raise ExecutionError(
                f"slot {program.slot}: messages to slots {missing} go by a one-sided path, but "
                "no descriptor of theirs was attached"
            )
        absent = sorted(m for m in self.recv if m not in self.links.recv)
        if absent:
            raise ExecutionError(
                f"slot {program.slot}: it receives messages {absent[:8]} on a one-sided path "
                "but exposed no doorbell entry for them"
            )

    @property
    def mids(self) -> frozenset[int]:
        return self.send | self.recv

    def joined(self) -> frozenset[int]:
        """Sent messages whose pieces are written joined (chunks.join_pieces): those on a
        remote path to a destination on this sender's host."""
        p, peers = self.p.send, self.links.peers
        return frozenset(
            m for m, s in zip(p.id.tolist(), p.dst_slot.tolist(), strict=True)
            if m in self.send and peers[s][0].in_flight and peers[s][0].one_host
        )  # fmt: skip

    def bind(self, data: SlotViews) -> None:
        """The slot's views: a receiver scatters packed chunks with them."""
        self.data = data

    @staticmethod
    def _landing_at(ch: Chunk) -> int:
        """Where a packed chunk's bytes start in its message's landing area (as in the
        message's wire bytes: the same offset on both ends)."""
        return ch.msg_at + ch.seg_start

    def remote_tensors(self) -> dict[int, ResolvedTensor]:
        """The destination tensors of the one-sided sends, mapped from their peers and
        checked against the program (dtype of plain storage, regions inside)."""
        p, c = self.p, self.p.copies
        out: dict[int, ResolvedTensor] = {}
        self.devices.clear()
        for k in range(len(p.send)):
            mid, dst_slot = int(p.send.id[k]), int(p.send.dst_slot[k])
            if mid not in self.send:
                continue
            peer, _ = self.links.peers[dst_slot]
            what = f"slot {p.slot}: message {mid} to slot {dst_slot}"
            for i in range(int(p.send.start[k]), int(p.send.end[k])):
                index = int(c.dst[i])
                t = out.get(index)
                if t is None:
                    try:
                        r = peer.tensor(index)
                    except Exception as e:
                        raise ExecutionError(f"{what}: {e}") from e
                    t = out[index] = ResolvedTensor(
                        r.name, r.data, r.scales, r.storage, r.global_scale
                    )
                    self.devices.add(r.data.device)
                _check_region(t, c, i, index, what)
        return out

    def check(self, attempt: int) -> None:
        """Before a refit: every peer's descriptor is current and its memory live."""
        self.window = _Window()  # what a failed refit left counted is not in flight now
        stale = self.links.stale()
        if stale:
            raise ExecutionError(
                f"slot {self.p.slot}: stale descriptors of slots {stale} (they loaded the plan "
                f"again since this slot attached to them); attempt {attempt} writes nothing"
            )
        for slot, (peer, _) in self.links.peers.items():
            try:
                peer.check_live()
            except Exception as e:
                raise ExecutionError(f"slot {self.p.slot}: destination slot {slot}: {e}") from e

    def write(
        self, ch: Chunk, data: SlotViews, sums: _Sums | None, refit: _Refit,
        flush: Callable[[], None],
    ) -> _Landing:  # fmt: skip
        """Post one send chunk's writes into its destination (by the refit's deadline);
        the returned Work waits for them and rings the destination's doorbell, so the next
        chunk is prepared while these are in flight (up to WINDOW bytes per destination,
        WINDOW_ONE_HOST on the sender's host). A copy through a codec is encoded and landed
        by the sender (the destination takes no part), then flushed to the peer."""
        peer, desc = self.links.peers[ch.dst_slot]
        attempt, device, deadline = refit.attempt, refit.prep.device, refit.deadline
        window = self.window if peer.in_flight else None
        w = data.direct_views(ch)
        if sums is not None:  # a copy in pieces at its last one (see SlotViews.source_sums)
            for i in ch.rows:
                if data.plain_raw_dst(i) and data.ends(ch, i):
                    sums[(ch.mid, i)] = data.source_sum(i)
        lands = peer.lands(ch.mid)
        if lands and w.slow:
            raise ExecutionError(
                f"message {ch.mid} to slot {ch.dst_slot}: its destination lands it packed, but "
                f"copy {w.slow[0][0]} is no raw copy into plain storage"
            )
        if window is not None:  # the chunk is prepared while earlier ones are in flight
            window.take(ch, refit, flush, WINDOW_ONE_HOST if peer.one_host else WINDOW)
        packed = None
        if lands:  # one write of the chunk packed; the destination scatters it
            src = _as_packed(ch, data)
            if src is None:
                buf = self.links.packs.get(ch.nbytes)
                packed, src = (self.links.packs, buf), buf[: ch.nbytes]
                data.pack(ch, src, None)
            posted = peer.land(ch.mid, self._landing_at(ch), src, deadline)
        else:
            posted = peer.post(w.dst, w.src, deadline)
        for i, _ in w.slow:
            if ch.seg_start:
                continue  # a coded copy lands whole with its first chunk
            data.land_coded(i)
            peer.flush(data.dst_parts(i), deadline)
            if sums is not None:
                sums[(ch.mid, i)] = data.region_sum(i)
        for dev in self.devices | {device}:  # the copies and landings are queued there
            if dev.type == "cuda":
                torch.cuda.current_stream(dev).synchronize()
        return _Landing(self.p.slot, ch, posted, peer, desc, attempt, window, refit.ringer, packed)

    def work(self, ch: Chunk, attempt: int, abort: threading.Event, what: str) -> BellWork:
        """The wait of one receive chunk (a packed one: then scattered into place)."""
        bell, entry = self.links.recv[ch.mid]
        area, scatter = self.links.landing.get(ch.mid), None
        if area is not None:
            data, at = self.data, self._landing_at(ch)
            if data is None or at + ch.nbytes > area.numel():
                raise ExecutionError(f"{what}: its landing area does not hold the chunk")
            piece = area[at : at + ch.nbytes]
            scatter = lambda: data.unpack(ch, piece, {}, None)  # noqa: E731
        return BellWork(bell, entry, attempt, ch.index + 1, abort, what, scatter)


def _as_packed(ch: Chunk, data: SlotViews) -> torch.Tensor | None:
    """The chunk's packed bytes as one view of its host sources, written as they are
    (a shard of a row-parallel weight is its packed chunks back to back), or None."""
    view = ch.cache.get("as_packed", False)
    if view is False:
        view = data.zero_copy_send(ch)
        view = ch.cache["as_packed"] = None if view is None or view.is_cuda else view
    return view


def _check_region(t: ResolvedTensor, c, i: int, index: int, what: str) -> None:
    """A copy row's destination region fits the mapped tensor, whose dtype (plain storage)
    is the program's."""
    nd = int(c.ndim[i])
    shape = tuple(t.data.shape)
    if t.storage == NVFP4 and shape:  # two elements per byte of the last dim
        shape = (*shape[:-1], 2 * shape[-1])
    want = torch_dtype(DTYPES[int(c.dst_dtype[i])])
    if t.storage == PLAIN and t.data.dtype != want:
        raise ExecutionError(
            f"{what}: mismatched descriptor: destination tensor {index} ({t.name!r}) is "
            f"{t.data.dtype}, the plan writes {want}"
        )
    end = (c.dst_off[i, :nd] + c.shape[i, :nd]).tolist()
    if len(shape) != nd or any(e > s for e, s in zip(end, shape, strict=True)):
        raise ExecutionError(
            f"{what}: mismatched descriptor: destination tensor {index} ({t.name!r}) has "
            f"shape {list(shape)}, the plan writes up to {end}"
        )
