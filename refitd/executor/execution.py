"""One refit of one slot over a prepared program (`RefitExecution`), and its report.

Five threads run beside the caller's: the poster packs and posts every step's chunks (each
send once its `Share` of the link admits it), the send-waiter completes sends in posting
order, frees their buffers and sources, the ringer confirms landed one-sided sends, the
receiver completes collective receives in posting order and unpacks them, the bell-watcher
one-sided receives as they land (receipts.py). The caller runs the local copies, then the
relay copies once every receive completed. `progress` (on `lock`) wakes relay sends.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from refitd.executor.chunks import Chunk, messages_without
from refitd.executor.errors import ExecutionError
from refitd.executor.message_stats import MessageStats
from refitd.executor.onesided import OneSided, Ringer
from refitd.executor.prepare import PreparedProgram
from refitd.executor.receipts import ONE_SIDED, BellWatch, HeldRelays, Posted, Receipts
from refitd.executor.shares import Share, gated_bytes
from refitd.executor.views import LocalStep, PartialSegments
from refitd.slot_protocol import ExecReport
from refitd.transport.base import P2POp, Transport, Work

_SKIPPED = torch.empty(0, dtype=torch.uint8)  # no buffer: a skipped or one-sided chunk

_Sums = dict[tuple[int, int], torch.Tensor]  # (message id, copy row) -> 0-d int64 checksum
# a posted op: (chunk, buffer, ring, is a send, its work when not from the batch, the
# offset and bytes of the piece of the chunk it carries)
_Post = tuple[Chunk, torch.Tensor, int, bool, Work | None, int, int]


class RefitExecution:
    """The state of one running refit of one slot; `run` drives it and returns the report."""

    def __init__(
        self,
        prep: PreparedProgram,
        transport: Transport | None,
        peer: Callable[[int], int],
        t0: float,
        timeout_s: float,
        on_sources_released: Callable[[], None] | None,
        abort: threading.Event,
        verify: bool,
        skip: frozenset[int],
        one_sided: OneSided,
        attempt: int,
        share: Share | None = None,
    ) -> None:
        self.t0 = t0  # the refit's start (monotonic), before the storage check
        self.prep = prep
        self.data = prep.data
        self.pool = prep.pool
        self.transport = transport
        self.peer = peer
        self.slot = prep.program.slot
        self.timeout_s = timeout_s
        self.deadline = self.t0 + timeout_s
        self.on_sources_released = on_sources_released
        self.abort = abort
        self.verify = verify
        self.skip = skip
        self.one_sided = one_sided
        self.attempt = attempt
        self.share, self.shared = share or Share(), False  # shared: the last send's link
        self.is_cuda = prep.device.type == "cuda"
        self.report = ExecReport(slot=self.slot)
        self.send_sums: _Sums | None = {} if verify else None
        self.recv_sums: _Sums | None = {} if verify else None
        self.send_q: queue.SimpleQueue[Posted | None] = queue.SimpleQueue()
        self.recv_q: queue.SimpleQueue[Posted | None] = queue.SimpleQueue()
        self.bell_q: queue.SimpleQueue[Posted | None] = queue.SimpleQueue()  # one-sided
        self.ringer = Ringer()  # confirms one-sided sends once landed
        self.stats = MessageStats()  # under a lock of its own
        # shared between the threads, under `lock`
        self.lock = threading.Lock()
        self.progress = threading.Condition(self.lock)
        self.errors: list[BaseException] = []
        self.local_done = self.released = False  # local copies from sources ran; released
        self.receipts = Receipts(len(prep.recv_chunks), self.progress)  # waited and unpacked
        skipped = [c for c in prep.send_chunks if c.mid in skip] if skip else []  # O(1) unskipped
        self.sources_left = prep.source_chunks - sum(prep.reads_source[id(c)] for c in skipped)
        # each written by one thread only: the poster, the receiver, the bell-watcher
        self.pack_s = self.unpack_s = self.recv_wait_s = self.bell_wait_s = 0.0

    # ------------------------------------------------------------------ shared state
    def fail(self, e: BaseException) -> None:
        with self.lock:
            self.errors.append(e)
            self.progress.notify_all()
        self.abort.set()

    def wait_recvs(self, need: np.ndarray | None, what: str) -> None:
        """Block until the receive chunks at `need` in posting order (None: all) completed."""
        self.receipts.wait(need, self.deadline, self.abort, what)
        if self.is_cuda:  # unpacks are queued on the stream: make them visible before reading
            torch.cuda.current_stream(self.prep.device).synchronize()

    def _received(self, item: Posted) -> None:
        """A receive chunk in place: checksums (one-sided: read back where it landed)."""
        if self.recv_sums is not None:
            land = self.data.landed_direct if item.ring == ONE_SIDED else self.data.landed
            land(item.chunk, self.recv_sums)
        self.stats.finished("recv", item.chunk.mid)
        self._recv_completed(item.chunk, item.chunk.nbytes)

    def _recv_completed(self, ch: Chunk, nbytes: int) -> None:
        with self.progress:
            self.report.landed(nbytes)
            self.receipts.completed(self.prep.recv_pos[id(ch)])

    def source_done(self, n: int = 1) -> None:
        """n chunks reading sources completed; once none is left and the local copies are
        done, the sources are released (once)."""
        with self.lock:
            self.sources_left -= n
            done = self.sources_left == 0 and self.local_done and not self.released
            if done:
                self.released = True
        if done:
            if self.verify and self.is_cuda:  # source checksums are queued on the stream
                torch.cuda.current_stream(self.prep.device).synchronize()
            self.report.sources_released_s = time.monotonic() - self.t0
            if self.on_sources_released is not None:
                self.on_sources_released()

    def describe(self, ch: Chunk, direction: str) -> str:
        peer = ch.dst_slot if direction == "send" else ch.src_slot
        return (
            f"slot {self.slot}: {direction} of message {ch.mid} (round {ch.round}, "
            f"chunk {ch.index}, {ch.nbytes} bytes) {'to' if direction == 'send' else 'from'} "
            f"slot {peer} (rank {self.peer(peer)})"
        )

    # ------------------------------------------------------------------ threads
    def poster(self) -> None:
        """Post every step's receives and sends (packing staged sends) as one batch each,
        after the receives that need no posting (one-sided: watched; skipped: done). A
        one-sided relay chunk whose feeds have not landed is held, later ones go first."""
        try:
            for ch in self.prep.recv_order:
                if ch.mid in self.skip:
                    self._recv_completed(ch, 0)
                elif id(ch) in self.prep.one_sided:
                    work = self.one_sided.work(
                        ch, self.attempt, self.abort, self.describe(ch, "recv")
                    )
                    self.stats.posted("recv", ch, True)
                    self.bell_q.put(Posted(ch, work, _SKIPPED, ONE_SIDED, 0, ch.nbytes))
            if self.share.shares is not None:
                p = self.prep
                self.share.expect(gated_bytes(p.send_chunks, self.skip, p.one_sided, self.peer))
            held, one_sided = HeldRelays(self.receipts, self.prep.relay_wait), self.prep.one_sided
            for sends, recvs in self.prep.steps:
                go = [c for c in sends if c.mid not in self.skip
                      and not (id(c) in one_sided and held.hold(c))]  # fmt: skip
                if not self._post_step(held.ready() + go, recvs):
                    return
            while held:
                held.wait(self.deadline, self.abort, f"slot {self.slot}: held relay sends")
                if not self._post_step(held.ready(), []):
                    return
        except BaseException as e:
            self.fail(e)
        finally:
            self.send_q.put(None)
            self.recv_q.put(None)
            self.bell_q.put(None)

    def _post_step(self, sends: list[Chunk], recvs: list[Chunk]) -> bool:  # False: aborted
        ops: list[P2POp] = []
        posted: list[_Post] = []
        for ch in recvs:
            self._post_recv(ch, ops, posted)
        for ch in sends:
            self._post_send(ch, ops, posted)
        if self.abort.is_set():
            return False
        self._submit(ops, posted)
        return True

    def _post_recv(self, ch: Chunk, ops: list[P2POp], posted: list[_Post]) -> None:
        if ch.mid in self.skip or id(ch) in self.prep.one_sided:  # done resp. watched
            return
        zc = self.prep.zc_recv[id(ch)]
        ring = self.prep.ring.get(id(ch), -1)
        buf = (
            zc
            if zc is not None
            else self.pool.acquire(
                "recv", ring, self.deadline, self.abort, self.describe(ch, "recv")
            )
        )
        src, tag = self.peer(ch.src_slot), self.share.tag(ch.tag)
        for at, n in self.share.pieces(ch.nbytes):
            ops.append(P2POp(False, buf[at : at + n], src, tag))
            posted.append((ch, buf, ring, False, None, at, n))

    def _flush(self, ops: list[P2POp], posted: list[_Post]) -> None:
        """Post what the step holds back (before waiting for a share of a link)."""
        self._submit(ops[:], posted[:])
        del ops[:], posted[:]

    def _post_send(self, ch: Chunk, ops: list[P2POp], posted: list[_Post]) -> None:
        need = self.prep.relay_wait.get(id(ch))
        if need is not None:
            self.wait_recvs(need, self.describe(ch, "send"))
        if id(ch) in self.prep.one_sided:
            try:
                flush = lambda: self._flush(ops, posted)  # noqa: E731
                work = self.one_sided.write(ch, self.data, self.send_sums, self, flush)
            except Exception as e:
                raise ExecutionError(f"{self.describe(ch, 'send')}: {e}") from e
            posted.append((ch, _SKIPPED, ONE_SIDED, True, work, 0, ch.nbytes))
            return
        zc = self.prep.zc_send[id(ch)]
        ring = self.prep.ring.get(id(ch), -1)
        if zc is None:
            if self.send_sums is not None:
                self.data.source_sums(ch, self.send_sums)
            buf = self.pool.acquire(
                "send", ring, self.deadline, self.abort, self.describe(ch, "send")
            )
            tp = time.monotonic()
            self.data.pack(ch, buf, self.send_sums)
            self.pack_s += time.monotonic() - tp
            if buf.is_cuda:
                torch.cuda.current_stream(buf.device).synchronize()
            if self.prep.reads_source[id(ch)]:
                self.source_done()
        else:
            buf = zc
        flush = lambda: self._flush(ops, posted)  # noqa: E731
        dst, tag = self.peer(ch.dst_slot), self.share.tag(ch.tag)
        for at, n in self.share.pieces(ch.nbytes):  # each piece takes its own turn
            self.shared = self.share.admit(dst, n, self.deadline, self.abort, flush)
            ops.append(P2POp(True, buf[at : at + n], dst, tag))
            posted.append((ch, buf, ring, True, None, at, n))
            if self.shared:  # other lanes on the link: post in admission order
                self._flush(ops, posted)

    def _submit(self, ops: list[P2POp], posted: list[_Post]) -> None:
        """One batch of the step's operations; their works go to the waiters in order."""
        try:
            works = iter(self.transport.batch(ops) if ops else [])  # type: ignore[union-attr]
        except Exception as e:
            ch0 = posted[0][0]
            raise ExecutionError(
                f"{self.describe(ch0, 'send' if posted[0][3] else 'recv')}: {e}"
            ) from e
        for ch, buf, ring, is_send, work, at, n in posted:
            if at == 0:
                self.stats.posted("send" if is_send else "recv", ch, ring < 0)
            work = next(works) if work is None else work
            (self.send_q if is_send else self.recv_q).put(Posted(ch, work, buf, ring, at, n))

    def send_waiter(self) -> None:
        """Complete sends in posting order; free their buffers, count their sources."""
        try:
            while (item := self.send_q.get()) is not None:
                try:
                    item.work.wait(self.deadline - time.monotonic())
                except Exception as e:
                    raise ExecutionError(f"{self.describe(item.chunk, 'send')}: {e}") from e
                if item.ring != ONE_SIDED:
                    self.share.sent(self.peer(item.chunk.dst_slot), item.nbytes)
                if not item.last:
                    continue
                self.stats.finished("send", item.chunk.mid)
                if item.ring >= 0:
                    self.pool.release("send", item.ring)
                else:  # zero-copy or one-sided: the sources were read until now
                    if self.send_sums is not None and item.ring != ONE_SIDED:
                        self.data.source_sums(item.chunk, self.send_sums)  # overlaps next sends
                    if self.prep.reads_source[id(item.chunk)]:
                        self.source_done()
                with self.lock:
                    self.report.sent_bytes += item.chunk.nbytes
        except BaseException as e:
            self.fail(e)
            while self.send_q.get() is not None:
                pass
        finally:
            self.ringer.put(None)

    def receiver(self) -> None:
        """Complete collective receives in posting order and unpack the staged ones."""
        partial: PartialSegments = {}
        try:
            while (item := self.recv_q.get()) is not None:
                tw = time.monotonic()
                try:
                    item.work.wait(self.deadline - time.monotonic())
                except Exception as e:
                    raise ExecutionError(f"{self.describe(item.chunk, 'recv')}: {e}") from e
                tu = time.monotonic()
                self.recv_wait_s += tu - tw
                if not item.last:
                    continue
                if item.ring >= 0:
                    try:
                        self.data.unpack(item.chunk, item.buf, partial, self.recv_sums)
                        self.unpack_s += time.monotonic() - tu
                    except Exception as e:
                        raise ExecutionError(
                            f"{self.describe(item.chunk, 'recv')}: unpack failed: {e}"
                        ) from e
                    self.pool.release("recv", item.ring)
                self._received(item)
        except BaseException as e:
            self.fail(e)
            while self.recv_q.get() is not None:
                pass

    def bell_watcher(self) -> None:
        """Complete one-sided receives as their doorbells show them (receipts.py)."""
        describe = lambda ch: self.describe(ch, "recv")  # noqa: E731
        watch = BellWatch(self.bell_q, self._received, describe, self.deadline, self.abort)
        try:
            watch.run()
        except BaseException as e:
            self.fail(e)
        self.bell_wait_s = watch.waited_s

    def _on_device(self, f: Callable[[], None]) -> Callable[[], None]:
        def body() -> None:
            if self.is_cuda:  # the CUDA current device is per thread
                torch.cuda.set_device(self.prep.device)
            f()

        return body

    # ------------------------------------------------------------------ local copies
    def run_local(self, step: LocalStep, what: str) -> None:
        """Run one local step (direct or relay) on the calling thread; failures recorded."""
        phases = self.report.phases
        try:
            fused = None
            timed = self.is_cuda and not step.empty
            if timed:  # GPU time of the local copies next to the host's (phases)
                events = self.prep.timing_events(step)
                events[0].record()
            t_launch = time.monotonic()
            if step.grouped is not None:
                fused = step.grouped.run(hash=self.verify)
                self.report.local_bytes += step.grouped.nbytes
                self.report.tiles = {"grouped": step.grouped.tiles, "direct": step.grouped.chosen}
            if step.dst:
                torch._foreach_copy_(step.dst, step.src)
            for call, a, b in step.slow:
                call(a, b)
            self.report.local_bytes += step.nbytes
            if timed:
                events[1].record()
            # on a CPU device the copies run inside their calls: launch is their work
            launch_s = time.monotonic() - t_launch
            phases["local_launch_s"] = phases.get("local_launch_s", 0.0) + launch_s
            if self.verify:
                self.data.check_local(step.rows, fused, step.grouped_plain)
            if timed:  # local copies are async on the GPU: the sources are read once done
                t_sync = time.monotonic()
                torch.cuda.current_stream(self.prep.device).synchronize()
                waited_s = time.monotonic() - t_sync
                phases["local_sync_s"] = phases.get("local_sync_s", 0.0) + waited_s
                gpu_s = events[0].elapsed_time(events[1]) / 1e3
                phases["local_gpu_s"] = phases.get("local_gpu_s", 0.0) + gpu_s
        except ExecutionError as e:
            self.fail(e)
        except BaseException as e:
            self.fail(ExecutionError(f"slot {self.slot}: {what} failed: {e}"))

    def _run_locals(self) -> None:
        """Local copies from sources, then (once every receive completed) relay copies."""
        tl = time.monotonic()
        self.run_local(self.prep.local_direct, "local copy")
        self.report.local_seconds = time.monotonic() - tl
        self.report.phases["local_s"] = self.report.local_seconds
        with self.lock:
            self.local_done = True
        self.source_done(0)
        if self.prep.local_relay.empty or self.errors:
            return
        try:
            self.wait_recvs(None, f"slot {self.slot}: local relay copies")
        except BaseException as e:
            self.fail(e)
        else:
            tr = time.monotonic()
            self.run_local(self.prep.local_relay, "local relay copy")
            self.report.local_seconds += time.monotonic() - tr

    # ------------------------------------------------------------------ the refit
    def run(self) -> ExecReport:
        """Start the threads, run the local copies, join; raises the first error."""
        phases = self.report.phases
        threads: list[threading.Thread] = []
        if self.prep.has_messages:
            threads = [
                threading.Thread(target=self._on_device(f), name=f"refitd-{name}", daemon=True)
                for name, f in (
                    ("poster", self.poster),
                    ("send_waiter", self.send_waiter),
                    ("receiver", self.receiver),
                    ("bell_watcher", self.bell_watcher),
                    ("ringer", lambda: self.ringer.run(self.fail, self.describe)),
                )
            ]
            for t in threads:
                t.start()
        phases["check_start_s"] = time.monotonic() - self.t0
        self._run_locals()
        tj = time.monotonic()
        for t in threads:
            t.join(max(self.deadline - time.monotonic(), 0) + 1.0)
        if any(t.is_alive() for t in threads):
            self.abort.set()
            late = f"slot {self.slot}: refit did not finish within {self.timeout_s:.1f}s"
            with self.lock:
                if not self.errors:
                    self.errors.append(ExecutionError(late))
        with self.lock:
            if self.errors:
                raise self.errors[0]
        if self.is_cuda and self.prep.has_messages:  # unpacks queued by the receiver
            torch.cuda.current_stream(self.prep.device).synchronize()  # (run_local synced)
        t1 = time.monotonic()
        phases["messages_s"] = t1 - tj
        if self.prep.has_messages:
            waits = {"recv_wait_s": self.recv_wait_s, "bell_wait_s": self.bell_wait_s}
            phases.update(pack_s=self.pack_s, unpack_s=self.unpack_s, **waits)
        if self.send_sums is not None and self.recv_sums is not None:
            p = self.prep.program
            self.report.checksums = {
                "send": self.data.message_sums(messages_without(p.send, self.skip), self.send_sums),
                "recv": self.data.message_sums(messages_without(p.recv, self.skip), self.recv_sums),
            }
            phases["checksums_s"] = time.monotonic() - t1
            t1 = time.monotonic()
        self.report.seconds = t1 - self.t0
        self.report.staging_peak_bytes = self.pool.peak_bytes
        self.report.messages = self.stats.sorted()
        return self.report
