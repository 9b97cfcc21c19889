"""What a transfer process holds between commands, and the method answering each command.

`TransferSlot` keeps the communicator, the memory mapper, and per plan digest the loaded
program, its mappings and staging buffers, its snapshot, its delta base and its prepared
executor (`LoadedPlan`). Its methods are the handlers the slot protocol's table names;
execute (run by the command loop on its own thread) is in execute.py, probe in probe.py.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from refitd.executor.chunks import WIRE_CHUNK
from refitd.executor.errors import ExecutionError
from refitd.executor.onesided import OneSidedLinks
from refitd.executor.run import Executor, ExecutorConfig
from refitd.executor.shares import LinkShares
from refitd.memory.handles import MemoryHandle
from refitd.memory.mapping import MemoryMapper
from refitd.plan.program import STORAGES, ProgramError, SlotProgram, decode_program
from refitd.slot_protocol import (
    Abort,
    Ack,
    Applied,
    Apply,
    Close,
    Connect,
    Connected,
    Execute,
    Executed,
    Load,
    Loaded,
    Ping,
    Pong,
    Probe,
    Probed,
    Unload,
    Unloaded,
)
from refitd.transfer.execute import execute_refit
from refitd.transfer.links import Exposures, attach, expose, make_path, republish
from refitd.transfer.mapped import MappedResolver
from refitd.transfer.probe import probe
from refitd.transfer.snapshot import Snapshot, SnapshotResolver, prepare_snapshot
from refitd.transport.base import ConnectInfo, Transport
from refitd.transport.factory import create_transport
from refitd.transport.gloo import open_store
from refitd.transport.paths import Links, OneSidedPath, PathSettings


@dataclass
class LoadedPlan:
    program: SlotProgram
    resolver: MappedResolver
    config: ExecutorConfig
    executor: Executor | None = None
    source: tuple[bytes, dict[int, bytes]] = (b"", {})  # program and handles as loaded
    model: str = ""
    filled: int | None = None  # refit id whose execute filled the staging buffers in full
    delta: Any = None  # (ProgramAccess, DeltaBase) of delta refits, made on first use
    snapshot: Snapshot | None = None  # snapshot release of this slot's sources (snapshot.py)
    snapshot_request: tuple[tuple[int, ...], int] = ((), 0)  # (tensors asked, cap) at load
    exposures: Exposures = field(default_factory=Exposures)  # one-sided receives (links.py)
    onesided: OneSidedLinks | None = None  # one-sided peers of the current executor

    def reset(self) -> None:
        """Drop the executor and the peers it wrote into (a new communicator or plan)."""
        self.executor = None
        if self.onesided is not None:
            self.onesided.close()
            self.onesided = None

    def close(self) -> None:
        """Release what the plan holds: peers, exposures (their doorbells retire), staging."""
        self.reset()
        self.exposures.close()
        self.resolver.close()


class TransferSlot:
    """Everything a transfer process holds between commands."""

    def __init__(self, slot: int | None = None) -> None:
        self.slot = slot
        self.mapper = MemoryMapper()
        self.transport: Transport | None = None
        self.links: Links | None = None  # one-sided paths of the communicator epoch
        self.slot_ranks: dict[int, int] | None = None
        self.loaded: dict[str, LoadedPlan] = {}
        self.aborting = threading.Event()  # set by abort: the running refits stop
        self.running: dict[int, str] = {}  # lane -> plan digest of the refit running there
        self.idle = threading.Event()  # none is: what close waits for
        self.idle.set()
        self.shares = LinkShares()  # the links' shares between refits of several models
        self.transport_kind = ""
        self._runs = threading.Lock()
        self.probe_bufs: dict[tuple[str, int], torch.Tensor] = {}
        # one-sided paths by (kind, settings), kept across communicator epochs (path())
        self.paths: dict[tuple[str, PathSettings], OneSidedPath] = {}
        self.closed = False

    def begin_refit(self, lane: int, digest: str) -> str | None:
        """Mark a refit of `digest` running on `lane`; why it cannot start, or None."""
        with self._runs:
            if lane in self.running:
                return f"a refit is already running on this slot in lane {lane}"
            if digest in self.running.values():
                return f"a refit of plan {digest!r} is already running on this slot"
            if not self.running:
                self.aborting.clear()  # an abort stops every refit running when it came
            self.running[lane] = digest
            self.idle.clear()
            return None

    def end_refit(self, lane: int) -> None:
        with self._runs:
            self.running.pop(lane, None)
            if not self.running:
                self.idle.set()

    def shares_of_links(self) -> LinkShares | None:
        """The links' gates where sends queue on shared connections (Gloo over TCP); NCCL
        sends go in the groups the executor posts them in, never split by a gate."""
        return self.shares if self.transport_kind == "gloo" else None

    def ping(self, cmd: Ping) -> Pong:
        return Pong(self.slot)

    def connect(self, cmd: Connect) -> Connected:
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        if self.links is not None:
            self.links.close()
            self.links = None
        for entry in self.loaded.values():
            entry.reset()
        info = ConnectInfo(
            epoch=cmd.epoch,
            store_host=cmd.store_host,
            store_port=cmd.store_port,
            rank=cmd.rank,
            world_size=cmd.world_size,
            timeout_s=cmd.timeout_s,
            store_token=cmd.store_token,
            local_address=cmd.data_plane_address,
            local_interface=cmd.data_plane_interface,
        )
        transport = create_transport(cmd.transport)
        self.transport_kind = cmd.transport
        transport.connect(info)
        self.transport = transport
        if cmd.store_port:  # a communicator with a rendezvous store: one-sided paths too
            settings = PathSettings(
                slot=self.slot if self.slot is not None else cmd.rank,
                host=cmd.data_plane_address or "127.0.0.1",
                rdma_protocol=cmd.rdma_protocol,
                rdma_devices=tuple(cmd.rdma_devices),
                rdma_landing_bytes=cmd.rdma_landing_bytes,
            )
            for key in [k for k in self.paths if k[1] != settings]:
                self.paths.pop(key).close()  # the agent's data plane or protocol changed
            self.links = Links(info, open_store, functools.partial(self.path, settings=settings))
            for entry in self.loaded.values():  # the loaded plans stay: no load follows
                republish(self.links, entry.exposures)
        self.slot_ranks = cmd.slot_ranks
        return Connected(tuple(self.loaded))

    def path(self, kind: str, settings: PathSettings) -> OneSidedPath:
        """This process's one-sided path of `kind`, kept across communicator epochs: a
        reconnect (after any failed refit) keeps the rdma path's engines, their connections
        to live peers and their registrations. Tearing engines down holds the interpreter
        for a second or more on a busy host, and new ones shake hands with every peer again."""
        key = (kind, settings)
        p = self.paths.get(key)
        if p is None:
            p = self.paths[key] = make_path(kind, settings)
        return p

    def load(self, cmd: Load) -> Loaded:
        try:
            program = decode_program(cmd.program, self.slot)
        except ProgramError as e:
            raise ExecutionError(f"cannot load the program of plan {cmd.digest!r}: {e}") from e
        if program.digest != cmd.digest:
            raise ExecutionError(f"program digest {program.digest!r} != {cmd.digest!r}")
        # The program lists tensors of other slots too; only this slot's are staged here.
        mine = set(program.table.index.tolist())  # the tensors held on this slot
        staged = frozenset(i for i in map(int, cmd.staged) if i in mine)
        raw = {int(i): b for i, b in cmd.handles.items()}
        wanted = tuple(sorted(int(i) for i in cmd.snapshot))
        cap = int(cmd.snapshot_bytes)
        old = self.loaded.get(cmd.digest)
        if (
            old is not None
            and old.source == (cmd.program, raw)
            and old.resolver.staged == staged
            and old.snapshot_request == (wanted, cap)
        ):
            # Loaded again as it is (its agent registered again, or a new controller): keep
            # the mappings and the staging buffers (a filled staging is what a retried apply
            # copies); exposures under the current epoch.
            old.reset()
            if self.links is not None:
                republish(self.links, old.exposures)
            return Loaded()
        if staged:
            # A newer plan of the model (a new membership epoch: the old digest never runs
            # again) replaces the staging buffers of the older ones, which are freed first.
            for digest, entry in list(self.loaded.items()):
                if entry.model == cmd.model and entry.resolver.staged:
                    self.loaded.pop(digest).close()
        entry = self._prepare(cmd, program, staged, raw, (wanted, cap))
        if old is not None:
            old.close()  # its doorbells retire: senders attached to it attach again
        for other in list(self.loaded.values()):
            # a newer plan of the same layout (a new epoch) keeps the sender's delta base
            if other.model == cmd.model and other.delta is not None and _same_sends(other, program):
                entry.delta = (None, other.delta[1])
                other.delta = None
        self.loaded[cmd.digest] = entry
        return Loaded(None if entry.snapshot is None else entry.snapshot.info())

    def _prepare(
        self,
        cmd: Load,
        program: SlotProgram,
        staged: frozenset[int],
        raw: dict[int, bytes],
        snapshot_request: tuple[tuple[int, ...], int],
    ) -> LoadedPlan:
        """A newly loaded plan: its tensors mapped, staging buffers and snapshot made."""
        table = program.table
        handles = {i: MemoryHandle.from_bytes(b) for i, b in raw.items()}
        storages = dict(
            zip(
                table.index.tolist(),
                [STORAGES[k] for k in table.storage.tolist()],
                strict=True,
            )
        )
        resolver = MappedResolver(self.mapper, handles, storages, staged)
        resolver.stage()
        try:
            exposures = expose(self.links, program, resolver, raw)
        except BaseException:
            resolver.close()
            raise
        config = ExecutorConfig(
            staging_bytes=cmd.staging_bytes,
            wire_chunk=cmd.wire_chunk or WIRE_CHUNK,
            staged_chunk=cmd.staged_chunk,
        )
        wanted, cap = snapshot_request
        return LoadedPlan(
            program,
            resolver,
            config,
            source=(cmd.program, raw),
            model=cmd.model,
            snapshot=prepare_snapshot(program, resolver, wanted, cap) if wanted else None,
            snapshot_request=snapshot_request,
            exposures=exposures,
        )

    def unload(self, cmd: Unload) -> Unloaded:
        entry = self.loaded.pop(cmd.digest, None)
        if entry is not None:
            entry.close()
        return Unloaded(entry is not None)

    def apply(self, cmd: Apply) -> Applied:
        """Copy the staging buffers of a loaded plan into live memory (a staged pool is
        paused); only when they hold, in full, what the execute of cmd.refit_id wrote."""
        entry = self.loaded.get(cmd.digest)
        if entry is None:
            raise ExecutionError(
                f"plan {cmd.digest!r} is not loaded in this transfer process: its staging "
                "buffers are gone"
            )
        if cmd.digest in self.running.values():
            raise ExecutionError("cannot apply while a refit of its plan is running on this slot")
        if entry.filled != cmd.refit_id:
            raise ExecutionError(
                f"staging buffers hold refit {entry.filled}, not refit {cmd.refit_id}: "
                "nothing applied"
            )
        t0 = time.monotonic()
        n = entry.resolver.apply()
        for dev in {entry.resolver.resolve(i).data.device for i in entry.resolver.staged}:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        return Applied(n, time.monotonic() - t0)

    def execute(self, cmd: Execute, released: Callable[[], None]) -> Executed:
        """One refit (on the command loop's refit thread); `released` sends SourcesReleased."""
        return execute_refit(self, cmd, released)

    def probe(self, cmd: Probe) -> Probed:
        return probe(self, cmd)

    def executor(self, digest: str) -> Executor:
        entry = self.loaded.get(digest)
        if entry is None:
            raise ExecutionError(f"plan {digest!r} is not loaded in this transfer process")
        if entry.onesided is not None and entry.onesided.stale():
            entry.reset()  # a destination loaded the plan again: attach to it afresh
        if entry.executor is None:
            snap = entry.snapshot
            resolver: Any = entry.resolver
            device = None
            if snap is not None and snap.active:
                resolver = SnapshotResolver(entry.resolver, snap)
                live = [entry.resolver.resolve(i).data for i in sorted(snap.indices)[:1]]
                device = live[0].device if live else None
            entry.reset()
            entry.onesided = attach(self.links, entry.program, entry.exposures)
            entry.executor = Executor(
                entry.program,
                resolver,
                self.transport,
                self.slot_ranks,
                entry.config,
                device=device,
                links=entry.onesided,
            )
        return entry.executor

    def abort(self, cmd: Abort) -> Ack:
        """Stop the running execute (the node agent refuses later executes of the refit).

        A running execute may be blocked in a transfer wait on a dead peer: the communicator
        is closed to unblock it (the controller reconnects every slot after an abort)."""
        self.aborting.set()
        if self.running and self.transport is not None:
            transport, self.transport = self.transport, None
            for entry in self.loaded.values():
                entry.executor = None  # its peers are closed by the next connect
            with contextlib.suppress(Exception):
                transport.close()
        return Ack()

    def close(self, cmd: Close) -> Ack:
        """Stop a running refit, drop every plan and mapping; the command loop then ends."""
        self.aborting.set()
        self.idle.wait(5)
        if self.transport is not None:
            self.transport.close()
        for entry in self.loaded.values():
            entry.close()
        self.loaded.clear()
        if self.links is not None:
            self.links.close()
        for p in self.paths.values():
            p.close()
        self.paths.clear()
        self.mapper.close()
        self.closed = True
        return Ack()


def _same_sends(old: LoadedPlan, program: SlotProgram) -> bool:
    """Whether a program sends the same copies of the same source tensors as a loaded one
    (the rows of the sender's delta base mean the same regions)."""
    if old.program.sends != program.sends:
        return False
    srcs = {c.src_tensor for m in program.sends for c in m.copies}
    return all(old.program.tensors.get(i) == program.tensors.get(i) for i in srcs)
