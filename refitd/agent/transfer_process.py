"""One OS process per device slot, driven by its node agent over a multiprocessing Pipe.

The process holds the slot's rank of the refit communicator, maps worker memory, and keeps
programs, mappings and prepared executors cached per plan digest, so a cached-plan refit is
one `execute` command. Commands (dicts with an "op" and a request id "rid"):
connect, load, unload, execute (emits an intermediate "sources_released" event), apply
(staged tensors: staging -> live), abort, probe (raw link/memcpy reference for
benchmarks), close. Every reply carries the rid it
answers; errors come back as {"ok": False, "kind", "error"} and are raised in the parent.

`TransferProcessHandle` is the parent side: one method per command, each with a timeout.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch

from refitd.agent.executor import (
    DEFAULT_STAGING_BYTES,
    WIRE_CHUNK,
    ExecReport,
    ExecutionError,
    Executor,
    ExecutorConfig,
)
from refitd.agent.segments import ResolvedTensor
from refitd.agent.snapshot import Snapshot, SnapshotResolver, prepare_snapshot
from refitd.limits import raise_nofile_limit
from refitd.plan.layout import PLAIN
from refitd.plan.program import STORAGES, ProgramError, SlotProgram
from refitd.transport.base import ConnectInfo, Transport, TransportError, create_transport
from refitd.transport.memory import (
    LivenessCheck,
    MemoryHandle,
    MemoryMapper,
    StorageMovedError,
    check_live_words,
    liveness_check,
    shared_buffer,
)

DEFAULT_SNAPSHOT_BYTES = 2 << 30


class TransferProcessError(RuntimeError):
    """A command failed in the transfer process, or the process did not answer in time."""


@dataclass
class MappedResolver:
    """Plan tensor index -> worker memory mapped in this process (via a shared MemoryMapper).

    Staged tensors (a staged pool's destinations) resolve to staging buffers this process
    owns, so the executor and relays write and forward them unchanged; `apply` copies them
    into the live memory. They are allocated by `stage` (at program load) as copies of the
    live tensors, so regions a refit does not write keep their live values.
    """

    mapper: MemoryMapper
    handles: dict[int, MemoryHandle]
    storages: dict[int, str]
    staged: frozenset[int] = frozenset()
    _cache: dict[int, ResolvedTensor] = field(default_factory=dict)
    _staging: dict[int, ResolvedTensor] = field(default_factory=dict)
    _checks: dict[tuple[int, ...], LivenessCheck] = field(default_factory=dict)

    def resolve(self, index: int) -> ResolvedTensor:
        if index in self.staged:
            return self._staging[index]
        return self.live(index)

    def stage(self) -> None:
        """Allocate the staging buffers: same shape, dtype, storage and device as live."""
        for i in sorted(self.staged):
            t = self.live(i)
            scales = None if t.scales is None else t.scales.clone()
            self._staging[i] = ResolvedTensor(t.name, t.data.clone(), scales, t.storage)

    def apply(self) -> int:
        """Copy every staging buffer into its live tensor; returns the bytes copied."""
        self.check(self.staged)
        n = 0
        for i in sorted(self.staged):
            live, st = self.live(i), self._staging[i]
            live.data.copy_(st.data)
            n += st.data.numel() * st.data.element_size()
            if live.scales is not None and st.scales is not None:
                live.scales.copy_(st.scales)
                n += st.scales.numel() * st.scales.element_size()
        return n

    def live(self, index: int) -> ResolvedTensor:
        """The worker memory of plan tensor `index`, mapped on first use."""
        t = self._cache.get(index)
        if t is None:
            h = self.handles.get(index)
            if h is None:
                raise ExecutionError(f"no memory handle was loaded for plan tensor {index}")
            scales = None if h.scales is None else self.mapper.map_handle(h.scales)
            t = ResolvedTensor(
                h.name, self.mapper.map_handle(h), scales, self.storages.get(index, PLAIN)
            )
            self._cache[index] = t
        return t

    def check(self, indices: Any) -> None:
        key = tuple(indices)
        prepared = self._checks.get(key)
        if prepared is None:
            prepared = liveness_check([self.handles[i] for i in key if i in self.handles])
            self._checks[key] = prepared
        check_live_words(self.mapper, prepared)


@dataclass
class _Loaded:
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


class _TransferState:
    """Everything a transfer process holds between commands."""

    def __init__(self, conn: Connection, slot: int | None = None) -> None:
        self.conn = conn
        self.slot = slot
        self.send_lock = threading.Lock()
        self.mapper = MemoryMapper()
        self.transport: Transport | None = None
        self.slot_ranks: dict[int, int] | None = None
        self.loaded: dict[str, _Loaded] = {}
        self.abort = threading.Event()
        self.running: threading.Thread | None = None
        self.busy = threading.Event()
        self.aborted: dict[int, None] = {}  # refit ids aborted (latest 64), even before execute
        self.probe_bufs: dict[tuple[str, int], torch.Tensor] = {}

    def reply(self, msg: dict) -> None:
        with self.send_lock:
            self.conn.send(msg)

    def connect(self, cmd: dict) -> dict:
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        for entry in self.loaded.values():
            entry.executor = None
        transport = create_transport(cmd["transport"])
        transport.connect(
            ConnectInfo(
                epoch=cmd["epoch"],
                store_host=cmd["store_host"],
                store_port=cmd["store_port"],
                rank=cmd["rank"],
                world_size=cmd["world_size"],
                timeout_s=cmd["timeout_s"],
                store_token=cmd.get("store_token", ""),
                local_address=cmd.get("data_plane_address", ""),
                local_interface=cmd.get("data_plane_interface", ""),
            )
        )
        self.transport = transport
        self.slot_ranks = cmd.get("slot_ranks")
        return {}

    def load(self, cmd: dict) -> dict:
        try:
            program = SlotProgram.from_bytes(cmd["program"], self.slot)
        except ProgramError as e:
            raise ExecutionError(f"cannot load the program of plan {cmd['digest']!r}: {e}") from e
        if program.digest != cmd["digest"]:
            raise ExecutionError(f"program digest {program.digest!r} != {cmd['digest']!r}")
        # The program lists tensors of other slots too; only this slot's are staged here.
        table = program.table  # the tensors held on this slot
        mine = set(table.index.tolist())
        staged = frozenset(i for i in map(int, cmd.get("staged") or ()) if i in mine)
        raw = {int(i): b for i, b in cmd["handles"].items()}
        wanted = tuple(sorted(int(i) for i in cmd.get("snapshot") or ()))
        cap = cmd.get("snapshot_bytes")
        cap = DEFAULT_SNAPSHOT_BYTES if cap is None else int(cap)
        old = self.loaded.get(cmd["digest"])
        if (
            old is not None
            and old.source == (cmd["program"], raw)
            and old.resolver.staged == staged
            and old.snapshot_request == (wanted, cap)
        ):
            # Reloaded after a reconnect: keep the mappings and the staging buffers (a
            # filled staging is what a retried apply copies).
            old.executor = None
            return {}
        model = cmd.get("model") or ""
        if staged:
            # A newer plan of the model (a new membership epoch: the old digest never runs
            # again) replaces the staging buffers of the older ones, which are freed first.
            for digest, entry in list(self.loaded.items()):
                if entry.model == model and entry.resolver.staged:
                    del self.loaded[digest]
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
        config = ExecutorConfig(
            staging_bytes=cmd.get("staging_bytes") or DEFAULT_STAGING_BYTES,
            wire_chunk=cmd.get("wire_chunk") or WIRE_CHUNK,
            staged_chunk=cmd.get("staged_chunk"),
        )
        snapshot = prepare_snapshot(program, resolver, wanted, cap) if wanted else None
        entry = _Loaded(
            program,
            resolver,
            config,
            source=(cmd["program"], raw),
            model=model,
            snapshot=snapshot,
            snapshot_request=(wanted, cap),
        )
        for other in list(self.loaded.values()):
            # a newer plan of the same layout (a new epoch) keeps the sender's delta base
            if other.model == model and other.delta is not None and _same_sends(other, program):
                entry.delta = (None, other.delta[1])
                other.delta = None
        self.loaded[cmd["digest"]] = entry
        return {} if snapshot is None else {"snapshot": snapshot.to_dict()}

    def apply(self, cmd: dict) -> dict:
        """Copy the staging buffers of a loaded plan into live memory (a staged pool is
        paused); only when they hold, in full, what the execute of cmd["refit_id"] wrote."""
        entry = self.loaded.get(cmd["digest"])
        if entry is None:
            raise ExecutionError(
                f"plan {cmd['digest']!r} is not loaded in this transfer process: its staging "
                "buffers are gone"
            )
        if self.busy.is_set():
            raise ExecutionError("cannot apply while a refit is running on this slot")
        if entry.filled != cmd["refit_id"]:
            raise ExecutionError(
                f"staging buffers hold refit {entry.filled}, not refit {cmd['refit_id']}: "
                "nothing applied"
            )
        t0 = time.monotonic()
        n = entry.resolver.apply()
        for dev in {entry.resolver.resolve(i).data.device for i in entry.resolver.staged}:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        return {"bytes": n, "seconds": time.monotonic() - t0}

    def executor(self, digest: str) -> Executor:
        entry = self.loaded.get(digest)
        if entry is None:
            raise ExecutionError(f"plan {digest!r} is not loaded in this transfer process")
        if entry.executor is None:
            snap = entry.snapshot
            resolver: Any = entry.resolver
            device = None
            if snap is not None and snap.active:
                resolver = SnapshotResolver(entry.resolver, snap)
                live = [entry.resolver.resolve(i).data for i in sorted(snap.indices)[:1]]
                device = live[0].device if live else None
            entry.executor = Executor(
                entry.program,
                resolver,
                self.transport,
                self.slot_ranks,
                entry.config,
                device=device,
            )
        return entry.executor

    def abort_refit(self, refit_id: int) -> None:
        """Stop the running execute; with a refit id, also any later execute of that refit.

        A running execute may be blocked in a transfer wait on a dead peer: the communicator
        is closed to unblock it (the controller reconnects every slot after an abort)."""
        if refit_id:
            self.aborted[refit_id] = None
            while len(self.aborted) > 64:
                del self.aborted[next(iter(self.aborted))]
        self.abort.set()
        if self.busy.is_set() and self.transport is not None:
            transport, self.transport = self.transport, None
            for entry in self.loaded.values():
                entry.executor = None
            with contextlib.suppress(Exception):
                transport.close()

    def execute(self, cmd: dict) -> None:
        rid = cmd["rid"]
        if cmd.get("refit_id") in self.aborted:
            self.reply(_error(rid, ExecutionError(f"refit {cmd['refit_id']} was aborted")))
            return
        self.abort.clear()

        def released() -> None:
            self.reply({"rid": rid, "event": "sources_released", "t": time.time()})

        entry = self.loaded.get(cmd["digest"])
        if entry is not None:
            entry.filled = None  # the staging is being overwritten

        def body() -> None:
            try:
                t0 = time.monotonic()
                snap = entry.snapshot if entry is not None else None
                on_released: Callable[[], None] | None = released
                if snap is not None and snap.active:
                    # the trainer is released after a local copy (snapshot.py)
                    entry.resolver.check(snap.checked)  # type: ignore[union-attr]
                    snap.capture()
                    released_s = time.monotonic() - t0
                    released()
                    on_released = None
                ex = self.executor(cmd["digest"])
                delta = cmd.get("delta")
                skip: frozenset[int] = frozenset()
                drep = None
                if delta and entry is not None:  # reads the snapshot when there is one
                    drep = self.run_delta(entry, ex, delta, cmd)
                    skip = frozenset(delta["send"]) | frozenset(delta["recv"])
                report: ExecReport = ex.run(
                    cmd["timeout_s"], on_released, self.abort, verify=bool(cmd.get("verify")),
                    skip=skip,
                )  # fmt: skip
                if entry is not None and not self.abort.is_set():
                    entry.filled = cmd.get("refit_id")
                out = report.to_dict()
                if drep is not None:
                    out["delta"] = drep
                    out["sent_bytes"] += drep["wire_bytes"]
                    out["recv_bytes"] += drep["recv_bytes"]
                    if out.get("checksums") is not None:
                        out["checksums"]["send"].update(drep.pop("send_sums"))
                        out["checksums"]["recv"].update(drep.pop("recv_sums"))
                out.update(version=cmd.get("version"), refit_id=cmd.get("refit_id"))
                if snap is not None:
                    out["snapshot"] = snap.to_dict()
                    if snap.active:
                        out["sources_released_s"] = released_s
                        out["seconds"] = time.monotonic() - t0
                reply = {"rid": rid, "ok": True, "report": out}
            except BaseException as e:
                reply = _error(rid, e)
            self.busy.clear()
            self.reply(reply)

        self.busy.set()
        self.running = threading.Thread(target=body, name="refitd-execute", daemon=True)
        self.running.start()

    def run_delta(self, entry: _Loaded, ex: Executor, delta: dict, cmd: dict) -> dict:
        """This slot's messages of the delta path (refitd.agent.delta_exchange), before the
        executor runs the others: promote the base the controller reports committed, then
        exchange; returns what the controller records."""
        from refitd.agent.delta_access import ProgramAccess
        from refitd.agent.delta_exchange import DeltaBase, run_delta

        if self.transport is None:
            raise ExecutionError("delta refit: no connected transport")
        if entry.delta is None or entry.delta[0] is None:
            ranks = self.slot_ranks
            resolver = ex.resolver  # sources from the snapshot when the slot takes one
            access = ProgramAccess(
                entry.program, resolver.resolve, lambda s: s if ranks is None else ranks[s]
            )
            entry.delta = (access, DeltaBase() if entry.delta is None else entry.delta[1])
        access, base = entry.delta
        promoted = base.promote(int(delta["promote"]), access) if delta["promote"] >= 0 else False
        t0 = time.monotonic()
        rep = run_delta(
            self.transport,
            access.messages("send", delta["send"]),
            access.messages("recv", delta["recv"]),
            access,
            base,
            int(cmd.get("version") or 0),
            allowed=frozenset(delta["allowed"]),
            max_density=float(delta["max_density"]),
            deadline=t0 + float(cmd["timeout_s"]),
            wire_chunk=entry.config.wire_chunk,
            verify=bool(cmd.get("verify")),
        )
        return {
            "promoted": promoted,
            "base_version": base.version,
            "pending_version": base.pending_version,
            "base_bytes": base.nbytes,
            "sent": rep.sent,
            "received": rep.received,
            "encode_s": rep.encode_s,
            "apply_s": rep.apply_s,
            "seconds": rep.seconds,
            "wire_bytes": rep.wire_bytes,
            "recv_bytes": sum(m["nbytes"] for m in rep.received.values()),
            "send_sums": rep.send_sums,
            "recv_sums": rep.recv_sums,
        }

    def probe(self, cmd: dict) -> dict:
        """Raw reference for benchmarks, in seconds: per peer one large contiguous buffer
        sent (or received) `repeat` times ({"sends"/"recvs": {rank: [nbytes, repeat]}}), or
        one large memcpy ({"memcpy": nbytes, "repeat": n}). "prepare" only allocates (and
        drops other buffers); buffers live until {"release": True}, so freeing them is never
        timed."""
        if cmd.get("release"):
            self.probe_bufs.clear()
            return {}
        if "memcpy" in cmd:
            n, repeat = cmd["memcpy"], cmd.get("repeat", 1)
            dev = torch.device(cmd.get("device", "cpu"))
            if cmd.get("prepare"):
                self.probe_bufs = {k: v for k, v in self.probe_bufs.items() if k[0] == "m"}
            a = self.probe_bufs.get(("m", 0))
            if a is None or a.numel() != n or a.device != dev:
                a = self.probe_bufs[("m", 0)] = _probe_buffer(n, dev)
                self.probe_bufs[("m", 1)] = _probe_buffer(n, dev)
            b = self.probe_bufs[("m", 1)]
            if cmd.get("prepare"):
                return {}
            t0 = time.monotonic()
            for _ in range(repeat):
                b.copy_(a)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            return {"seconds": time.monotonic() - t0}
        if self.transport is None:
            raise TransportError("probe needs a connected transport")
        want = [("s", int(p), n, r) for p, (n, r) in cmd["sends"].items()]
        want += [("r", int(p), n, r) for p, (n, r) in cmd["recvs"].items()]
        if cmd.get("prepare"):
            keep = {(kind, peer) for kind, peer, _, _ in want}
            self.probe_bufs = {k: v for k, v in self.probe_bufs.items() if k in keep}
        for kind, peer, n, _ in want:
            buf = self.probe_bufs.get((kind, peer))
            if buf is None or buf.numel() != n:
                self.probe_bufs[(kind, peer)] = _probe_buffer(n, torch.device("cpu"))
        if cmd.get("prepare"):
            return {}
        t0 = time.monotonic()
        works = []
        for k in range(max((w[3] for w in want), default=0)):
            for kind, peer, _, repeat in want:
                if k >= repeat:
                    continue
                buf = self.probe_bufs[(kind, peer)]
                tag = 0x7FFF0000 + k
                if kind == "s":
                    works.append(self.transport.isend(buf, peer, tag))
                else:
                    works.append(self.transport.irecv(buf, peer, tag))
        for w in works:
            w.wait(cmd["timeout_s"] - (time.monotonic() - t0))
        return {"seconds": time.monotonic() - t0}

    def close(self) -> None:
        self.abort.set()
        if self.running is not None:
            self.running.join(5)
        if self.transport is not None:
            self.transport.close()
        self.loaded.clear()
        self.mapper.close()


def _probe_buffer(n: int, dev: torch.device) -> torch.Tensor:
    """A probe buffer of ones; on the CPU in shared memory pages, like worker tensors."""
    if dev.type == "cpu":
        return shared_buffer(n).fill_(1)
    return torch.ones(n, dtype=torch.uint8, device=dev)


def _same_sends(old: _Loaded, program: SlotProgram) -> bool:
    """Whether a program sends the same copies of the same source tensors as a loaded one
    (the rows of the sender's delta base mean the same regions)."""
    if old.program.sends != program.sends:
        return False
    srcs = {c.src_tensor for m in program.sends for c in m.copies}
    return all(old.program.tensors.get(i) == program.tensors.get(i) for i in srcs)


def _error(rid: int, e: BaseException) -> dict:
    kind = "storage_moved" if isinstance(e, StorageMovedError) else type(e).__name__
    detail = f"{e}"
    if not isinstance(e, ExecutionError | StorageMovedError | TransportError):
        detail += "\n" + "".join(traceback.format_exception(e)[-3:])
    return {"rid": rid, "ok": False, "kind": kind, "error": detail}


def transfer_process_main(conn: Connection, slot: int, device: str | None) -> None:
    """Entry point of a transfer process: serve commands until close or the pipe closes."""
    raise_nofile_limit()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if device is not None and device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    state = _TransferState(conn, slot)
    handlers: dict[str, Callable[[dict], dict]] = {
        "connect": state.connect,
        "load": state.load,
        "unload": lambda c: {"unloaded": state.loaded.pop(c["digest"], None) is not None},
        "probe": state.probe,
        "apply": state.apply,
        "ping": lambda c: {"slot": slot},
    }
    while True:
        try:
            cmd = conn.recv()
        except (EOFError, OSError):
            break
        op, rid = cmd.get("op"), cmd.get("rid", 0)
        if op == "close":
            state.close()
            state.reply({"rid": rid, "ok": True})
            break
        if op == "abort":
            state.abort_refit(int(cmd.get("refit_id") or 0))
            state.reply({"rid": rid, "ok": True})
            continue
        if op == "execute":
            if state.busy.is_set():
                state.reply(_error(rid, ExecutionError("a refit is already running on this slot")))
            else:
                state.execute(cmd)
            continue
        handler = handlers.get(op)
        try:
            if handler is None:
                raise ExecutionError(f"unknown transfer-process command {op!r}")
            state.reply({"rid": rid, "ok": True, **handler(cmd)})
        except BaseException as e:
            state.reply(_error(rid, e))
    conn.close()


class Pending:
    """A command sent to a transfer process whose reply has not been read yet."""

    def __init__(self, handle: TransferProcessHandle, rid: int, op: str) -> None:
        self.handle = handle
        self.rid = rid
        self.op = op

    def result(self, timeout_s: float, on_event: Callable[[dict], None] | None = None) -> dict:
        return self.handle._wait(self.rid, self.op, timeout_s, on_event)


class TransferProcessHandle:
    """Parent side of one transfer process (spawned at construction)."""

    def __init__(self, slot: int, device: str | None = None, start_timeout_s: float = 60.0) -> None:
        self.slot = slot
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=transfer_process_main,
            args=(child, slot, device),
            name=f"refitd-transfer-slot{slot}",
            daemon=True,
        )
        self.process.start()
        child.close()
        self._rid = 0
        self._lock = threading.Lock()
        self._replies: dict[int, list[dict]] = {}
        self.request("ping").result(start_timeout_s)

    def request(self, op: str, **args: Any) -> Pending:
        """Send a command now; read its reply later with .result(timeout)."""
        with self._lock:
            self._rid += 1
            rid = self._rid
            try:
                self._conn.send({"op": op, "rid": rid, **args})
            except (OSError, BrokenPipeError) as e:
                raise TransferProcessError(
                    f"slot {self.slot}: transfer process is gone: {e}"
                ) from e
        return Pending(self, rid, op)

    def _wait(
        self, rid: int, op: str, timeout_s: float, on_event: Callable[[dict], None] | None
    ) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                queued = self._replies.get(rid)
                msg = queued.pop(0) if queued else None
                if msg is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TransferProcessError(
                            f"slot {self.slot}: no answer to {op!r} within {timeout_s:.1f}s"
                        )
                    try:
                        if not self._conn.poll(min(left, 0.2)):
                            continue
                        msg = self._conn.recv()
                    except (EOFError, OSError) as e:
                        raise TransferProcessError(
                            f"slot {self.slot}: transfer process died during {op!r} "
                            f"(exit code {self.process.exitcode})"
                        ) from e
                    if msg.get("rid") != rid:
                        self._replies.setdefault(msg.get("rid", -1), []).append(msg)
                        continue
            if "event" in msg:
                if on_event is not None:
                    on_event(msg)
                continue
            if not msg.get("ok"):
                if msg.get("kind") == "storage_moved":
                    raise StorageMovedError(f"slot {self.slot}: {msg['error']}")
                raise TransferProcessError(f"slot {self.slot}: {op} failed: {msg['error']}")
            return msg

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
        p = self.request(
            "connect",
            epoch=epoch,
            store_host=store_host,
            store_port=store_port,
            rank=rank,
            world_size=world_size,
            transport=transport,
            timeout_s=timeout_s,
            slot_ranks=slot_ranks,
            store_token=store_token,
            data_plane_address=data_plane_address,
            data_plane_interface=data_plane_interface,
        )
        if not wait:
            return p
        p.result(timeout_s + 10.0)
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
    ) -> dict:
        """Cache a slot program and the memory handles of its tensors under `digest`.

        wire_chunk and staged_chunk must be the same on every slot of a plan (defaults:
        executor.ExecutorConfig's). `staged`: plan tensor indices written into staging
        buffers (allocated here; those of the model's older plans are freed) and copied
        in place by `apply`. `snapshot`: source tensors to copy into a snapshot before the
        trainer is released (at most snapshot_bytes per slot, else live reads; the reply's
        "snapshot" says which).
        """
        return self.request(
            "load",
            digest=digest,
            program=program,
            handles=handles,
            staging_bytes=staging_bytes,
            wire_chunk=wire_chunk,
            staged_chunk=staged_chunk,
            staged=staged or [],
            model=model,
            snapshot=snapshot or [],
            snapshot_bytes=snapshot_bytes,
        ).result(timeout_s)

    def apply(self, digest: str, refit_id: int, timeout_s: float) -> dict:
        """Copy the staged tensors of `digest` in place ({"bytes", "seconds"}); refused
        unless the last execute of that plan was refit_id's and completed."""
        return self.request("apply", digest=digest, refit_id=refit_id).result(timeout_s)

    def unload(self, digest: str, timeout_s: float = 30.0) -> bool:
        return bool(self.request("unload", digest=digest).result(timeout_s)["unloaded"])

    def start_execute(
        self,
        digest: str,
        version: int,
        refit_id: int,
        timeout_s: float,
        verify: bool = False,
        delta: dict | None = None,
    ) -> Pending:
        return self.request(
            "execute",
            digest=digest,
            version=version,
            refit_id=refit_id,
            timeout_s=timeout_s,
            verify=verify,
            delta=delta,
        )

    def execute(
        self,
        digest: str,
        version: int,
        refit_id: int,
        timeout_s: float,
        on_sources_released: Callable[[], None] | None = None,
        verify: bool = False,
        delta: dict | None = None,
    ) -> dict:
        """Run one refit of a loaded plan; returns the ExecReport as a dict (with verify,
        its "checksums"; with delta, {"send", "recv", "allowed": message ids, "promote":
        version committed everywhere or -1, "max_density"}: the delta path's "delta")."""
        p = self.start_execute(digest, version, refit_id, timeout_s, verify, delta)
        return wait_execute(p, timeout_s, on_sources_released)

    def abort(self, timeout_s: float = 10.0, refit_id: int = 0) -> None:
        """Ask a running refit to stop (its execute then fails); with refit_id, an execute of
        that refit that arrives later fails at once."""
        self.request("abort", refit_id=refit_id).result(timeout_s)

    def probe(self, timeout_s: float = 600.0, **args: Any) -> Pending:
        return self.request("probe", timeout_s=timeout_s, **args)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the process (killed if it does not exit within timeout_s)."""
        if self.process.is_alive():
            with contextlib.suppress(TransferProcessError, StorageMovedError):
                self.request("close").result(timeout_s)
            self.process.join(timeout_s)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(timeout_s)
        self._conn.close()


def wait_execute(
    pending: Pending, timeout_s: float, on_sources_released: Callable[[], None] | None = None
) -> dict:
    """The report of a started execute (with a margin over the refit's own timeout)."""

    def event(msg: dict) -> None:
        if msg.get("event") == "sources_released" and on_sources_released is not None:
            on_sources_released()

    return pending.result(timeout_s + 10.0, event)["report"]
