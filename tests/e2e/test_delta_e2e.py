"""Delta refits end to end: `refitd serve --delta-refits --verify-checksums` (controller,
embedded agent, transfer processes over Gloo), a trainer rank and two inference pools on
other slots. Versions come from FP32 master weights moved by +-lr (BF16 published).
Five successive delta refits land bit for bit; an inference rank that restarted (a new
registration with fresh memory) gets its messages dense and lands bit for bit while the
other pool keeps receiving deltas; the refit records say what went as a delta and the
achieved density. With relays (the default) a replica fed by another's relay gets dense
through the executor: test_relay_fed_replica_dense_and_bit_for_bit."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import pytest
import torch

from refitd.client import InferenceClient, Placed, TrainerClient
from refitd.demo.gpt import GptConfig, ParallelLayout, rank_shards
from refitd.demo.run import Daemon
from refitd.demo.versions import VersionGenerator

from .test_faults_e2e import wait_subscribed

pytestmark = pytest.mark.slow

TINY = GptConfig(layers=2, hidden=64, ffn=256, vocab=512)


# settings of a daemon whose tests check the delta path itself: on loopback the speed rule
# would (rightly) send later versions dense once a delta refit measured slower, and links
# between slots of one host would be mapped (written in place: dense)
DELTA_PATH_ARGS = (
    *("--delta-refits", "--verify-checksums", "--pause-timeout-s", "20"),
    *("--heartbeat-timeout-s", "30", "--no-relay"),
    *("--no-delta-speed-rule", "--links", "collective"),
)


@pytest.fixture(scope="module")
def delta_daemon() -> Iterator[Daemon]:
    d = Daemon(cpu_slots=3, extra_args=list(DELTA_PATH_ARGS))
    d.start()
    try:
        yield d
    finally:
        d.stop()


class Trainer:
    """One trainer rank holding every tensor (TP1) on the slot `device`, versions from FP32
    masters."""

    def __init__(
        self, address: str, model: str, lr: float, snapshot: bool = False, device: str = "cpu:0"
    ) -> None:
        self.shards = rank_shards(TINY, ParallelLayout(), 0)
        on = _memory(device)
        self.gens = {
            s.name: VersionGenerator(_numel(s.local_shape), lr, seed=i)
            for i, s in enumerate(self.shards)
        }
        self.src = {
            s.name: self.gens[s.name].current(
                torch.empty(s.local_shape, dtype=torch.bfloat16, device=on)
            )
            for s in self.shards
        }
        self.client = TrainerClient(
            address, model, rank=0, pool_size=1, device=device, snapshot=snapshot
        )
        self.client.register(self.src)

    def step(self) -> None:
        for name, t in self.src.items():
            self.gens[name].step(t)

    def refit(self, version: int) -> None:
        assert self.client.refit(version, wait="committed", timeout=60).state == "committed"

    def fresh(self, device: str = "cpu:0") -> dict[str, torch.Tensor]:
        """Zeroed destination tensors in the memory of the slot `device`."""
        on = _memory(device)
        return {
            s.name: torch.zeros(s.local_shape, dtype=torch.bfloat16, device=on) for s in self.shards
        }


def _memory(slot_device: str) -> torch.device:
    """Where a slot's tensors live: its CUDA device, or host memory for a CPU slot."""
    return torch.device(slot_device) if slot_device.startswith("cuda") else torch.device("cpu")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    return [
        n
        for n, t in want.items()
        if not torch.equal(got[n].cpu().view(torch.int16), t.cpu().view(torch.int16))
    ]


def _records(d: Daemon, model: str) -> dict[int, dict]:
    with urllib.request.urlopen(f"{d.status_url}v1/status?model={model}", timeout=10) as r:
        refits = json.load(r)["refits"]
    return {x["version"]: x for x in refits if x["state"] == "committed"}


def _infer(d: Daemon, model: str, pool: str, device: str, dst: dict) -> InferenceClient:
    c = InferenceClient(d.address, model, pool, rank=0, pool_size=1, device=device)
    c.register({n: Placed(t) for n, t in dst.items()})
    c.on_update(lambda e: None)
    wait_subscribed(d.address, model)  # it can pause before the first refit
    return c


def test_five_successive_delta_refits_bit_for_bit(delta_daemon: Daemon) -> None:
    d = delta_daemon
    tr = Trainer(d.address, "delta5", lr=1e-6)
    dst = tr.fresh()
    infer = _infer(d, "delta5", "engine", "cpu:1", dst)
    try:
        for v in range(1, 7):
            if v > 1:
                tr.step()
            tr.refit(v)
            assert _same(dst, tr.src) == [], v
        rec = _records(d, "delta5")
        assert rec[1]["delta"]["delta_messages"] == 0  # no base yet: dense
        for v in range(2, 7):
            x = rec[v]["delta"]
            assert x["sent_as_delta"] > 0 and x["sent_dense"] == 0, x
            assert 0 < x["density"] < 0.2, x
            assert x["wire_bytes"] < 0.3 * x["dense_wire_bytes"], x
            assert rec[v]["verified"] is True
    finally:
        infer.close()
        tr.client.close()


def test_restarted_destination_gets_dense_and_lands(delta_daemon: Daemon) -> None:
    d = delta_daemon
    tr = Trainer(d.address, "deltarestart", lr=1e-6)
    a, b = tr.fresh(), tr.fresh()
    ia = _infer(d, "deltarestart", "a", "cpu:1", a)
    ib = _infer(d, "deltarestart", "b", "cpu:2", b)
    try:
        tr.refit(1)
        tr.step()
        tr.refit(2)
        assert _same(a, tr.src) == [] and _same(b, tr.src) == []
        # pool b's rank is killed and restarts with fresh memory
        ib.close()
        b = tr.fresh()
        ib = _infer(d, "deltarestart", "b", "cpu:2", b)
        tr.step()
        tr.refit(3)
        assert _same(a, tr.src) == [] and _same(b, tr.src) == []
        x = _records(d, "deltarestart")[3]["delta"]
        assert x["sent_as_delta"] > 0 and x["sent_dense"] > 0, x  # a: deltas, b: dense
        assert x["dense_why"].get("unknown_base", 0) > 0, x
        tr.step()
        tr.refit(4)  # b landed version 3 by a refit: deltas to both now
        assert _same(a, tr.src) == [] and _same(b, tr.src) == []
        x = _records(d, "deltarestart")[4]["delta"]
        assert x["sent_dense"] == 0 and x["sent_as_delta"] > 0, x
    finally:
        ia.close()
        ib.close()
        tr.client.close()


def test_relay_fed_replica_dense_and_bit_for_bit() -> None:
    """With relays on, the directly fed pool gets deltas and the relay-fed one its relayed
    (dense) messages through the executor, after the delta path: both bit for bit."""
    d = Daemon(
        cpu_slots=3,
        extra_args=[
            *("--delta-refits", "--verify-checksums", "--heartbeat-timeout-s", "30"),
            *("--links", "collective"),  # the delta path (mapped links go dense)
        ],
    )
    d.start()
    tr = Trainer(d.address, "deltarelay", lr=1e-6)
    a, b = tr.fresh(), tr.fresh()
    ia = _infer(d, "deltarelay", "a", "cpu:1", a)
    ib = _infer(d, "deltarelay", "b", "cpu:2", b)
    try:
        for v in range(1, 4):
            if v > 1:
                tr.step()
            tr.refit(v)
            assert _same(a, tr.src) == [] and _same(b, tr.src) == [], v
        x = _records(d, "deltarelay")[3]["delta"]
        assert x["sent_as_delta"] > 0, x
    finally:
        ia.close()
        ib.close()
        tr.client.close()
        d.stop()


def test_delta_refits_read_the_snapshot(delta_daemon: Daemon) -> None:
    """A snapshot trainer pool: the delta path encodes from the slot's snapshot (the trainer
    is released after the local copy); three delta refits land bit for bit."""
    d = delta_daemon
    tr = Trainer(d.address, "deltasnap", lr=1e-6, snapshot=True)
    dst = tr.fresh()
    infer = _infer(d, "deltasnap", "engine", "cpu:1", dst)
    try:
        for v in range(1, 5):
            if v > 1:
                tr.step()
            tr.refit(v)
            assert _same(dst, tr.src) == [], v
        rec = _records(d, "deltasnap")
        for v in (2, 3, 4):
            assert rec[v]["delta"]["sent_as_delta"] > 0, rec[v]["delta"]
            assert all(s["bytes"] > 0 for s in rec[v]["snapshot"].values()), rec[v]
    finally:
        infer.close()
        tr.client.close()
