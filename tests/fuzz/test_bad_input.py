"""Bad input against `refitd serve` in a child process: generated and byte-mutated gRPC
requests, schemathesis on the ops HTTP API, oversized messages. The daemon must reject each
with a message naming a field, keep its registry unchanged, and keep serving.
(`refitd bench fuzz` runs the same harness with >= 1000 requests.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from refitd._proto import refitd_pb2 as pb
from refitd.bench.fuzz import (
    METHODS,
    FuzzStats,
    FuzzTarget,
    Seed,
    fuzz_bytes,
    fuzz_grpc,
    fuzz_http,
    healthy_after,
    seed,
    valid_worker,
)

pytestmark = pytest.mark.slow
MAX_MESSAGE = 256 << 10


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FuzzTarget, Seed]]:
    d = FuzzTarget(tmp_path_factory.mktemp("fuzz"), max_message_bytes=MAX_MESSAGE).start()
    try:
        yield d, seed(d)
    finally:
        d.stop()


def test_generated_and_mutated_grpc_requests(daemon: tuple[FuzzTarget, Seed]) -> None:
    d, s = daemon
    stats = FuzzStats()
    fuzz_grpc(d, s, stats, cases=20, seed_value=1)  # warm-up: first imports, allocator
    rss0 = d.rss_bytes()
    fuzz_grpc(d, s, stats, cases=100, seed_value=2)
    fuzz_bytes(d, s, stats, cases=100, seed_value=3)
    growth = d.rss_bytes() - rss0
    assert stats.problems == [], stats.problems[:5]
    rejected = sum(n for code, n in stats.codes.items() if code not in ("OK",))
    assert rejected > 150, stats.codes  # the generators mostly produce bad input
    assert growth < 32 << 20, f"daemon RSS grew {growth / 2**20:.1f} MiB over 200 requests"
    assert healthy_after(d)


def test_rejection_names_field_and_leaves_state(daemon: tuple[FuzzTarget, Seed]) -> None:
    d, s = daemon
    before = d.fingerprint()
    cases = {
        "Refit": (
            pb.RefitRequest(worker_id=s.trainer_id, version=7, timeout_s=float("nan")),
            "timeout_s",
        ),
        "RegisterWorker": (
            valid_worker("trainer", pb.ROLE_SOURCE, "cpu:0"),
            "global_shape",
        ),
        "Report": (pb.AgentReport(agent_id=s.agent_id, slot=s.slots[0], kind=99), "kind"),
        "RegisterAgent": (pb.RegisterAgentRequest(host="h\x00", slots=[]), "host"),
    }
    cases["RegisterWorker"][0].tensors[0].global_shape[0] = 1 << 41
    for rpc, (request, field) in cases.items():
        with pytest.raises(grpc.RpcError) as e:
            d.call(METHODS[rpc][0], request.SerializeToString(), METHODS[rpc][2], 5.0)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (rpc, e.value.details())
        assert field in e.value.details(), (rpc, e.value.details())
    assert d.fingerprint() == before


def test_oversize_message_is_resource_exhausted(daemon: tuple[FuzzTarget, Seed]) -> None:
    d, _ = daemon
    before = d.fingerprint()
    req = valid_worker("trainer", pb.ROLE_SOURCE, "cpu:0")
    req.tensors[0].meta["pad"] = "x" * (MAX_MESSAGE + 1024)
    with pytest.raises(grpc.RpcError) as e:
        d.call(METHODS["RegisterWorker"][0], req.SerializeToString(), False, 10.0)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
    assert d.fingerprint() == before
    assert healthy_after(d)


def test_schemathesis_ops_http(daemon: tuple[FuzzTarget, Seed]) -> None:
    d, _ = daemon
    result = fuzz_http(d.http_base, cases=30, seed_value=4)
    assert result["problems"] == [], result["problems"][:5]
    assert result["sent"] >= 5
    assert healthy_after(d)


def test_daemon_data_dir_is_owner_only(daemon: tuple[FuzzTarget, Seed]) -> None:
    d, _ = daemon
    for p in [d.data_dir, *Path(d.data_dir).iterdir()]:
        assert p.stat().st_mode & 0o077 == 0, (p, oct(p.stat().st_mode))
