"""Worker memory in a transfer process: plan tensor index -> mapped tensor, staging buffers
of staged pools, and the liveness check of registered storage.

Staging buffers live in memory another transfer process of the host can map (shared
memory on the CPU, CUDA IPC on a GPU; a `SharedTensorArena` of this process holds them), so
a sender on a mapped link writes a staged pool's tensors in place as it writes live ones."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from refitd.executor.errors import ExecutionError
from refitd.executor.segments import ResolvedTensor
from refitd.memory.arena import SharedTensorArena
from refitd.memory.handles import MemoryHandle
from refitd.memory.mapping import MemoryMapper, PreparedLiveness
from refitd.plan.wire import PLAIN


@dataclass
class MappedResolver:
    """Plan tensor index -> worker memory mapped in this process (via a shared MemoryMapper).

    Staged tensors (a staged pool's destinations) resolve to staging buffers this process
    owns, so the executor and relays write and forward them unchanged; `apply` copies them
    into the live memory. They are allocated by `stage` (at program load) as copies of the
    live tensors, so regions a refit does not write keep their live values, in an arena of
    this process (`staging_handles`: what another process maps them by); `close` frees them.
    Tensors registered over the same memory (the pieces of an engine's fused tensor) share
    one staging buffer, so applying one never writes back another's rows as they were at
    load.
    """

    mapper: MemoryMapper
    handles: dict[int, MemoryHandle]
    storages: dict[int, str]
    staged: frozenset[int] = frozenset()
    _cache: dict[int, ResolvedTensor] = field(default_factory=dict)
    _staging: dict[int, ResolvedTensor] = field(default_factory=dict)
    _checks: dict[frozenset[int], PreparedLiveness] = field(default_factory=dict)
    _arena: SharedTensorArena | None = None
    staging_handles: dict[int, MemoryHandle] = field(default_factory=dict)

    def resolve(self, index: int) -> ResolvedTensor:
        if index in self.staged:
            return self._staging[index]
        return self.live(index)

    def stage(self) -> None:
        """Allocate the staging buffers: same shape, dtype, storage and device as live, in
        shareable memory; one per distinct live memory."""
        if not self.staged:
            return
        self._arena = SharedTensorArena(prefix="refitd-stage")
        shared: dict[tuple, tuple[int, ResolvedTensor]] = {}
        for i in sorted(self.staged):
            t = self.live(i)
            key = _memory_key(self.handles[i], t.storage)
            if key in shared:
                first, st = shared[key]
                self.staging_handles[i] = replace(self.staging_handles[first], name=t.name)
                self._staging[i] = replace(st, name=t.name)
                continue
            parts = {
                k: v.clone()
                for k, v in (("data", t.data), ("scales", t.scales), ("gs", t.global_scale))
                if v is not None
            }
            h = self._arena.register({f"{i}.{k}": v for k, v in parts.items()})
            self.staging_handles[i] = replace(
                h[f"{i}.data"], name=t.name, scales=h.get(f"{i}.scales"),
                global_scale=h.get(f"{i}.gs"),
            )  # fmt: skip
            self._staging[i] = ResolvedTensor(
                t.name, parts["data"], parts.get("scales"), t.storage, parts.get("gs")
            )
            shared[key] = (i, self._staging[i])

    def close(self) -> None:
        """Free the staging buffers (a mapping elsewhere keeps its pages until dropped)."""
        if self._arena is not None:
            self._arena.close()
            self._arena = None

    def apply(self) -> int:
        """Copy every staging buffer into its live memory, once; returns the bytes copied."""
        self.check(self.staged)
        n = 0
        done: set[int] = set()
        for i in sorted(self.staged):
            staging = self._staging[i]
            if id(staging.data) in done:
                continue
            done.add(id(staging.data))
            for live, st in zip(self.live(i).buffers(), staging.buffers(), strict=True):
                live.copy_(st)
                n += st.numel() * st.element_size()
        return n

    def live(self, index: int) -> ResolvedTensor:
        """The worker memory of plan tensor `index`, mapped on first use."""
        t = self._cache.get(index)
        if t is None:
            h = self.handles.get(index)
            if h is None:
                raise ExecutionError(f"no memory handle was loaded for plan tensor {index}")
            scales = None if h.scales is None else self.mapper.map_handle(h.scales)
            gscale = None if h.global_scale is None else self.mapper.map_handle(h.global_scale)
            storage = self.storages.get(index, PLAIN)
            t = ResolvedTensor(h.name, self.mapper.map_handle(h), scales, storage, gscale)
            self._cache[index] = t
        return t

    def check(self, indices: Iterable[int]) -> None:
        """Raise StorageMovedError naming every tensor of `indices` whose registration went
        stale. Prepared once per set of indices (a frozenset the caller keeps is found in
        O(1)): the words' positions, bounds and names, and each state segment's stale count
        (STATE_STALE_COUNT); a later call reads only those counts, and reads the words
        again only when a count moved (some registration of the worker went stale)."""
        key = indices if isinstance(indices, frozenset) else frozenset(indices)
        prepared = self._checks.get(key)
        if prepared is None:
            handles = [self.handles[i] for i in sorted(key) if i in self.handles]
            self._checks[key] = PreparedLiveness.of(self.mapper, handles)
        else:
            prepared.check()


def _memory_key(h: MemoryHandle, storage: str) -> tuple:
    """What makes two registrations the same memory: where the view lies and how."""
    return (h.kind, h.segment, h.offset, h.device, repr(h.ipc), h.storage_offset, h.shape,
            h.strides, h.dtype, storage)  # fmt: skip
