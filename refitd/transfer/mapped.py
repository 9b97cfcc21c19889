"""Worker memory in a transfer process: plan tensor index -> mapped tensor, staging buffers
of staged pools, and the liveness check of registered storage."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from refitd.executor.errors import ExecutionError
from refitd.executor.segments import ResolvedTensor
from refitd.memory.handles import MemoryHandle
from refitd.memory.mapping import LivenessCheck, MemoryMapper, check_live_words, liveness_check
from refitd.plan.wire import PLAIN


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
            self._staging[i] = ResolvedTensor(
                t.name,
                t.data.clone(),
                None if t.scales is None else t.scales.clone(),
                t.storage,
                None if t.global_scale is None else t.global_scale.clone(),
            )

    def apply(self) -> int:
        """Copy every staging buffer into its live tensor; returns the bytes copied."""
        self.check(self.staged)
        n = 0
        for i in sorted(self.staged):
            for live, st in zip(self.live(i).buffers(), self._staging[i].buffers(), strict=True):
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
        key = tuple(indices)
        prepared = self._checks.get(key)
        if prepared is None:
            prepared = liveness_check([self.handles[i] for i in key if i in self.handles])
            self._checks[key] = prepared
        check_live_words(self.mapper, prepared)
