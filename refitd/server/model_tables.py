"""ModelTables: one model's registrations as the planner's SpecTables, kept as workers register."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from refitd.plan.layout import TensorSpec
from refitd.plan.table import SpecTable

WorkerKey = tuple[str, int]  # (pool, rank)


class ModelTables:
    """One model's registrations as SpecTables, one per side, kept in step with the registry.

    Registrations are appended as workers register (`add`); a replaced rank with another
    layout marks the tables stale, and the next `snapshot` rebuilds them from the registry's
    workers. A removed rank (`remove`) keeps its rows: when it registers the same layout
    again before the next snapshot (a restart after its lease ran out), the tables stand as
    they are; a snapshot while it is away rebuilds them. A rebuild keeps each (pool, rank) where it was first added, so a rank that
    leaves and registers the same layout again gives the same tables (and plan digest) as
    before. A table handed to a plan build is not appended to while the build runs: an
    add then waits, and the next snapshot appends it if no build uses the tables any more
    (else it rebuilds). A pool that registers while the model's plan is built ahead for the
    pools before it so costs no rebuild (a second of Python at 786k tensors). Callers hold
    the registry lock for add, invalidate, snapshot and release.
    """

    def __init__(self) -> None:
        self.sources = SpecTable()
        self.destinations = SpecTable()
        self.stale = False
        self.in_use = 0  # plan builds running on the current tables
        self.rebuilds = 0
        self._position: dict[WorkerKey, int] = {}  # (pool, rank) -> order of first add
        self._waiting: list[tuple[str, SpecTable]] = []  # (role, worker) added while in use
        self._gone: dict[WorkerKey, Sequence[TensorSpec]] = {}  # removed, rows still in place

    def add(self, role: str, worker: SpecTable) -> None:
        """Append one worker's registrations (its own table); a removed rank back with the
        same layout finds its rows in place."""
        if worker.specs:
            first = worker.specs[0]
            key = (first.pool, first.rank)
            self._position.setdefault(key, len(self._position))
            gone = self._gone.pop(key, None)
            if gone is not None:
                if list(gone) != list(worker.specs):
                    self.invalidate()
                return
        if self.stale:
            return
        if self.in_use:
            self._waiting.append((role, worker))
            return
        (self.sources if role == "source" else self.destinations).extend(worker)

    def remove(self, key: WorkerKey, specs: Sequence[TensorSpec]) -> None:
        """Rank `key` (registered with `specs`) left; its rows stay until a snapshot."""
        if not self.stale and specs:
            self._gone[key] = specs

    def invalidate(self) -> None:
        self.stale = True
        self._waiting.clear()  # the rebuild reads every registered worker
        self._gone.clear()

    def snapshot(
        self, current: Callable[[], tuple[list[TensorSpec], list[TensorSpec]]]
    ) -> tuple[SpecTable, SpecTable]:
        """The tables (rebuilt from `current()` when stale), marked in use until `release`."""
        if self._gone:  # their rows are still in the tables
            self.invalidate()
        if self._waiting:
            if self.in_use:  # a build still reads the tables: they cannot grow
                self.invalidate()
            else:
                for role, worker in self._waiting:
                    (self.sources if role == "source" else self.destinations).extend(worker)
                self._waiting.clear()
        if self.stale:
            sources, destinations = current()
            self.sources = SpecTable.from_specs(self._in_place(sources))
            self.destinations = SpecTable.from_specs(self._in_place(destinations))
            self.stale = False
            self.rebuilds += 1
        self.in_use += 1
        return self.sources, self.destinations

    def release(self) -> None:
        self.in_use -= 1

    def _in_place(self, specs: list[TensorSpec]) -> list[TensorSpec]:
        """`specs` (grouped by worker) with each worker where it was first added; workers
        never added go last, in the order given (a stable sort)."""
        pos = self._position
        for s in specs:
            pos.setdefault((s.pool, s.rank), len(pos))
        return sorted(specs, key=lambda s: pos[(s.pool, s.rank)])
