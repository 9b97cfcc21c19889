"""`refitd serve --verify-checksums` end to end: a trainer rank and two inference pools (one on
another slot: messages; one on the trainer's slot: local copies) in this process, over real
gRPC, the embedded agent and its transfer processes; weights checked bit for bit and the
refit history records the verification."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator

import pytest
import torch

from refitd.client import InferenceClient, Placed, RefitError, TrainerClient
from refitd.demo.gpt import GptConfig, ParallelLayout, WeightGenerator, rank_shards
from refitd.demo.run import Daemon

pytestmark = pytest.mark.slow

TINY = GptConfig(layers=2, hidden=64, ffn=256, vocab=512)


@pytest.fixture(scope="module")
def verifying_daemon() -> Iterator[Daemon]:
    d = Daemon(cpu_slots=2, extra_args=["--verify-checksums", "--pause-timeout-s", "20"])
    d.start()
    try:
        yield d
    finally:
        d.stop()


def test_verified_refits_commit_bit_for_bit_and_history_says_verified(
    verifying_daemon: Daemon,
) -> None:
    d = verifying_daemon
    gen = WeightGenerator(5)
    shards = rank_shards(TINY, ParallelLayout(), 0)
    src = {s.name: torch.zeros(s.local_shape, dtype=torch.bfloat16) for s in shards}
    pools = {
        pool: {s.name: torch.zeros(s.local_shape, dtype=torch.bfloat16) for s in shards}
        for pool in ("remote", "local")
    }
    trainer = TrainerClient(d.address, "verified", rank=0, pool_size=1, device="cpu:0")
    trainer.register(src)
    clients = []
    events: dict[str, list] = {"remote": [], "local": []}
    try:
        for pool, device in (("remote", "cpu:1"), ("local", "cpu:0")):
            c = InferenceClient(d.address, "verified", pool, rank=0, pool_size=1, device=device)
            c.register({n: Placed(t) for n, t in pools[pool].items()})
            c.on_update(events[pool].append)  # subscribed: it can pause for the refit
            clients.append(c)
        for v in (1, 2):
            for s in shards:
                gen.fill(src[s.name], s, v)
            assert trainer.refit(v, wait="committed", timeout=60).state == "committed"
            for pool, tensors in pools.items():
                bad = [m for s in shards if (m := gen.mismatch(tensors[s.name], s, v))]
                assert bad == [], (pool, v, bad[:3])
        deadline = time.monotonic() + 10
        while any(c.served_version != 2 for c in clients) and time.monotonic() < deadline:
            time.sleep(0.05)
        for pool, seen in events.items():
            assert [e.version for e in seen if e.kind == "commit"] == [1, 2], pool
        with urllib.request.urlopen(f"{d.status_url}v1/status?model=verified", timeout=10) as r:
            refits = json.load(r)["refits"]
        committed = [x for x in refits if x["state"] == "committed"]
        assert sorted(x["version"] for x in committed) == [1, 2]
        for x in committed:
            assert x["verified"] is True and x["verify_check_s"] >= 0, x
    finally:
        for c in clients:
            c.close()
        trainer.close()


def test_a_landing_torn_by_aliased_registrations_fails_verification(
    verifying_daemon: Daemon,
) -> None:
    """Two registered destination tensors share one storage (a worker bug the registry does
    not catch): the second landing overwrites the first. Verification sees it, the retries
    see it again, and the pool gets INCOMPLETE naming the message, slots and tensors."""
    d = verifying_daemon
    gen = WeightGenerator(6)
    shards = rank_shards(TINY, ParallelLayout(), 0)
    by_shape: dict[tuple[int, ...], list[str]] = {}
    for s in shards:
        by_shape.setdefault(tuple(s.local_shape), []).append(s.name)
    first, second = next(names for names in by_shape.values() if len(names) >= 2)[:2]
    src = {s.name: torch.zeros(s.local_shape, dtype=torch.bfloat16) for s in shards}
    dst = {s.name: torch.zeros(s.local_shape, dtype=torch.bfloat16) for s in shards}
    dst[second] = dst[first].view(dst[first].shape)  # another tensor, the same storage
    trainer = TrainerClient(d.address, "torn", rank=0, pool_size=1, device="cpu:0")
    trainer.register(src)
    infer = InferenceClient(d.address, "torn", "remote", rank=0, pool_size=1, device="cpu:1")
    events: list = []
    try:
        infer.register({n: Placed(t) for n, t in dst.items()})
        infer.on_update(events.append)
        for s in shards:
            gen.fill(src[s.name], s, 1)
        assert not torch.equal(src[first], src[second])
        with pytest.raises(RefitError) as err:
            trainer.refit(1, wait="committed", timeout=60)
        msg = str(err.value)
        assert "checksum mismatch" in msg and "from slot 0 to slot 1" in msg, msg
        # per-message checksums: the message's destination tensors are named (not the copy)
        assert "destination tensors (pool, rank, name): ('remote', 0, " in msg, msg
        assert "after 2 retries" in msg, msg
        deadline = time.monotonic() + 10
        while not any(e.kind == "incomplete" for e in events) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [e.kind for e in events if e.kind in ("commit", "incomplete")] == ["incomplete"]
    finally:
        infer.close()
        trainer.close()
