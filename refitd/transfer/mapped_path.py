"""`mapped`: one-sided writes between two slots of one host, through mapped memory (the
one-sided path kind of refitd.transport.paths that lives here, beside worker memory).

The destination exposes the tensors senders write by the memory handles a process on the
same host maps them with (worker tensors: the workers' shared-memory segments or CUDA IPC
handles; staging buffers of a staged pool: segments and handles of the destination's
transfer process) and a doorbell in a shared-memory page. A sender maps them (its own
`MemoryMapper`, dropped with the peer, so unloaded segments are unmapped), writes source
views straight into destination views with `torch._foreach_copy_` (strided regions in
place) and rings the doorbell. No socket carries same-host bytes.

A destination that dies mid-write does not stop its sender: the mappings stay valid until
the sender drops them. A sender that dies leaves the doorbell short: the destination waits
until the transfer deadline or the abort that follows.
"""

from __future__ import annotations

import msgpack
import numpy as np
import torch

from refitd.memory.errors import StorageMovedError
from refitd.memory.handles import MemoryHandle
from refitd.memory.mapping import MemoryMapper, PreparedLiveness
from refitd.memory.segment_names import new_segment_name
from refitd.memory.segments import Segment
from refitd.transport.doorbell import Doorbell
from refitd.transport.errors import TransportError
from refitd.transport.paths import Exposed, Exposure, OneSidedPath, Peer, RemoteTensor


class ShmDoorbell(Doorbell):
    """A doorbell in a shared-memory segment: created by the destination (`create`) or
    mapped by name by a sender (`open`)."""

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        raw = np.frombuffer(segment.buf, dtype=np.uint8)
        super().__init__(raw[: raw.size - raw.size % 8].view(np.int64))

    @classmethod
    def create(cls, entries: int, generation: int, prefix: str = "refitd-bell") -> ShmDoorbell:
        seg = Segment(new_segment_name(prefix), Doorbell.nbytes(entries), True)
        seg.reserve(0, seg.size)
        bell = cls(seg)
        bell.init(generation, entries)
        return bell

    @classmethod
    def open(cls, name: str) -> ShmDoorbell:
        return cls(Segment(name, 0, False))

    def close(self) -> None:
        """Retire and unlink (the creator); mappings elsewhere stay valid until dropped."""
        self.retire()
        self.segment.unlink()


class MappedExposure(Exposure):
    def __init__(self, body: bytes, doorbell: ShmDoorbell) -> None:
        self.body = body
        self.doorbell = doorbell

    def close(self) -> None:
        self.doorbell.close()


class MappedPeer(Peer):
    """A destination's tensors mapped in the sender (see the module docstring)."""

    def __init__(self, doorbell: ShmDoorbell, tensors: dict[int, tuple[bytes, str]], what: str):
        self.doorbell = doorbell
        self.what = what
        self._raw = tensors
        self._handles: dict[int, MemoryHandle] = {}
        self._mapped: dict[int, RemoteTensor] = {}
        self._live: PreparedLiveness | None = None  # of the handles mapped so far
        self.mapper = MemoryMapper()

    def tensor(self, index: int) -> RemoteTensor:
        t = self._mapped.get(index)
        if t is not None:
            return t
        raw = self._raw.get(index)
        if raw is None:
            raise TransportError(f"{self.what}: its descriptor exposes no tensor {index}")
        try:
            h = MemoryHandle.from_bytes(raw[0])
            data, scales, gscale = (
                None if part is None else self.mapper.map_handle(part)
                for part in (h, h.scales, h.global_scale)
            )
        except (StorageMovedError, ValueError, OSError) as e:
            raise TransportError(f"{self.what}: cannot map its tensor {index}: {e}") from e
        assert data is not None
        self._handles[index] = h
        self._live = None
        t = self._mapped[index] = RemoteTensor(h.name, data, scales, raw[1], gscale)
        return t

    def write(self, dst: list[torch.Tensor], src: list[torch.Tensor], deadline: float) -> None:
        if dst:
            torch._foreach_copy_(dst, src)

    def ring(self, entry: int, attempt: int, chunks: int) -> None:
        self.doorbell.ring(entry, attempt, chunks)

    def generation(self) -> int:
        return self.doorbell.generation

    def check_live(self) -> None:
        try:
            if self._live is None:
                self._live = PreparedLiveness.of(self.mapper, self._handles.values())
            else:
                self._live.check()
        except StorageMovedError as e:
            raise TransportError(f"{self.what}: {e}") from e

    def close(self) -> None:
        self._mapped.clear()
        self.mapper.close()


class MappedPath(OneSidedPath):
    kind = "mapped"

    def expose(
        self, tensors: dict[int, Exposed], entries: int, generation: int,
        landing: dict[int, int] | None = None,
    ) -> Exposure:  # fmt: skip
        """Mapped writes land strided regions in place (`packs` is off: no landing)."""
        bell = ShmDoorbell.create(entries, generation)
        body = msgpack.packb(
            {
                "doorbell": bell.segment.name,
                "tensors": {int(i): [t.handle, t.storage] for i, t in tensors.items()},
            },
            use_bin_type=True,
        )
        return MappedExposure(body, bell)

    def attach(self, body: bytes, what: str) -> Peer:
        try:
            d = msgpack.unpackb(body, raw=False, strict_map_key=False)
            name = d["doorbell"]
            tensors = {int(i): (bytes(h), str(s)) for i, (h, s) in d["tensors"].items()}
        except Exception as e:
            raise TransportError(f"{what}: malformed mapped descriptor ({e})") from None
        try:
            bell = ShmDoorbell.open(name)
        except StorageMovedError:
            raise TransportError(
                f"{what}: stale descriptor: its doorbell {name!r} is gone (the slot unloaded "
                "or loaded the plan again since it published it, or it is on another host)"
            ) from None
        except OSError as e:
            raise TransportError(f"{what}: cannot map its doorbell {name!r}: {e}") from e
        return MappedPeer(bell, tensors, what)
