"""The registry's shared state: the members' dicts, the store behind them and the locks
(the locking discipline is in the package docstring)."""

from __future__ import annotations

import threading

from refitd.server.database import StateDB
from refitd.server.interning import Interner
from refitd.server.members import Agent, Model, Slot, Worker


class RegistryState:
    """What every part of the registry reads and writes: models, workers, agents and slots,
    written through to StateDB, and the three locks."""

    def __init__(self, db: StateDB) -> None:
        self.db = db
        self.lock = threading.RLock()
        # Lease renewals (last_seen of workers and agents) take only this lock, never
        # `lock`: a heartbeat must not queue behind a burst of registrations, which hold
        # `lock` through their SQLite writes (1,024 registering ranks starved heartbeats
        # past their lease). Look-ups in the dicts are atomic reads.
        self._lease_lock = threading.Lock()
        self._renewed = threading.Condition(self._lease_lock)  # a worker's lease was renewed
        self._registered = threading.Condition(self.lock)  # a worker registered (a flip done)
        # Registrations validate one at a time: each is ~50 ms of Python for a rank of
        # ~1,000 tensors, and several at once leave the GIL to the gRPC poller and the
        # heartbeat handlers only between them (heartbeats then waited 20 s in a burst).
        self._validating = threading.Lock()
        self._intern = Interner()  # names, shapes and boxes shared by the registered ranks
        self.models: dict[str, Model] = {}
        self.workers: dict[str, Worker] = {}
        self.agents: dict[str, Agent] = {}
        self.slots: dict[int, Slot] = {}
        self._incarnations = 0
