"""Who is where: models, pools, workers, device slots and agents, with membership epochs.

Every change of membership (a worker or an agent registers or leaves) bumps the epoch of
the models it touches: what a refit needs from the registry (workers, memory handles,
agents) is looked up again. The plan digest is the layout identity, not the epoch: a rank
that registers the same layout again leaves the model's spec tables as they are, so its
plan is reused and only the slots holding its tensors get their program again. The
registry is the controller's in-memory view, written through to StateDB.

`Registry` is one object whose parts live in modules by job, imported one way:
- state: `RegistryState`, the members' dicts and the locks
- queries: `Queries`, look-ups and the snapshots refits, status, readiness and gauges read
- pool_checks: a registration checked against its model and pool
- registration: `Registrar`, workers and agents registered, replaced and unregistered,
  the restore from StateDB, the versions members hold (`rank_taken`: a rank's live holder)
- liveness: `Liveness`, leases, Commands-stream connections and the "is the holder live" wait

Locking (the same object everywhere, so every part keeps one discipline):
- `lock` (re-entrant) guards the dicts and every field of their members but `last_seen`.
  A method that reads more than one entry, or changes anything, takes it; SQLite writes
  happen under it. A look-up of one member (`worker`, `agent`, `model`) is one dict read
  without it: the calls on the gRPC server's loop must not queue behind a registration.
- `_lease_lock` guards `last_seen` only; its condition `_renewed` wakes the waits for a
  sign of life (`renewed`). Heartbeats (`touch_worker`, `touch_agent`, `renew_worker`) take
  only it, never `lock`: a heartbeat must not queue behind a burst of registrations that
  hold `lock` through their SQLite writes. They find their member with one dict look-up,
  atomic without a lock.
- A method that needs both takes `lock` first, then `_lease_lock` (`agent_connected`),
  never the other way round.
- `_validating` runs the costly part of registrations (specs from the request, their
  table) one at a time, with no other lock held; `register_worker` calls its `judge`
  (which may wait in `renewed`) with no lock held either.
"""

from __future__ import annotations

from refitd.server.database import StateDB
from refitd.server.registry.liveness import Liveness
from refitd.server.registry.registration import Registrar, rank_taken

__all__ = ["Registry", "rank_taken"]


class Registry(Registrar, Liveness):
    """Membership of the cluster, persisted through StateDB; thread-safe (see above)."""

    def __init__(self, db: StateDB) -> None:
        super().__init__(db)
        self._restore()
