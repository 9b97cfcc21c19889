"""The parent side of a transfer process (one OS process per device slot).

The process (refitd.transfer.main) holds the slot's rank of the refit communicator, maps
worker memory, and keeps programs, mappings and prepared executors cached per plan digest,
so a cached-plan refit is one `Execute` command. `TransferProcessHandle` spawns it and has
one method for every command: `send` takes a typed command of refitd.slot_protocol and
returns a `Pending` whose `result` is the command's typed report (within the command's own
wait, refitd.slot_protocol.SlotCommand.wait_s); a `Failed` report is raised there
(StorageMovedError or TransferProcessError). Commands sent to several handles before any
result is read run at the same time (a communicator's ranks connect together).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Generic, TypeVar

from refitd.memory.errors import StorageMovedError
from refitd.slot_protocol import (
    DEFAULTS,
    Close,
    Failed,
    Ping,
    Report,
    SlotCommand,
    SlotOptions,
    SourcesReleased,
    verb_of,
)

PROCESS_NAME_PREFIX = "refitd-slot"  # a transfer process's name in ps/top: refitd-slot<N>
START_TIMEOUT_S = 60.0  # a new process answers its first ping (the fork server may still
# be importing torch)

R = TypeVar("R")


def transfer_context() -> mp.context.ForkServerContext:
    """Transfer processes fork from a server that has imported their modules (torch among
    them) once: N slots cost one torch import, not N. The server never touches a device, so
    a child may still initialise CUDA."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["refitd.transfer.main"])
    return ctx


def start_transfer_server() -> None:
    """Start the fork server now, without waiting: its imports run while the caller does
    other start-up work, and the first transfer process starts faster."""
    from multiprocessing import forkserver

    transfer_context()
    forkserver.ensure_running()


def run_transfer_process(conn: Connection, slot: int, device: str | None, name: str) -> None:
    """The child's entry point. It imports the process's modules only here (the fork server
    has them already), so the node agent itself never imports torch."""
    from refitd.transfer.main import transfer_process_main

    transfer_process_main(conn, slot, device, name)


class TransferProcessError(RuntimeError):
    """A command failed in the transfer process, or the process did not answer in time."""


class Pending(Generic[R]):
    """A command sent to a transfer process whose report has not been read yet."""

    def __init__(self, handle: TransferProcessHandle, rid: int, command: SlotCommand[R]) -> None:
        self.handle = handle
        self.rid = rid
        self.command = command

    def result(
        self,
        on_released: Callable[[SourcesReleased], None] | None = None,
        timeout_s: float | None = None,
    ) -> R:
        """The command's report; `on_released` gets an execute's SourcesReleased event.
        Waits the command's own time (`timeout_s` overrides it)."""
        wait = self.command.wait_s(self.handle.options) if timeout_s is None else timeout_s
        report = self.handle._wait(self.rid, self.command, wait, on_released)
        verb = verb_of(self.command)
        if not isinstance(report, verb.report):
            raise TransferProcessError(
                f"slot {self.handle.slot}: expected a {verb.report.__name__} report, got {report!r}"
            )
        return report  # type: ignore[return-value]


class TransferProcessHandle:
    """Parent side of one transfer process (spawned at construction); `options` give the
    commands' waits."""

    def __init__(
        self, slot: int, device: str | None = None, options: SlotOptions = DEFAULTS
    ) -> None:
        self.slot = slot
        self.options = options
        ctx = transfer_context()
        self._conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=run_transfer_process,
            args=(child, slot, device, f"{PROCESS_NAME_PREFIX}{slot}"),
            name=f"{PROCESS_NAME_PREFIX}{slot}",
            daemon=True,
        )
        self.process.start()
        child.close()
        self._rid = 0
        self._send_lock = threading.Lock()  # commands go down the pipe whole, one at a time
        self._cv = threading.Condition()  # guards _reports and _reading
        self._reading = False  # a waiter is reading the pipe; the others wait on _cv
        self._reports: dict[int, list[Report]] = {}
        self.send(Ping()).result(timeout_s=START_TIMEOUT_S)

    def alive(self) -> bool:
        return self.process.is_alive()

    def send(self, command: SlotCommand[R]) -> Pending[R]:
        """Send a command now; read its report later with .result()."""
        with self._send_lock:
            self._rid += 1
            rid = self._rid
            try:
                self._conn.send((rid, command))
            except (OSError, BrokenPipeError) as e:
                raise TransferProcessError(
                    f"slot {self.slot}: transfer process is gone: {e}"
                ) from e
        return Pending(self, rid, command)

    def _next(self, rid: int, op: str, deadline: float, timeout_s: float) -> Report | None:
        """The next report of `rid` (queued, or read from the pipe), None if none came yet.
        One waiter reads the pipe at a time, holding no lock while it polls: a command sent
        meanwhile goes at once, and a report read for another command wakes its waiter."""
        with self._cv:
            while True:
                queued = self._reports.get(rid)
                if queued:
                    return queued.pop(0)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferProcessError(
                        f"slot {self.slot}: no answer to {op!r} within {timeout_s:.1f}s"
                    )
                if not self._reading:
                    self._reading = True
                    break
                self._cv.wait(min(left, 0.2))
        got: int | None = None
        report: Report | None = None
        try:
            if self._conn.poll(min(left, 0.2)):
                got, report = self._conn.recv()
        except (EOFError, OSError) as e:
            raise TransferProcessError(
                f"slot {self.slot}: transfer process died during {op!r} "
                f"(exit code {self.process.exitcode})"
            ) from e
        finally:
            with self._cv:
                self._reading = False
                if got is not None and got != rid:
                    self._reports.setdefault(got, []).append(report)  # type: ignore[arg-type]
                self._cv.notify_all()
        return report if got == rid else None

    def _wait(
        self,
        rid: int,
        command: SlotCommand[Any],
        timeout_s: float,
        on_released: Callable[[SourcesReleased], None] | None,
    ) -> Report:
        op = type(command).__name__.lower()
        deadline = time.monotonic() + timeout_s
        while True:
            report = self._next(rid, op, deadline, timeout_s)
            if report is None:
                continue
            if isinstance(report, SourcesReleased):
                if on_released is not None:
                    on_released(report)
                continue
            if isinstance(report, Failed):
                if report.kind == "storage_moved":
                    raise StorageMovedError(f"slot {self.slot}: {report.error}")
                raise TransferProcessError(f"slot {self.slot}: {op} failed: {report.error}")
            return report

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the process (killed if it does not exit within timeout_s)."""
        if self.process.is_alive():
            with contextlib.suppress(TransferProcessError, StorageMovedError):
                self.send(Close()).result(timeout_s=timeout_s)
            self.process.join(timeout_s)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(timeout_s)
        self._conn.close()
