"""Staged refits over a real `refitd serve`: the pool serves during the transfer.

A staged inference rank (InferenceClient(staged=True)) and an in-place one of the same model
follow real refits from a trainer rank; the shared-memory bytes of each are checked bit for
bit at every PAUSE (the old version) and COMMIT (the new one), and the PAUSE times are
compared with the controller's transfer timestamps (CLOCK_MONOTONIC, same host).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from refitd.client import InferenceClient, Placed, RefitError
from refitd.demo.gpt import ParallelLayout, WeightGenerator, rank_shards
from refitd.demo.run import Daemon

from ._inference_worker import SEED, TINY
from .test_faults_e2e import FAST, Trainer, status, wait_subscribed

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def staged_daemon() -> Iterator[Daemon]:
    d = Daemon(cpu_slots=3, extra_args=[*FAST, "--refit-retries", "1"])
    d.start()
    try:
        yield d
    finally:
        d.stop()


@dataclass(frozen=True)
class Seen:
    """One event an inference rank saw: when, and what its live weights held then."""

    kind: str
    version: int
    at: float
    mismatch: str | None  # PAUSE: vs the served version; COMMIT: vs the committed one


class Rank:
    """An inference rank in this process whose registered memory the agent writes."""

    def __init__(
        self, address: str, model: str, pool: str, device: str, staged: bool, pause_hook=None
    ) -> None:
        self.gen = WeightGenerator(SEED)
        self.shards = rank_shards(TINY, ParallelLayout(), 0)
        self.dst = {s.name: torch.zeros(s.local_shape, dtype=torch.bfloat16) for s in self.shards}
        self.seen: list[Seen] = []
        self.cond = threading.Condition()
        self.pause_hook = pause_hook
        self.client = InferenceClient(
            address, model, pool, device=device, staged=staged, pause=self._pause
        )
        self.client.register({n: Placed(t) for n, t in self.dst.items()})
        self.client.on_update(self._event)

    def mismatch(self, version: int | None) -> str | None:
        for s in self.shards:
            t = self.dst[s.name]
            if not version:
                if t.count_nonzero():
                    return f"{s.name}: not the zeros it registered"
            elif (m := self.gen.mismatch(t, s, version)) is not None:
                return m
        return None

    def _record(self, kind: str, version: int, mismatch: str | None) -> None:
        with self.cond:
            self.seen.append(Seen(kind, version, time.monotonic(), mismatch))
            self.cond.notify_all()

    def _pause(self, version: int) -> None:
        self._record("pause", version, self.mismatch(self.client.served_version))
        if self.pause_hook is not None:
            self.pause_hook(self, version)

    def _event(self, event) -> None:
        if event.kind == "commit":
            self._record("commit", event.version, self.mismatch(event.version))
        elif event.kind in ("abort", "incomplete"):
            self._record(event.kind, event.version, event.reason)

    def events(self, version: int) -> list[Seen]:
        with self.cond:
            return [e for e in self.seen if e.version == version]

    def wait_for(self, kind: str, version: int, timeout_s: float = 30.0) -> Seen:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                hit = [e for e in self.seen if e.kind == kind and e.version == version]
                if hit:
                    return hit[0]
                left = deadline - time.monotonic()
                assert left > 0, f"no {kind} of version {version}; saw {self.seen}"
                self.cond.wait(left)


def refit_record(address: str, model: str, version: int) -> dict:
    return next(
        r for r in status(address)["refits"] if r["model"] == model and r["version"] == version
    )


def test_staged_pool_serves_during_the_transfer(staged_daemon: Daemon) -> None:
    addr, model = staged_daemon.address, "staged-e2e"
    trainer = Trainer(addr, model)
    staged = Rank(addr, model, "infer-s", "cpu:1", staged=True)
    in_place = Rank(addr, model, "infer-p", "cpu:2", staged=False)
    try:
        wait_subscribed(addr, model)
        pools = next(m for m in status(addr)["models"] if m["name"] == model)["pools"]
        assert {p["name"]: p["mode"] for p in pools} == {
            "trainer": "in_place",
            "infer-s": "staged",
            "infer-p": "in_place",
        }
        for v in (1, 2, 3):
            state, message, _ = trainer.refit(v)
            assert state == "committed", message
            rec = refit_record(addr, model, v)
            for rank in (staged, in_place):
                commit = rank.wait_for("commit", v)
                assert commit.mismatch is None, commit.mismatch
                pause = rank.wait_for("pause", v)
                assert pause.mismatch is None, f"live weights changed before PAUSE: {pause}"
                assert [e.kind for e in rank.events(v)] == ["pause", "commit"]
            # In place: paused before any byte moved. Staged: paused only after every slot
            # was DONE (the bytes sat in staging while the rank served the old version).
            assert in_place.wait_for("pause", v).at < rec["executes_sent_at"]
            assert staged.wait_for("pause", v).at > rec["transfer_done_at"]
            assert rec["staged_pause_at"] >= rec["transfer_done_at"]
            assert staged.client.served_version == v and staged.client.state == "serving"
    finally:
        for c in (staged.client, in_place.client, trainer.client):
            c.close()


def test_failed_transfer_leaves_a_staged_pool_serving(staged_daemon: Daemon) -> None:
    """A trainer tensor whose registration was marked stale (as when its storage moves)
    fails the execute on the trainer's slot, during the transfer: the staged pool is never
    paused and keeps version 1 bit for bit."""
    addr, model = staged_daemon.address, "staged-fail"
    trainer = Trainer(addr, model)
    staged = Rank(addr, model, "infer-s", "cpu:1", staged=True)
    try:
        wait_subscribed(addr, model)
        state, message, _ = trainer.refit(1)
        assert state == "committed", message
        staged.wait_for("commit", 1)
        name = trainer.shards[0].name
        t = trainer.src[name]
        registered = t.data
        t.data = registered.clone()
        assert trainer.client.moved_tensors() == [name]  # marks its handle stale
        t.data = registered  # refit() sees nothing to register again; the agent refuses it
        state, message, _ = trainer.refit(2)
        assert state == "failed" and "moved" in message, message
        assert refit_record(addr, model, 2)["state"] == "failed"
        assert staged.mismatch(1) is None
        assert staged.client.state == "serving" and staged.client.served_version == 1
        # The trainer registers its tensors again: the next refit commits.
        trainer.client.register(trainer.src)
        state, message, _ = trainer.refit(3)
        assert state == "committed", message
        assert staged.wait_for("commit", 3).mismatch is None
        # Events arrive in order: any event of version 2 would have come before these.
        assert staged.events(2) == []
    finally:
        for c in (staged.client, trainer.client):
            c.close()


def test_failed_apply_is_incomplete(staged_daemon: Daemon) -> None:
    """The staged rank's registration is marked stale while it is paused for the apply:
    the apply (and its retries) is refused, the rank gets INCOMPLETE, never a COMMIT."""

    def stale_at_2(rank: Rank, version: int) -> None:
        if version == 2:
            t = rank.dst[rank.shards[0].name]
            registered = t.data
            t.data = registered.clone()
            rank.client.moved_tensors()  # marks the handle stale
            t.data = registered  # the PAUSE ack reports nothing moved

    addr, model = staged_daemon.address, "staged-apply"
    trainer = Trainer(addr, model)
    staged = Rank(addr, model, "infer-s", "cpu:1", staged=True, pause_hook=stale_at_2)
    try:
        wait_subscribed(addr, model)
        state, message, _ = trainer.refit(1)
        assert state == "committed", message
        state, message, _ = trainer.refit(2)
        assert state == "failed" and "moved" in message and "apply" in message, message
        incomplete = staged.wait_for("incomplete", 2)
        assert [e.kind for e in staged.events(2)] == ["pause", "incomplete"], incomplete
        assert staged.client.served_version is None
    finally:
        for c in (staged.client, trainer.client):
            c.close()


def test_pool_ranks_must_agree_on_staged(staged_daemon: Daemon) -> None:
    addr, model = staged_daemon.address, "staged-mixed"
    shards = rank_shards(TINY, ParallelLayout(), 0)
    clients = []
    try:
        for rank, staged in ((0, True), (1, False)):
            c = InferenceClient(addr, model, "infer", rank=rank, pool_size=2, staged=staged)
            clients.append(c)
            weights = {
                s.name: Placed(torch.zeros(s.local_shape, dtype=torch.bfloat16)) for s in shards
            }
            if rank == 0:
                c.register(weights)
                continue
            with pytest.raises(RefitError) as err:
                c.register(weights)
            msg = str(err.value)
            assert "rank 1 of pool 'infer' registers in-place" in msg, msg
            assert "ranks [0] of the pool registered staged" in msg, msg
    finally:
        for c in clients:
            c.close()
