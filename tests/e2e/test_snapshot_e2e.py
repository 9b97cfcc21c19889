"""Snapshot release end to end: `refitd serve --snapshot-bytes`, a trainer registered with
TrainerClient(snapshot=True), an inference rank on another slot (Gloo), real gRPC.

Under the cap the trainer overwrites its weights as soon as refit() returns and the
inference rank still gets exactly the version it was sent; above the cap the slot reads
live memory, the version lands bit for bit and the refit's record says why.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import grpc
import pytest
import torch

from refitd._proto import refitd_pb2 as pb
from refitd._proto import refitd_pb2_grpc as pb_grpc
from refitd.client import InferenceClient, Placed, TrainerClient
from refitd.demo.run import Daemon

pytestmark = pytest.mark.slow

CAP = 64 << 10


@pytest.fixture(scope="module")
def snap_daemon() -> Iterator[Daemon]:
    d = Daemon(cpu_slots=2, extra_args=["--snapshot-bytes", str(CAP), "--log-level", "info"])
    d.start()
    try:
        yield d
    finally:
        d.stop()


def _weights(version: int, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Version v of every tensor: distinct small integers, exact in bfloat16."""
    out = {}
    for k, (name, shape) in enumerate(sorted(shapes.items())):
        n = torch.Size(shape).numel()
        vals = (torch.arange(n, dtype=torch.int32) * 3 + k * 17 + version * 29) % 241 - 120
        out[name] = vals.to(torch.bfloat16).reshape(shape)
    return out


def _record(daemon: Daemon, model: str, version: int) -> dict:
    channel = grpc.insecure_channel(daemon.address)
    try:
        doc = json.loads(
            pb_grpc.RefitStub(channel).GetStatus(pb.StatusRequest(model=model), timeout=10).json
        )
    finally:
        channel.close()
    return next(r for r in doc["refits"] if r["version"] == version and r["state"] == "committed")


def _run(daemon: Daemon, model: str, shapes: dict[str, tuple[int, ...]]) -> dict:
    """Refit v1 and v2; the trainer writes the next version right after each refit()
    returns. Returns the record of v2."""
    src = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}
    dst = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}
    trainer = TrainerClient(daemon.address, model, rank=0, pool_size=1, snapshot=True)
    infer = InferenceClient(daemon.address, model, "infer", rank=0, pool_size=1, device="cpu:1")
    try:
        trainer.register(src)
        infer.register({n: Placed(t) for n, t in dst.items()})
        infer.on_update(lambda event: None)  # subscribes: the pool can be paused
        for v in (1, 2):
            for n, t in _weights(v, shapes).items():
                src[n].copy_(t)
            result = trainer.refit(v, wait="sources_read", timeout=60)
            assert result.state in ("sources_ready", "transferring", "landed", "committed")
            for n, t in _weights(v + 100, shapes).items():
                src[n].copy_(t)  # the next optimizer step
            deadline = time.monotonic() + 60
            while infer.served_version != v and time.monotonic() < deadline:
                time.sleep(0.02)
            assert infer.served_version == v
            want = _weights(v, shapes)
            bad = [n for n in shapes if not torch.equal(dst[n], want[n])]
            assert bad == [], f"version {v}: {bad} differ from what was sent"
        return _record(daemon, model, 2)
    finally:
        infer.close()
        trainer.close()


def test_snapshot_keeps_the_sent_version_while_the_trainer_writes(snap_daemon: Daemon) -> None:
    shapes = {f"layer{i}.w": (16, 64) for i in range(8)}  # 16 KiB of sources
    record = _run(snap_daemon, "snap-small", shapes)
    snaps = record.get("snapshot", {})
    assert [s["fallback"] for s in snaps.values()] == [""], record
    assert sum(s["bytes"] for s in snaps.values()) >= 16 << 10


def test_over_the_cap_the_slot_reads_live_memory_and_the_record_says_so(
    snap_daemon: Daemon,
) -> None:
    shapes = {f"layer{i}.w": (64, 256) for i in range(4)}  # 128 KiB > CAP
    record = _run(snap_daemon, "snap-big", shapes)
    (snap,) = record["snapshot"].values()
    assert snap["bytes"] == 0
    assert f"exceeds snapshot_bytes {CAP}" in snap["fallback"], record
