"""A policy and its MTP draft refit as one version, through a real `refitd serve`.

A trainer holds a tiny DeepSeek-V3 built from a transformers config and its MTP layer as
an extra decoder layer, all under HF names. Two destination pools of the same model take
them: `policy` (tp=2, vLLM's DeepseekV2 layout, staged) and `draft` (tp=2, vLLM's
DeepSeekMTP layout, in place, in a process of its own). Every rank of both pools must hold
what vLLM's loaders make of the version, bit for bit (tests/clients/_draft_models.py,
written apart from clients.engine_layouts).

Then the draft's process is killed with -9 during the refit of version 2, after the
transfer wrote the draft in place and the policy's staging, while the policy is paused to
apply it: the refit fails, the policy is never applied and keeps serving version 1 bit for
bit, the draft holds nothing it could serve, and no version is committed. Once the draft's
ranks are back, version 2 lands in both."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

pytest.importorskip("transformers")

from _child_lines import ChildLines
from _draft_models import digest, dims, engine, expected, mismatches, trainer_tensors

from clients.engine_layouts import register_engine
from refitd._proto import refitd_pb2 as pb
from refitd._proto import refitd_pb2_grpc as pbg
from refitd.cli.main import build_parser
from refitd.cli.status import render
from refitd.client import InferenceClient, RefitError, TrainerClient
from refitd.config import settings_from_args
from refitd.demo.run import Daemon

MODEL = "dsv3-mtp"
CADENCE = "dsv3-mtp-every2"  # its draft pool refits every 2 versions (pool_every)
TP = 2
WORKER = str(Path(__file__).with_name("_draft_worker.py"))
SERVE_ARGS = [
    "--heartbeat-interval-s", "0.3",
    "--pause-timeout-s", "20",
    "--refit-retry-budget-s", "1",  # a lost draft rank is not back within it: FAILED
    "--pool-every", f"{CADENCE}/draft=2",
    "--log-level", "info",
]  # fmt: skip


@pytest.fixture(scope="module")
def mtp_daemon() -> Iterator[Daemon]:
    d = Daemon(cpu_slots=3, extra_args=SERVE_ARGS)
    d.start()
    try:
        yield d
    finally:
        d.stop()


def status(address: str) -> dict:
    with grpc.insecure_channel(address) as ch:
        return json.loads(pbg.RefitStub(ch).GetStatus(pb.StatusRequest(), timeout=5).json)


def pools(address: str, model: str = MODEL) -> dict[str, dict]:
    """The model's pools in the controller's status, by name."""
    for m in status(address)["models"]:
        if m["name"] == model:
            return {p["name"]: p | {"committed": m["committed_version"]} for p in m["pools"]}
    return {}


def wait_until(what: str, cond: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what} not within {timeout_s:g}s"
        time.sleep(0.02)


def subscribed(address: str, pool: str, model: str = MODEL) -> int:
    """How many ranks of `pool` hold a subscription (0 once the pool is gone)."""
    p = pools(address, model).get(pool)
    return 0 if p is None else sum(r["subscribed"] for r in p["ranks"])


class DraftProcess(ChildLines):
    """The draft pool's ranks in a child process, and the lines it prints."""

    def __init__(self, address: str) -> None:
        d = json.dumps(dataclasses.asdict(dims()))
        super().__init__(
            [sys.executable, WORKER, address, MODEL, "--tp", str(TP), "--dims", d],
            "draft process",
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )

    def go(self) -> None:
        """Register the ranks (the process waits for this line once started)."""
        self.expect("started")
        self.send("go")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_policy_and_draft_land_together_or_not_at_all(mtp_daemon: Daemon) -> None:
    address = mtp_daemon.address
    want = {v: expected(engine(TP, False)[0], False, v) for v in (1, 2)}
    draft_eng = engine(TP, True)[0]
    draft_want = {v: sorted(f"commit {v} {r} {digest(t)}" for r, t in
                            enumerate(expected(draft_eng, True, v))) for v in (1, 2)}  # fmt: skip
    events: list[list[str]] = [[] for _ in range(TP)]
    draft, standby = DraftProcess(address), DraftProcess(address)
    kill_at = {"version": 2}

    def pause(version: int) -> None:
        # The policy is staged: it is paused only to apply, after the transfer. Kill the
        # draft's process there, and ack once the controller saw its ranks go.
        if version == kill_at["version"]:
            kill_at["version"] = 0
            draft.kill()
            wait_until("the draft's ranks gone", lambda: subscribed(address, "draft") == 0)

    policy, lays = engine(TP, False)
    clients: list[InferenceClient] = []
    trainer = TrainerClient(address, MODEL, rank=0, pool_size=1, device="cpu:0")
    try:
        src = {n: t.clone() for n, t in trainer_tensors(1).items()}
        trainer.register(src)
        for r in range(TP):
            c = InferenceClient(
                address, MODEL, "policy", r, TP, f"cpu:{1 + r}", pause=pause, staged=True
            )
            register_engine(c, policy.ranks[r], lays[r])
            c.on_update(lambda e, r=r: events[r].append(e.kind))
            clients.append(c)
        draft.go()
        draft.expect("ready")
        wait_until("every rank subscribed", lambda: subscribed(address, "draft") == TP)

        assert trainer.refit(1, wait="served", timeout=120).state == "committed"
        assert sorted(draft.expect("commit 1 ") for _ in range(TP)) == draft_want[1]
        for r in range(TP):
            assert mismatches(policy.ranks[r], want[1][r]) == [], r

        # Version 2: the draft's process dies while the policy is paused to apply.
        for name, t in trainer_tensors(2).items():
            src[name].copy_(t)
        with pytest.raises(RefitError) as failed:
            trainer.refit(2, wait="committed", timeout=120)
        assert "pool 'draft'" in str(failed.value), failed.value
        for r, c in enumerate(clients):
            wait_until("the policy told", lambda r=r: events[r][-1] in ("abort", "incomplete"))
            assert events[r][-1] == "abort", (r, events[r])
            assert c.served_version == 1, (r, c.served_version)
            assert mismatches(policy.ranks[r], want[1][r]) == [], r  # never applied
        assert pools(address)["policy"]["committed"] == 1

        # The draft's ranks come back (fresh memory: they hold nothing); version 2 lands
        # in both pools.
        draft = standby
        draft.go()
        draft.expect("ready")
        wait_until("the draft back", lambda: subscribed(address, "draft") == TP)
        assert trainer.refit(2, wait="served", timeout=120).state == "committed"
        assert sorted(draft.expect("commit 2 ") for _ in range(TP)) == draft_want[2]
        for r, c in enumerate(clients):
            assert c.served_version == 2, r
            assert mismatches(policy.ranks[r], want[2][r]) == [], r
        assert pools(address)["policy"]["committed"] == 2
        told = ["hello", "pause", "commit", "pause", "abort", "pause", "commit"]
        assert events == [told] * TP
    finally:
        for d in {draft, standby}:
            if d.proc.poll() is None:
                d.kill()
        for c in clients:
            c.close()
        trainer.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_draft_on_its_own_cadence_keeps_its_version_between_turns(mtp_daemon: Daemon) -> None:
    """pool_every CADENCE/draft=2, one rank per pool: version 1 lands in the policy and the
    draft, version 2 in the policy alone (the draft is neither paused nor written, keeps
    serving 1 bit for bit, and the status and the refit's record say so), version 3 in
    both again."""
    address = mtp_daemon.address
    engines = {"policy": engine(1, False), "draft": engine(1, True)}
    events: dict[str, list[tuple[str, int]]] = {"policy": [], "draft": []}
    clients: dict[str, InferenceClient] = {}
    trainer = TrainerClient(address, CADENCE, rank=0, pool_size=1, device="cpu:0")
    try:
        src = {n: t.clone() for n, t in trainer_tensors(1).items()}
        trainer.register(src)
        for pool, (eng, lays) in engines.items():
            c = InferenceClient(address, CADENCE, pool, 0, 1, "cpu:1")
            register_engine(c, eng.ranks[0], lays[0])
            c.on_update(lambda e, pool=pool: events[pool].append((e.kind, e.version)))
            clients[pool] = c
        for pool in engines:
            wait_until(f"{pool} subscribed", lambda p=pool: subscribed(address, p, CADENCE) == 1)
        for v in (1, 2, 3):
            for name, t in trainer_tensors(v).items():
                src[name].copy_(t)
            assert trainer.refit(v, wait="served", timeout=60).state == "committed"
            serves = {"policy": v, "draft": 1 if v == 2 else v}
            now = pools(address, CADENCE)
            for pool, (eng, _) in engines.items():
                want = expected(eng, pool == "draft", serves[pool])[0]
                assert mismatches(eng.ranks[0], want) == [], (v, pool)
                assert now[pool]["version"] == serves[pool], (v, pool, now[pool])
                assert now[pool]["summary"]["lagging_count"] == 0, (v, pool)
            assert now["draft"]["every"] == 2 and now["policy"]["every"] == 1
            text = render(status(address))
            line = [ln for ln in text.splitlines() if "(destination, in_place, every 2" in ln]
            assert len(line) == 1 and line[0].strip().startswith("pool draft"), text
            assert line[0].endswith(f"serving v{serves['draft']}: 1"), text
        assert clients["draft"].served_version == 3
        assert [e for e in events["draft"] if e[0] != "hello"] == [
            ("pause", 1), ("commit", 1), ("pause", 3), ("commit", 3)
        ]  # fmt: skip
        kept = {r["version"]: r.get("kept") for r in status(address)["refits"]
                if r["model"] == CADENCE}  # fmt: skip
        assert kept == {1: None, 2: {"draft": 1}, 3: None}
    finally:
        for c in clients.values():
            c.close()
        trainer.close()


@pytest.mark.parametrize("bad", ["draft=2", "dsv3/draft=0", "dsv3/draft=x", "dsv3/=2"])
def test_pool_every_refuses_what_is_not_model_pool_k(bad: str) -> None:
    argv = ["serve", "--pool-every", bad]
    with pytest.raises(ValueError, match=r"pool_every: .* is not model/pool=k"):
        settings_from_args(build_parser(argv).parse_args(argv))
    argv = ["serve", "--pool-every", "dsv3/draft=4"]
    assert (
        settings_from_args(build_parser(argv).parse_args(argv)).pool_cadence("dsv3", "draft") == 4
    )
