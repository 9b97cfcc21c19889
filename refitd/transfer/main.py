"""The transfer process's command loop: one OS process per device slot, serving the typed
commands of refitd.slot_protocol from its node agent over a multiprocessing Pipe.

Each `(rid, command)` is answered by `(rid, report)`, a `Failed` when it raised (raised
again in the parent). The protocol's table names the slot method that answers a command; a
refit (execute) runs on a refit thread of its lane (one lane per model refitting at once),
so an abort arriving meanwhile is served at once; at most one refit runs per lane.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import queue
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch

from refitd.executor.errors import ExecutionError
from refitd.limits import raise_nofile_limit
from refitd.memory.errors import StorageMovedError
from refitd.slot_protocol import Failed, ProtocolError, Report, SourcesReleased, verb_of
from refitd.transfer.slot import TransferSlot
from refitd.transport.errors import TransportError

PR_SET_NAME = 15  # prctl(2): the thread's name, which ps, top and psutil's name() show


def name_this_process(name: str) -> None:
    """Give the process a name operators and the fault suite can find (Linux; else a no-op).
    Forked transfer processes otherwise all look like their fork server."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def failure(e: BaseException) -> Failed:
    """The report of a command that raised: our own errors by their message, others with
    the end of their traceback; kind "storage_moved" or the exception's class name."""
    kind = "storage_moved" if isinstance(e, StorageMovedError) else type(e).__name__
    detail = f"{e}"
    if not isinstance(e, ExecutionError | StorageMovedError | TransportError):
        detail += "\n" + "".join(traceback.format_exception(e)[-3:])
    return Failed(kind, detail)


class _Replies:
    """The pipe's sending end, shared by the loop and the refit thread. A refit's replies
    (its SourcesReleased event, then its report) are posted to a sender thread in order, so
    pickling and writing them (and a reader slow to drain the pipe) stay off the refit."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()
        self.posted: queue.SimpleQueue[tuple[int, Report] | None] = queue.SimpleQueue()
        self.sender = threading.Thread(target=self._drain, name="refitd-replies", daemon=True)
        self.sender.start()

    def send(self, rid: int, report: Report) -> None:
        with self.lock:
            self.conn.send((rid, report))

    def post(self, rid: int, report: Report) -> None:
        self.posted.put((rid, report))

    def _drain(self) -> None:
        while (item := self.posted.get()) is not None:
            with contextlib.suppress(OSError, ValueError):  # the parent went away
                self.send(*item)

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is posted, then stop the sender."""
        self.posted.put(None)
        self.sender.join(timeout_s)


def transfer_process_main(conn: Connection, slot: int, device: str | None, name: str) -> None:
    """Entry point of a transfer process: serve commands until close or the pipe closes."""
    name_this_process(name)
    raise_nofile_limit()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if device is not None and device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    state = TransferSlot(slot)
    replies = _Replies(conn)
    runner = _RefitThreads(device)
    while not state.closed:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        try:
            rid, cmd = message
        except (TypeError, ValueError):
            replies.send(-1, failure(ExecutionError(f"not a request: {message!r}")))
            continue
        try:
            verb = verb_of(cmd)
        except ProtocolError as e:
            replies.send(rid, failure(ExecutionError(str(e))))
            continue
        handler = getattr(state, verb.handler)
        if verb.refit:
            lane = getattr(cmd, "lane", 0)
            run = functools.partial(handler, cmd)
            _start_refit(state, replies, rid, run, runner.of(lane), (lane, cmd.digest))
            continue
        try:
            report = handler(cmd)
        except BaseException as e:
            report = failure(e)
        replies.send(rid, report)
    runner.stop()
    replies.close()
    conn.close()


class _RefitThread:
    """The thread that runs one lane's refits, one after another. Kept for the process's
    life: a new thread per refit paid torch's (and CUDA's) per-thread setup on every
    refit's first operations, tens to hundreds of microseconds each time."""

    def __init__(self, device: str | None, lane: int = 0) -> None:
        self.device = device
        self.jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        name = "refitd-execute" if lane == 0 else f"refitd-execute-{lane}"
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        if self.device is not None and self.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(self.device))  # the current device is per thread
        while (job := self.jobs.get()) is not None:
            job()

    def stop(self) -> None:
        self.jobs.put(None)


class _RefitThreads:
    """One refit thread per lane, made when a lane first runs a refit."""

    def __init__(self, device: str | None) -> None:
        self.device = device
        self.lanes: dict[int, _RefitThread] = {}

    def of(self, lane: int) -> _RefitThread:
        if lane not in self.lanes:
            self.lanes[lane] = _RefitThread(self.device, lane)
        return self.lanes[lane]

    def stop(self) -> None:
        for t in self.lanes.values():
            t.stop()


def _start_refit(
    state: TransferSlot,
    replies: _Replies,
    rid: int,
    run: Callable[[Callable[[], None]], Report],
    runner: _RefitThread,
    where: tuple[int, str],
) -> None:
    """Run a refit on its lane's refit thread (the loop stays free for abort); its
    SourcesReleased event and its report go back under the command's rid."""
    lane, digest = where
    refused = state.begin_refit(lane, digest)
    if refused is not None:
        replies.send(rid, failure(ExecutionError(refused)))
        return

    def released() -> None:
        replies.post(rid, SourcesReleased(time.time()))

    def body() -> None:
        report: Report
        try:
            report = run(released)
        except BaseException as e:
            report = failure(e)
        state.end_refit(lane)
        replies.post(rid, report)

    runner.jobs.put(body)
