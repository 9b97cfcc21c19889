"""The cluster's members as the registry keeps them: models, pools, workers, device slots
and node agents. Changed only through refitd.server.registry.Registry, under its lock."""

from __future__ import annotations

from dataclasses import dataclass, field

from refitd.plan.layout import TensorSpec
from refitd.plan.table import SpecTable
from refitd.server.model_tables import ModelTables


@dataclass(frozen=True, slots=True)
class ProcessId:
    """A process on its host (RegisterWorkerRequest.process): equal for the same process
    only (the pid means one process within a boot and a pid namespace, with its start)."""

    boot_id: str
    pid_namespace: str
    pid: int
    start_ticks: int

    def sees(self, other: ProcessId) -> bool:
        """Whether this process can look `other` up in its own /proc."""
        return (self.boot_id, self.pid_namespace) == (other.boot_id, other.pid_namespace)


@dataclass
class Worker:
    """One registered trainer or inference rank."""

    worker_id: str
    model: str
    pool: str
    role: str
    rank: int
    pool_size: int
    host: str
    device: str
    pid: int
    slot: int
    specs: tuple[TensorSpec, ...]
    memory: dict[str, bytes]
    registered_at: float
    last_seen: float
    live: bool = True  # False: restored from the database, not re-registered yet
    holds: int = 0  # committed version its registered memory holds (destinations; 0: none)
    paused_in: int = 0  # refit whose PAUSE it re-registered in, not yet told the outcome
    # adapter pools: sent a COMMIT, its spare slot unknown until it registers again
    flip_pending: bool = False
    process: ProcessId | None = None  # the registering process (None: its client sent none)
    table: SpecTable | None = field(default=None, repr=False, compare=False)  # of `specs`

    def describe(self) -> str:
        return f"worker {self.worker_id} (rank {self.rank} of pool {self.pool!r})"

    def spec_table(self) -> SpecTable:
        """Its specs as planner columns: made once (at registration, outside the registry
        lock), joined by the model tables and catch-up plans instead of tabulating again."""
        if self.table is None:
            self.table = SpecTable.of_worker(self.specs)
        return self.table


@dataclass
class Pool:
    name: str
    role: str
    size: int
    ranks: dict[int, str] = field(default_factory=dict)  # rank -> worker_id
    staged: bool = False  # destination pool receiving into staging buffers (apply on commit)
    snapshot: bool = False  # source pool released after its slots copied it (snapshot.py)
    adapter: bool = False  # destination pool writing a spare adapter slot (no pause, a flip)
    # canonical -> (global shape, first rank registering it); None: rebuild after a removal
    shapes: dict[str, tuple[tuple[int, ...], int]] | None = None

    @property
    def complete(self) -> bool:
        return len(self.ranks) == self.size


@dataclass
class Model:
    name: str
    epoch: int = 0
    committed_version: int = 0
    pools: dict[str, Pool] = field(default_factory=dict)
    tables: ModelTables = field(default_factory=ModelTables)  # its specs, planner columns

    def source_pool(self) -> Pool | None:
        return next((p for p in self.pools.values() if p.role == "source"), None)

    def destination_pools(self) -> list[Pool]:
        return [p for p in self.pools.values() if p.role == "destination"]


@dataclass
class Slot:
    slot_id: int
    host: str
    device: str
    agent_id: str | None


@dataclass
class Agent:
    agent_id: str
    host: str
    pid: int
    slot_ids: list[int]
    registered_at: float
    last_seen: float
    incarnation: int
    connected: bool = False  # its Commands stream is open
    batch_execute: bool = False  # takes one ExecuteCommand for all its slots
    data_plane_address: str = ""  # where its transfer processes accept peers
    links: tuple[str, ...] = ()  # one-sided paths its transfer processes offer
