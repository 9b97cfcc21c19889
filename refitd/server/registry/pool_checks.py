"""A registration checked against its model and pool (registry lock held): one role and
size per pool, one source pool per model, staged, snapshot and adapter agreed by all ranks of a pool,
one global shape per canonical tensor within a pool."""

from __future__ import annotations

from refitd._proto import refitd_pb2 as pb
from refitd.plan.layout import TensorSpec
from refitd.server.errors import invalid, precondition
from refitd.server.members import Model, Pool, Worker

Shapes = dict[str, tuple[tuple[int, ...], int]]  # canonical -> (global shape, first rank)


def check_pool_role(
    model: Model, pool: Pool | None, req: pb.RegisterWorkerRequest, role: str
) -> None:
    """A rank agrees with its pool's role and size; a model has one source pool."""
    if pool is not None and pool.role != role:
        raise precondition(
            f"rank {req.rank} of pool {req.pool!r} registers as {role}, but the pool is "
            f"a {pool.role} pool"
        )
    if (
        pool is not None
        and pool.size != req.pool_size
        and len(pool.ranks) > (1 if req.rank in pool.ranks else 0)
    ):
        raise precondition(
            f"rank {req.rank} of pool {req.pool!r} says pool_size={req.pool_size}, the "
            f"registered ranks say {pool.size}"
        )
    if role == "source":
        src = model.source_pool()
        if src is not None and src.name != req.pool:
            raise precondition(
                f"model {req.model!r} already has source pool {src.name!r}; pool "
                f"{req.pool!r} cannot be a second source"
            )


def check_staged(pool: Pool | None, req: pb.RegisterWorkerRequest, role: str) -> None:
    """Staged mode is a destination pool's choice, snapshot a source pool's; the same for
    all ranks of the pool."""
    if req.staged and role != "destination":
        raise invalid(
            f"rank {req.rank} of pool {req.pool!r} sets staged, but only destination "
            "(inference) pools can be staged"
        )
    if req.adapter and role != "destination":
        raise invalid(
            f"rank {req.rank} of pool {req.pool!r} sets adapter, but only destination "
            "(inference) pools hold adapter slots"
        )
    if req.adapter and req.staged:
        raise invalid(
            f"rank {req.rank} of pool {req.pool!r} sets both adapter and staged: an adapter "
            "pool already lands in a slot it does not serve from"
        )
    if req.snapshot and role != "source":
        raise invalid(
            f"rank {req.rank} of pool {req.pool!r} sets snapshot, but only source "
            "(trainer) pools can be snapshotted"
        )
    if pool is None:
        return
    others = sorted(r for r in pool.ranks if r != req.rank)
    if others and pool.snapshot != req.snapshot:
        raise precondition(
            f"rank {req.rank} of pool {req.pool!r} registers snapshot={req.snapshot}, but "
            f"ranks {others} of the pool registered snapshot={pool.snapshot}: all ranks of "
            "a pool must agree on snapshot"
        )
    if others and pool.adapter != req.adapter:
        raise precondition(
            f"rank {req.rank} of pool {req.pool!r} registers adapter={req.adapter}, but "
            f"ranks {others} of the pool registered adapter={pool.adapter}: all ranks of a "
            "pool must agree on adapter"
        )
    if others and pool.staged != req.staged:
        mode = {True: "staged", False: "in-place"}
        raise precondition(
            f"rank {req.rank} of pool {req.pool!r} registers {mode[req.staged]}, but "
            f"ranks {others} of the pool registered {mode[pool.staged]}: all ranks of a "
            "pool must agree on staged"
        )


def check_against_pool(
    model: Model,
    req: pb.RegisterWorkerRequest,
    specs: list[TensorSpec],
    workers: dict[str, Worker],
) -> None:
    """A canonical tensor has one global shape within a pool (its ranks among `workers`);
    the pool's shapes are cached in `Pool.shapes` for the next rank that joins it. A
    replaced rank's own earlier shapes don't count: where the cache disagrees with it on
    the rank's own entry, the other ranks are asked (a restart with the same layout walks
    no pool; at 768 ranks a walk is a few hundred ms under the registry lock)."""
    pool = model.pools.get(req.pool)
    if pool is None:
        return
    if pool.shapes is None:
        pool.shapes = pool_shapes(pool, workers)
    known, others = pool.shapes, None
    for s in specs:
        hit = known.get(s.canonical)
        if hit is None or hit[0] == s.global_shape:
            continue
        if hit[1] == req.rank and req.rank in pool.ranks:
            if others is None:
                others = pool_shapes(pool, workers, skip=req.rank)
            hit = others.get(s.canonical)
            if hit is None or hit[0] == s.global_shape:
                continue
        shape, rank = hit
        raise invalid(
            f"tensor {s.name!r} of rank {req.rank} in pool {req.pool!r}: global_shape "
            f"{list(s.global_shape)} disagrees with {list(shape)} registered by rank "
            f"{rank} for {s.canonical!r}"
        )


def pool_shapes(pool: Pool, workers: dict[str, Worker], skip: int | None = None) -> Shapes:
    """Canonical name -> (global shape, first rank registering it) of the pool's ranks
    (but `skip`)."""
    known: Shapes = {}
    for rank, wid in pool.ranks.items():
        if rank == skip or wid not in workers:
            continue
        for s in workers[wid].specs:
            known.setdefault(s.canonical, (s.global_shape, rank))
    return known
