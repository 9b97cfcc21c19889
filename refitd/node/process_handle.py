"""The parent side of a transfer process (one OS process per device slot).

The process (process_main.py) holds the slot's rank of the refit communicator, maps worker
memory, and keeps programs, mappings and prepared executors cached per plan digest, so a
cached-plan refit is one `Execute` command. `TransferProcessHandle` spawns it and sends it
typed commands (refitd.slot_protocol: connect, load, unload, execute, apply, abort, probe,
close), one method per command, each with a timeout; replies come back typed, `Failed`
ones raised here (StorageMovedError or TransferProcessError).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TypeVar

from refitd.slot_protocol import (
    Abort,
    Applied,
    Apply,
    Close,
    Command,
    Connect,
    DeltaPlan,
    Execute,
    Executed,
    Failed,
    Load,
    Loaded,
    Ping,
    Probe,
    Reply,
    Request,
    Response,
    SourcesReleased,
    Unload,
    Unloaded,
)
from refitd.transport.errors import StorageMovedError

__all__ = [
    "PROCESS_NAME_PREFIX",
    "Pending",
    "TransferProcessError",
    "TransferProcessHandle",
    "expect",
    "start_transfer_server",
    "wait_execute",
]

PROCESS_NAME_PREFIX = "refitd-slot"  # a transfer process's name in ps/top: refitd-slot<N>


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


R = TypeVar("R")


def expect(reply: Reply, kind: type[R]) -> R:
    """The reply as the type its command answers with (anything else is a protocol bug)."""
    if not isinstance(reply, kind):
        raise TransferProcessError(f"expected a {kind.__name__} reply, got {reply!r}")
    return reply


class Pending:
    """A command sent to a transfer process whose reply has not been read yet."""

    def __init__(self, handle: TransferProcessHandle, rid: int, command: Command) -> None:
        self.handle = handle
        self.rid = rid
        self.command = command

    def result(
        self, timeout_s: float, on_event: Callable[[SourcesReleased], None] | None = None
    ) -> Reply:
        return self.handle._wait(self.rid, self.command, timeout_s, on_event)


class TransferProcessHandle:
    """Parent side of one transfer process (spawned at construction)."""

    def __init__(self, slot: int, device: str | None = None, start_timeout_s: float = 60.0) -> None:
        self.slot = slot
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
        self._lock = threading.Lock()
        self._replies: dict[int, list[Reply]] = {}
        self.send(Ping()).result(start_timeout_s)

    def send(self, command: Command) -> Pending:
        """Send a command now; read its reply later with .result(timeout)."""
        with self._lock:
            self._rid += 1
            rid = self._rid
            try:
                self._conn.send(Request(rid, command))
            except (OSError, BrokenPipeError) as e:
                raise TransferProcessError(
                    f"slot {self.slot}: transfer process is gone: {e}"
                ) from e
        return Pending(self, rid, command)

    def _wait(
        self,
        rid: int,
        command: Command,
        timeout_s: float,
        on_event: Callable[[SourcesReleased], None] | None,
    ) -> Reply:
        op = type(command).__name__.lower()
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                queued = self._replies.get(rid)
                body = queued.pop(0) if queued else None
                if body is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TransferProcessError(
                            f"slot {self.slot}: no answer to {op!r} within {timeout_s:.1f}s"
                        )
                    try:
                        if not self._conn.poll(min(left, 0.2)):
                            continue
                        msg: Response = self._conn.recv()
                    except (EOFError, OSError) as e:
                        raise TransferProcessError(
                            f"slot {self.slot}: transfer process died during {op!r} "
                            f"(exit code {self.process.exitcode})"
                        ) from e
                    if msg.rid != rid:
                        self._replies.setdefault(msg.rid, []).append(msg.body)
                        continue
                    body = msg.body
            if isinstance(body, SourcesReleased):
                if on_event is not None:
                    on_event(body)
                continue
            if isinstance(body, Failed):
                if body.kind == "storage_moved":
                    raise StorageMovedError(f"slot {self.slot}: {body.error}")
                raise TransferProcessError(f"slot {self.slot}: {op} failed: {body.error}")
            return body

    def _call(self, command: Command, timeout_s: float) -> Reply:
        return self.send(command).result(timeout_s)

    # ---------------------------------------------------------------- commands
    def connect(
        self,
        epoch: int,
        store_host: str,
        store_port: int,
        rank: int,
        world_size: int,
        transport: str,
        timeout_s: float,
        slot_ranks: dict[int, int] | None = None,
        store_token: str = "",
        wait: bool = True,
        data_plane_address: str = "",
        data_plane_interface: str = "",
    ) -> Pending | None:
        """Join the refit communicator of `epoch` (all ranks must connect concurrently:
        pass wait=False and call .result() on each); peers reach this rank at the agent's
        data-plane address (or interface)."""
        cmd = Connect(
            epoch,
            store_host,
            store_port,
            rank,
            world_size,
            transport,
            timeout_s,
            slot_ranks,
            store_token,
            data_plane_address,
            data_plane_interface,
        )
        return self.connect_with(cmd, wait)

    def connect_with(self, cmd: Connect, wait: bool = True) -> Pending | None:
        p = self.send(cmd)
        if not wait:
            return p
        p.result(cmd.timeout_s + 10.0)
        return None

    def load(
        self,
        digest: str,
        program: bytes,
        handles: dict[int, bytes],
        staging_bytes: int | None = None,
        timeout_s: float = 60.0,
        wire_chunk: int | None = None,
        staged_chunk: int | None = None,
        staged: list[int] | None = None,
        model: str = "",
        snapshot: list[int] | None = None,
        snapshot_bytes: int | None = None,
    ) -> Loaded:
        """Cache a slot program and the memory handles of its tensors under `digest`.

        wire_chunk and staged_chunk must be the same on every slot of a plan (defaults:
        executor.ExecutorConfig's). `staged`: plan tensor indices written into staging
        buffers (allocated here; those of the model's older plans are freed) and copied
        in place by `apply`. `snapshot`: source tensors to copy into a snapshot before the
        trainer is released (at most snapshot_bytes per slot, else live reads; the reply's
        `snapshot` says which).
        """
        cmd = Load(
            digest,
            program,
            handles,
            staging_bytes,
            wire_chunk,
            staged_chunk,
            tuple(staged or ()),
            model,
            tuple(snapshot or ()),
            snapshot_bytes,
        )
        return self.load_with(cmd, timeout_s)

    def load_with(self, cmd: Load, timeout_s: float) -> Loaded:
        return expect(self._call(cmd, timeout_s), Loaded)

    def apply(self, digest: str, refit_id: int, timeout_s: float) -> Applied:
        """Copy the staged tensors of `digest` in place (bytes, seconds); refused unless
        the last execute of that plan was refit_id's and completed."""
        return expect(self._call(Apply(digest, refit_id), timeout_s), Applied)

    def unload(self, digest: str, timeout_s: float = 30.0) -> bool:
        return expect(self._call(Unload(digest), timeout_s), Unloaded).unloaded

    def start_execute(
        self,
        digest: str,
        version: int,
        refit_id: int,
        timeout_s: float,
        verify: bool = False,
        delta: DeltaPlan | None = None,
    ) -> Pending:
        return self.send(Execute(digest, version, refit_id, timeout_s, verify, delta))

    def execute(
        self,
        digest: str,
        version: int,
        refit_id: int,
        timeout_s: float,
        on_sources_released: Callable[[], None] | None = None,
        verify: bool = False,
        delta: DeltaPlan | None = None,
    ) -> Executed:
        """Run one refit of a loaded plan; its report (with verify, its checksums; with
        delta, the delta path's part)."""
        p = self.start_execute(digest, version, refit_id, timeout_s, verify, delta)
        return wait_execute(p, timeout_s, on_sources_released)

    def abort(self, timeout_s: float = 10.0, refit_id: int = 0) -> None:
        """Ask a running refit to stop (its execute then fails); with refit_id, an execute of
        that refit that arrives later fails at once."""
        self._call(Abort(refit_id), timeout_s)

    def probe(
        self,
        timeout_s: float = 600.0,
        sends: dict[int, tuple[int, int]] | None = None,
        recvs: dict[int, tuple[int, int]] | None = None,
        memcpy: int | None = None,
        repeat: int = 1,
        device: str = "cpu",
        prepare: bool = False,
        release: bool = False,
    ) -> Pending:
        """Raw reference for benchmarks (commands.Probe); the reply is Probed or Ack."""
        cmd = Probe(timeout_s, sends or {}, recvs or {}, memcpy, repeat, device, prepare, release)
        return self.send(cmd)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the process (killed if it does not exit within timeout_s)."""
        if self.process.is_alive():
            with contextlib.suppress(TransferProcessError, StorageMovedError):
                self._call(Close(), timeout_s)
            self.process.join(timeout_s)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(timeout_s)
        self._conn.close()


def wait_execute(
    pending: Pending, timeout_s: float, on_sources_released: Callable[[], None] | None = None
) -> Executed:
    """The reply of a started execute (with a margin over the refit's own timeout)."""

    def event(_: SourcesReleased) -> None:
        if on_sources_released is not None:
            on_sources_released()

    return expect(pending.result(timeout_s + 10.0, event), Executed)
