"""What trainer and inference workers share: registration, shared memory, heartbeats.

A worker registers its tensors once; their CPU storages move into shared memory in place
(the same tensor objects, now readable and writable by the node agent's transfer process).
If the controller forgets the worker (restart) the worker registers again by itself; if a
tensor's storage moved, `refresh()` registers the moved tensors again.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from refitd._proto import refitd_pb2 as pb
from refitd.client.tensors import LocalTensor, MegatronCoords, collect
from refitd.limits import raise_nofile_limit
from refitd.memory.arena import SharedTensorArena
from refitd.memory.handles import MemoryHandle
from refitd.plan.wire import storage_data_shape
from refitd.rpc.connection import Backoff, ControllerConnection, RefitError
from refitd.rpc.process import register_rank

log = logging.getLogger(__name__)

_SCALES = "#scales"  # arena name suffix of a quantized buffer's scales
_GLOBAL_SCALE = "#global_scale"  # ... and of an nvfp4 buffer's global scale


@dataclass(frozen=True, slots=True)
class Registration:
    """What the controller answered to a registration."""

    worker_id: str
    epoch: int
    current_version: int
    slot: int
    heartbeat_interval_s: float


class WorkerClient:
    """Base of TrainerClient and InferenceClient (not used directly)."""

    ROLE = pb.ROLE_UNSPECIFIED

    def __init__(
        self,
        controller: str,
        model: str,
        pool: str,
        rank: int,
        pool_size: int,
        device: str = "cpu:0",
        host: str | None = None,
        rpc_timeout_s: float = 30.0,
        connect_timeout_s: float = 30.0,
    ) -> None:
        if not 0 <= rank < pool_size:
            raise ValueError(f"rank {rank} outside pool {pool!r} of size {pool_size}")
        self.model = model
        self.pool = pool
        self.rank = rank
        self.pool_size = pool_size
        self.device = device
        self.host = host or socket.gethostname()
        self.connect_timeout_s = connect_timeout_s
        raise_nofile_limit()  # sockets and shared-memory segments count against it
        self._conn = ControllerConnection(controller, rpc_timeout_s)
        self._arena = SharedTensorArena(prefix=f"refitd-{pool}-{rank}")
        self._tensors: list[LocalTensor] = []
        self._handles: dict[str, MemoryHandle] = {}
        self._registration: Registration | None = None
        self._lock = threading.RLock()
        self._closed = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self.staged = False  # InferenceClient(staged=True): the pool refits through staging
        self.snapshot = False  # TrainerClient(snapshot=True): released after a local snapshot
        self.adapter = False  # InferenceClient.register_adapter: refits land in a spare slot

    # ------------------------------------------------------------------ registration
    @property
    def worker_id(self) -> str:
        return self.registration.worker_id

    @property
    def registration(self) -> Registration:
        if self._registration is None:
            raise RefitError(f"{self._who()}: register() has not been called")
        return self._registration

    def register(
        self, tensors: torch.nn.Module | Mapping[str, Any], coords: MegatronCoords | None = None
    ) -> Registration:
        """Register the tensors (module, name -> tensor/DTensor/Placed) with the controller.

        CPU storages move into shared memory in place: keep using the same tensor objects.
        coords gives the Megatron TP/EP coordinates and PP layer offset of this rank.
        """
        local = collect(tensors, coords, self._who())
        self._conn.wait_ready(self.connect_timeout_s)
        with self._lock:
            handles = self._share(local)
            self._tensors = local
            self._handles = handles
            reg = self._send_registration()
        if self._heartbeat is None:
            self._heartbeat = threading.Thread(
                target=self._heartbeat_loop,
                name=f"refitd-heartbeat-{self.pool}-{self.rank}",
                daemon=True,
            )
            self._heartbeat.start()
        return reg

    def _share(self, local: list[LocalTensor]) -> dict[str, MemoryHandle]:
        """Arena handles of the tensors; a quantized buffer's scales (and nvfp4 global
        scale) ride in its handle."""
        arrays = {t.name: t.tensor for t in local}
        arrays.update({t.name + _SCALES: t.scales for t in local if t.scales is not None})
        arrays.update(
            {t.name + _GLOBAL_SCALE: t.global_scale for t in local if t.global_scale is not None}
        )
        handles = self._arena.register(arrays)
        for t in local:
            if t.scales is not None:
                sc = handles.pop(t.name + _SCALES)
                gs = handles.pop(t.name + _GLOBAL_SCALE, None)
                handles[t.name] = dataclasses.replace(handles[t.name], scales=sc, global_scale=gs)
        return handles

    def moved_tensors(self) -> list[str]:
        """Registered tensors whose storage moved since registration (marked stale)."""
        with self._lock:
            return self._arena.check_unmoved()

    def refresh(self) -> list[str]:
        """Register again the tensors whose storage moved; returns their names."""
        with self._lock:
            moved = self._arena.check_unmoved()
            if not moved:
                return []
            by_name = {t.name: t for t in self._tensors}
            moved = list(
                dict.fromkeys(n.removesuffix(_SCALES).removesuffix(_GLOBAL_SCALE) for n in moved)
            )
            for name in moved:
                t = by_name[name].tensor
                want = storage_data_shape(by_name[name].storage, by_name[name].layout.local_shape)
                if tuple(t.shape) != want:
                    raise RefitError(
                        f"{self._who()}: tensor {name!r} changed shape to {tuple(t.shape)} "
                        f"(registered {want}); call register() with its new placement"
                    )
            self._handles.update(self._share([by_name[n] for n in moved]))
            self._send_registration()
            log.info("%s: registered again after storage moved: %s", self._who(), moved)
            return moved

    def _send_registration(self, held_version: int = 0, paused_refit_id: int = 0) -> Registration:
        req = pb.RegisterWorkerRequest(
            model=self.model,
            pool=self.pool,
            role=self.ROLE,
            rank=self.rank,
            pool_size=self.pool_size,
            host=self.host,
            device=self.device,
            pid=os.getpid(),
            tensors=[self._tensor_pb(t) for t in self._tensors],
            worker_id=self._registration.worker_id if self._registration else "",
            held_version=held_version,
            paused_refit_id=paused_refit_id,
            staged=self.staged,
            snapshot=self.snapshot,
            adapter=self.adapter,
        )
        # A restart on the host of its rank's former holder takes the rank over at once
        # once it finds the holder gone (refitd.rpc.process).
        register = functools.partial(register_rank, self._conn.refit.RegisterWorker)
        resp = self._conn.call(register, req, f"register {self._who()}")
        self._registration = Registration(
            worker_id=resp.worker_id,
            epoch=resp.epoch,
            current_version=resp.current_version,
            slot=resp.slot,
            heartbeat_interval_s=resp.heartbeat_interval_s or 1.0,
        )
        return self._registration

    def _tensor_pb(self, t: LocalTensor) -> pb.TensorRegistration:
        return pb.TensorRegistration(
            name=t.name,
            canonical=t.canonical,
            global_shape=t.global_shape,
            dtype=t.dtype,
            local_shape=t.layout.local_shape,
            boxes=[
                pb.Box(offset=b.offset, shape=b.shape, local_offset=b.local_offset)
                for b in t.layout.boxes
            ],
            storage=t.storage,
            memory=self._handles[t.name].to_bytes(),
            meta=dict(t.meta),
        )

    def reregister(self) -> Registration:
        """Send the current registration again (after the controller forgot this worker),
        with the version its memory holds (so the controller does not send it again)."""
        with self._lock:
            # The registration (and worker_id) stays readable meanwhile: the subscription
            # and Refit threads use it, and the controller takes the id back.
            return self._send_registration(self._held_version(), self._paused_refit_id())

    def _held_version(self) -> int:
        """Committed version the registered memory holds intact (0: none or unknown)."""
        return 0

    def _paused_refit_id(self) -> int:
        """Refit whose PAUSE this worker is still in (0: none): after a controller restart
        the controller tells it how that refit ended."""
        return 0

    # ------------------------------------------------------------------ liveness
    def _heartbeat_loop(self) -> None:
        backoff = Backoff()
        while not self._closed.is_set():
            interval = self._registration.heartbeat_interval_s if self._registration else 1.0
            if self._closed.wait(interval):
                return
            if self._lease_by_stream():
                continue
            try:
                self._conn.call(
                    self._conn.refit.Heartbeat,
                    pb.HeartbeatRequest(worker_id=self.worker_id),
                    "heartbeat",
                    timeout_s=max(interval * 5, 2.0),
                )
                backoff.reset()
            except RefitError as err:
                if self._closed.is_set():
                    return
                if err.code == grpc.StatusCode.NOT_FOUND:
                    self._try_reregister()
                else:
                    log.debug("%s: %s", self._who(), err)
                    backoff.wait(self._closed)

    def _lease_by_stream(self) -> bool:
        """True while an open server stream keeps this worker's lease (no heartbeat needed:
        the controller counts the stream, and gRPC keepalive watches the connection)."""
        return False

    def _try_reregister(self) -> None:
        try:
            self.reregister()
            log.warning("%s: controller had forgotten this worker; registered again", self._who())
        except RefitError as err:
            log.warning("%s: registering again failed: %s", self._who(), err)

    # ------------------------------------------------------------------ lifecycle
    def close(self, unregister: bool = True) -> None:
        """Unregister, stop heartbeats and release the shared memory."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._stop_streams()
        if unregister and self._registration is not None:
            try:
                self._conn.call(
                    self._conn.refit.UnregisterWorker,
                    pb.UnregisterWorkerRequest(worker_id=self._registration.worker_id),
                    "unregister",
                    timeout_s=5.0,
                )
            except RefitError as err:
                log.debug("%s: %s", self._who(), err)
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5.0)
        self._arena.close()
        self._conn.close()

    def _stop_streams(self) -> None:
        """Cancel long-lived calls (subclasses with streams override this)."""

    def __enter__(self) -> WorkerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _who(self) -> str:
        return f"model {self.model!r} pool {self.pool!r} rank {self.rank}"
