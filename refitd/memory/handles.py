"""Where a registered tensor's bytes live: `MemoryHandle`, the opaque `memory` bytes a worker
registers and a transfer process maps (msgpack, versioned), and the liveness-word layout
both sides read. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

SHM = "shm"
CUDA_IPC = "cuda_ipc"
STATE_WORD = 8  # bytes per liveness word
STATE_LIVE = 1
STATE_STALE = 2
# word 0 of a state segment counts the words of the segment the worker marked stale, so a
# transfer process sees that none went stale since its last check in one read
STATE_STALE_COUNT = 0
# 2: word 0 of a state segment is its stale count (a transfer process refuses the handles of
# a worker that lays its state segments out otherwise, rather than miss its stale marks)
HANDLE_FORMAT_VERSION = 2


@dataclass(frozen=True, slots=True)
class MemoryHandle:
    """Where a registered tensor's bytes live, enough for another process to map them.

    shm: `segment` names a file under /dev/shm and `offset` is the byte offset of the tensor's
    storage in it. cuda_ipc: `ipc` holds the fields of torch's `_share_cuda_()` and `offset`
    is the storage's byte offset inside its CUDA allocation. In both cases `storage_offset`,
    `shape` and `strides` (elements) place the tensor in its storage. `data_ptr` is the
    address the worker saw at registration; `state_segment`/`state_index` locate the
    liveness word. `scales` carries the second buffer of a quantized storage,
    `global_scale` the third of NVFP4 storage (its float32 global scale).
    """

    kind: str
    segment: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    storage_offset: int
    data_ptr: int
    device: int = -1
    ipc: tuple = ()
    state_segment: str = ""
    state_index: int = -1
    name: str = ""
    scales: MemoryHandle | None = None
    global_scale: MemoryHandle | None = None

    def to_bytes(self) -> bytes:
        return msgpack.packb(self._to_dict(), use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> MemoryHandle:
        d = msgpack.unpackb(data, raw=False)
        if d.get("v") != HANDLE_FORMAT_VERSION:
            raise ValueError(
                f"memory handle format {d.get('v')!r}, expected {HANDLE_FORMAT_VERSION}"
            )
        return cls._from_dict(d)

    def _to_dict(self) -> dict:
        return {
            "v": HANDLE_FORMAT_VERSION,
            "kind": self.kind,
            "segment": self.segment,
            "offset": self.offset,
            "nbytes": self.nbytes,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "strides": list(self.strides),
            "storage_offset": self.storage_offset,
            "data_ptr": self.data_ptr,
            "device": self.device,
            "ipc": list(self.ipc),
            "state_segment": self.state_segment,
            "state_index": self.state_index,
            "name": self.name,
            "scales": None if self.scales is None else self.scales._to_dict(),
            "global_scale": None if self.global_scale is None else self.global_scale._to_dict(),
        }

    @classmethod
    def _from_dict(cls, d: dict) -> MemoryHandle:
        return cls(
            kind=d["kind"],
            segment=d["segment"],
            offset=d["offset"],
            nbytes=d["nbytes"],
            dtype=d["dtype"],
            shape=tuple(d["shape"]),
            strides=tuple(d["strides"]),
            storage_offset=d["storage_offset"],
            data_ptr=d["data_ptr"],
            device=d["device"],
            ipc=tuple(d["ipc"]),
            state_segment=d["state_segment"],
            state_index=d["state_index"],
            name=d["name"],
            scales=None if d["scales"] is None else cls._from_dict(d["scales"]),
            global_scale=None
            if d.get("global_scale") is None
            else cls._from_dict(d["global_scale"]),
        )
