"""End to end over real gRPC on loopback: controller, embedded node agent, transfer
processes and worker processes linking refitd.client; weights checked bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch

from refitd._proto import refitd_pb2 as pb
from refitd._proto import refitd_pb2_grpc as pbg
from refitd.client import InferenceClient, Placed, RefitError, TrainerClient
from refitd.demo.gpt import GptConfig, ParallelLayout, WeightGenerator, rank_shards
from refitd.demo.run import Daemon, Demo

pytestmark = pytest.mark.slow

TINY = GptConfig(layers=2, hidden=64, ffn=256, vocab=512)


def test_refit_lands_bit_for_bit_in_two_pools_in_version_order(daemon: Daemon) -> None:
    """tp=2 x pp=2 trainer -> pool A tp=2 and pool B tp=1 x dp=2, separate processes."""
    seen: list[tuple] = []
    demo = Demo(daemon.address, TINY, timeout_s=90.0, say=lambda s: None)
    try:
        demo.start()
        for v in (1, 2, 3):
            line = demo.refit(v)  # raises unless every inference rank matched bit for bit
            seen.append((v, line.bytes))
    finally:
        demo.close()
    assert [v for v, _ in seen] == [1, 2, 3]
    assert all(b > 0 for _, b in seen)


def _pair(daemon: Daemon, model: str, pause=None):
    """One trainer rank on cpu:0 and one inference rank on cpu:1 holding `model` replicas."""
    shards = rank_shards(TINY, ParallelLayout(), 0)
    src = {s.name: torch.zeros(s.local_shape, dtype=torch.bfloat16) for s in shards}
    dst = {s.name: torch.zeros(s.local_shape, dtype=torch.bfloat16) for s in shards}
    trainer = TrainerClient(daemon.address, model, rank=0, pool_size=1, device="cpu:0")
    trainer.register(src)
    events: list = []
    infer = InferenceClient(
        daemon.address, model, "infer", rank=0, pool_size=1, device="cpu:1", pause=pause
    )
    infer.register({n: Placed(t) for n, t in dst.items()})
    infer.on_update(events.append)
    return shards, src, dst, trainer, infer, events


def _fill(gen: WeightGenerator, shards, tensors, version: int) -> None:
    for s in shards:
        gen.fill(tensors[s.name], s, version)


def _mismatches(gen: WeightGenerator, shards, tensors, version: int) -> list[str]:
    return [m for s in shards if (m := gen.mismatch(tensors[s.name], s, version))]


def _pending(daemon: Daemon, model: str) -> list[int]:
    """Versions of `model` requested and waiting, from the controller's status."""
    with grpc.insecure_channel(daemon.address) as ch:
        doc = json.loads(pbg.RefitStub(ch).GetStatus(pb.StatusRequest(model=model), timeout=5).json)
    return [p["version"] for m in doc["models"] for p in m["pending"]]


def _until(what: str, pred, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"{what} not within {timeout_s:g}s"
        time.sleep(0.02)


def test_refit_during_a_running_one_coalesces_to_newest(daemon: Daemon) -> None:
    gen = WeightGenerator(7)
    gate, paused = threading.Event(), threading.Event()

    def pause(v: int) -> None:
        if v == 1:  # v1 waits in PAUSE on our hook until v2 and v3 are requested
            paused.set()
            gate.wait(30)

    shards, src, dst, trainer, infer, events = _pair(daemon, "coalesce", pause=pause)
    try:
        _fill(gen, shards, src, 1)
        results: dict[int, object] = {}

        def ask(v: int) -> None:
            results[v] = trainer.refit(v, wait="committed", timeout=60)

        threads = [threading.Thread(target=ask, args=(v,)) for v in (1, 2, 3)]
        threads[0].start()
        assert paused.wait(60), "v1 never paused the inference rank"
        threads[1].start()
        _until("v2 pending", lambda: _pending(daemon, "coalesce") == [2])
        threads[2].start()
        _until("v3 pending", lambda: _pending(daemon, "coalesce") == [2, 3])
        _fill(gen, shards, src, 3)  # v1's bytes: not yet read (pool paused before transfer)
        gate.set()
        for t in threads:
            t.join(90)
        states = {v: r.state for v, r in results.items()}
        assert states == {1: "committed", 2: "superseded", 3: "committed"}
        # served_version is published only after the commit event was delivered.
        _until("v3 served", lambda: infer.served_version == 3, 10)
        assert _mismatches(gen, shards, dst, 3) == []
        commits = [e.version for e in events if e.kind == "commit"]
        assert commits == [1, 3]
        ids = [e.event_id for e in events]
        assert ids == sorted(ids)
    finally:
        gate.set()
        infer.close()
        trainer.close()


def test_storage_move_is_caught_on_both_sides(daemon: Daemon) -> None:
    gen = WeightGenerator(11)
    shards, src, dst, trainer, infer, _ = _pair(daemon, "moves")
    try:
        _fill(gen, shards, src, 1)
        assert trainer.refit(1, wait="committed", timeout=60).state == "committed"
        assert _mismatches(gen, shards, dst, 1) == []

        # Trainer side: a moved storage is refused with on_move="error" ...
        name = shards[1].name
        src[name].data = torch.zeros_like(src[name])  # new storage, same tensor object
        trainer.on_move = "error"
        with pytest.raises(RefitError, match=name.replace(".", r"\.")):
            trainer.refit(2, timeout=60)
        # ... and registered again by default, after which the new storage is what lands.
        trainer.on_move = "reregister"
        _fill(gen, shards, src, 2)
        assert trainer.refit(2, wait="committed", timeout=60).state == "committed"
        assert _mismatches(gen, shards, dst, 2) == []

        # Inference side: the PAUSE ack names the moved tensor, the refit fails asking for
        # re-registration (the client re-registers by itself), and the next refit lands.
        dname = shards[0].name
        dst[dname].data = torch.zeros_like(dst[dname])
        _fill(gen, shards, src, 3)
        with pytest.raises(RefitError, match="regist"):
            trainer.refit(3, wait="committed", timeout=60)
        _fill(gen, shards, src, 4)
        assert trainer.refit(4, wait="committed", timeout=60).state == "committed"
        assert _mismatches(gen, shards, dst, 4) == []
    finally:
        infer.close()
        trainer.close()


def test_demo_command_runs_green() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "refitd.cli.main", "demo", "--refits", "2", "--model-mb", "16"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "refit v2:" in proc.stdout
    assert "GB/s" in proc.stdout and "http://127.0.0.1:" in proc.stdout
