"""Two models refit at once through one daemon: both land bit for bit, each in its own lane
of the shared communicator (collective links: the same two ranks carry both models'
messages), and the status document shows each model with its version and weight."""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator

import pytest
import torch

from refitd.client import InferenceClient, Placed, TrainerClient
from refitd.demo.gpt import GptConfig, ParallelLayout, WeightGenerator, rank_shards
from refitd.demo.run import Daemon

pytestmark = pytest.mark.slow

MODELS = {"policy": 3.0, "critic": 1.0}
VERSIONS = (1, 2, 3)
CONFIG = GptConfig(layers=2, hidden=256, ffn=1024, vocab=2048)  # ~7 MB of BF16 per model


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    weights = ",".join(f"{m}={w:g}" for m, w in MODELS.items())
    d = Daemon(
        cpu_slots=2,
        extra_args=["--links", "collective", "--model-weights", weights, "--log-level", "info"],
    )
    d.start()
    try:
        yield d
    finally:
        d.stop()


def _seed(model: str, version: int) -> int:
    return version * 10 + list(MODELS).index(model)


def _refit_at_once(sides: dict, shards: list, gen: WeightGenerator, version: int) -> dict:
    """Every model's trainer fills its own weights of `version` and refits it, all at once."""
    results: dict[str, str] = {}
    go = threading.Barrier(len(sides))

    def refit(model: str) -> None:
        trainer, src, _ = sides[model]
        for s in shards:  # each model its own weights: a crossed message shows
            gen.fill(src[s.name], s, _seed(model, version))
        go.wait(timeout=30)
        results[model] = trainer.refit(version, wait="committed", timeout=90).state

    threads = [threading.Thread(target=refit, args=(m,)) for m in sides]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def test_two_models_refit_at_once_bit_for_bit(daemon: Daemon) -> None:
    gen = WeightGenerator(7)
    shards = rank_shards(CONFIG, ParallelLayout(), 0)
    clients: list = []
    sides = {}
    try:
        for model in MODELS:
            src = {s.name: torch.zeros(s.local_shape, dtype=torch.bfloat16) for s in shards}
            dst = {s.name: torch.zeros(s.local_shape, dtype=torch.bfloat16) for s in shards}
            trainer = TrainerClient(daemon.address, model, rank=0, pool_size=1, device="cpu:0")
            infer = InferenceClient(daemon.address, model, "infer", 0, 1, "cpu:1")
            clients += [trainer, infer]
            trainer.register(src)
            infer.register({n: Placed(t) for n, t in dst.items()})
            hello = threading.Event()
            infer.on_update(lambda e, hello=hello: hello.set())  # HELLO first: subscribed
            assert hello.wait(30), f"{model}: no HELLO within 30 s"
            sides[model] = (trainer, src, dst)
        for version in VERSIONS:
            results = _refit_at_once(sides, shards, gen, version)
            assert results == {m: "committed" for m in MODELS}
            for model, (_, _, dst) in sides.items():
                bad = [
                    m for s in shards if (m := gen.mismatch(dst[s.name], s, _seed(model, version)))
                ]
                assert bad == [], f"{model} v{version}: {bad[:3]}"
        with urllib.request.urlopen(daemon.status_url + "v1/status", timeout=10) as r:
            doc = json.load(r)
        seen = {m["name"]: (m["committed_version"], m["weight"]) for m in doc["models"]}
        assert seen == {m: (VERSIONS[-1], w) for m, w in MODELS.items()}
        windows: dict[int, list[tuple[float, float]]] = {}
        for r in doc["refits"]:
            windows.setdefault(r["version"], []).append(
                (r["executes_sent_at"], r["transfer_done_at"])
            )
        overlapped = [v for v, ((s0, e0), (s1, e1)) in windows.items() if max(s0, s1) < min(e0, e1)]
        assert overlapped, f"the two models' transfers never ran at once: {windows}"
        for r in doc["refits"]:  # where each one's bytes began to arrive: inside its transfer
            where = (r["model"], r["version"])
            landed = (r["first_landed_at"], r["last_landed_at"])
            assert r["executes_sent_at"] < landed[0] <= landed[1] <= r["transfer_done_at"], where
            assert 0 < r["first_landed_bytes"] <= r["bytes"], where
    finally:
        for c in clients:
            c.close()
