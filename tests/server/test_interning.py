"""Registrations share one object per distinct name, shape and box tuple across ranks."""

from __future__ import annotations

from refitd._proto import refitd_pb2 as pb
from refitd.server.interning import Interner
from refitd.server.validation import specs_from_request

from .peers import row_shard


def _rank(rank: int) -> pb.RegisterWorkerRequest:
    return pb.RegisterWorkerRequest(
        model="m",
        pool="infer",
        role=pb.ROLE_DESTINATION,
        rank=rank,
        pool_size=2,
        host="h",
        device=f"cpu:{rank}",
        tensors=[row_shard(f"layer.{i}.w", 8, 4, rank, 2) for i in range(3)],
    )


def test_ranks_share_names_and_shapes() -> None:
    intern = Interner()
    a = specs_from_request(_rank(0), 0, intern)
    b = specs_from_request(_rank(1), 1, intern)
    for x, y in zip(a, b, strict=True):
        assert x.name == y.name and x.name is y.name
        assert x.canonical is y.canonical and x.pool is y.pool and x.dtype is y.dtype
        assert x.global_shape is y.global_shape and x.local_shape is y.local_shape
        assert x.boxes != y.boxes  # other rows: values differ, nothing is merged wrongly
    again = specs_from_request(_rank(0), 0, intern)
    assert all(x.boxes is y.boxes for x, y in zip(a, again, strict=True))
    assert again == a


def test_a_full_table_starts_over_and_still_returns_equal_values() -> None:
    intern = Interner(limit=2)
    first = intern(("a", 1))
    intern(("b", 2))
    assert intern(("a", 1)) is first
    intern(("c", 3))  # over the limit: the table starts over
    assert len(intern) == 1
    got = intern(("a", 1))
    assert got == ("a", 1)
