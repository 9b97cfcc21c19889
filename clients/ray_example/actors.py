"""Trainer and inference workers as Ray actors on one machine, refitting through refitd.

The driver starts `refitd serve` (or points at a running controller), creates two trainer
actors (each holding half of every weight's rows, registered with explicit boxes) and one
inference actor (whole tensors), asks both trainer actors to refit version v at once, and
has the inference actor check what landed against weights regenerated from (seed, v).
"""

from __future__ import annotations

import threading
from typing import Any

import ray
import torch

from refitd.client import InferenceClient, Placed, TrainerClient

SHAPES = {"embed": (64, 32), "proj": (32, 32), "head": (48, 32)}


def weights(seed: int, version: int) -> dict[str, torch.Tensor]:
    """The global weights of `version` (the same on every actor)."""
    g = torch.Generator().manual_seed(seed * 1000 + version)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in SHAPES.items()}


@ray.remote(num_cpus=0)
class TrainerActor:
    """Trainer rank `rank` of `ranks`: rows [rank*n/ranks, ...) of every weight."""

    def __init__(self, controller: str, model: str, rank: int, ranks: int, seed: int) -> None:
        self.rank, self.ranks, self.seed = rank, ranks, seed
        self.local: dict[str, torch.Tensor] = {}
        placed: dict[str, Any] = {}
        for n, (rows, cols) in SHAPES.items():
            part = rows // ranks
            self.local[n] = torch.zeros(part, cols, dtype=torch.bfloat16)
            placed[n] = Placed(
                self.local[n], (rows, cols), [((rank * part, 0), (part, cols), (0, 0))]
            )
        self.client = TrainerClient(controller, model, rank=rank, pool_size=ranks,
                                    device=f"cpu:{rank}")  # fmt: skip
        self.client.register(placed)

    def step(self, version: int) -> None:
        """Stands for an optimizer step: the weights of `version`, written in place."""
        for n, w in weights(self.seed, version).items():
            part = w.shape[0] // self.ranks
            self.local[n].copy_(w[self.rank * part : (self.rank + 1) * part])

    def refit(self, version: int) -> str:
        return self.client.refit(version, wait="committed", timeout=60).state

    def close(self) -> None:
        self.client.close()


@ray.remote(num_cpus=0)
class InferenceActor:
    """One inference rank holding every weight whole."""

    def __init__(self, controller: str, model: str, seed: int, device: str = "cpu:0") -> None:
        self.seed = seed
        self.tensors = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in SHAPES.items()}
        self.client = InferenceClient(controller, model, "infer", rank=0, pool_size=1,
                                      device=device)  # fmt: skip
        self.client.register({n: Placed(t) for n, t in self.tensors.items()})
        hello = threading.Event()
        self.client.on_update(lambda event: hello.set() if event.kind == "hello" else None)
        if not hello.wait(30):  # a refit needs every inference worker subscribed
            raise TimeoutError("inference actor: no subscription to refitd within 30 s")

    def mismatches(self, version: int) -> list[str]:
        want = weights(self.seed, version)
        return [n for n, t in self.tensors.items() if not torch.equal(t, want[n])]

    def served_version(self) -> int | None:
        return self.client.served_version

    def close(self) -> None:
        self.client.close()


def run(controller: str, model: str = "ray-example", refits: int = 1, seed: int = 0) -> list[dict]:
    """Create the actors, refit `refits` versions, check each; returns one row per refit.
    Call after ray.init()."""
    infer = InferenceActor.remote(controller, model, seed)
    trainers = [TrainerActor.remote(controller, model, r, 2, seed) for r in range(2)]
    rows = []
    try:
        ray.get(infer.served_version.remote(), timeout=120)  # registered
        for v in range(1, refits + 1):
            ray.get([t.step.remote(v) for t in trainers], timeout=60)
            states = ray.get([t.refit.remote(v) for t in trainers], timeout=120)
            bad = ray.get(infer.mismatches.remote(v), timeout=60)
            rows.append({"version": v, "states": states, "mismatches": bad})
    finally:
        ray.get([a.close.remote() for a in [*trainers, infer]], timeout=60)
    return rows
