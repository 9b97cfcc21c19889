"""`refitd bench staged`: pause window and refit time of a staged vs an in-place pool.

Starts `refitd serve` (3 CPU slots), a trainer rank on cpu:0 for two models of the same
GPT shape, an in-place inference rank of the first on cpu:1 and a staged one of the second
on cpu:2, then alternates refits of the two. The pause window is measured in the inference
rank, from its PAUSE ack (the pause hook returning) to the COMMIT (the resume hook); the
refit time is the trainer's Refit call waiting for the commit. The last version is checked
bit for bit. Prints one JSON line with medians and the staged / in-place ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch

from refitd.client import InferenceClient, Placed, TrainerClient
from refitd.demo.gpt import GptConfig, ParallelLayout, WeightGenerator, rank_shards
from refitd.demo.run import Daemon

SEED = 7


class Rank:
    """An inference rank that times each PAUSE ack -> COMMIT window."""

    def __init__(self, address: str, model: str, cfg: GptConfig, device: str, staged: bool):
        self.shards = rank_shards(cfg, ParallelLayout(), 0)
        self.dst = {s.name: torch.zeros(s.local_shape, dtype=torch.bfloat16) for s in self.shards}
        self.acked: dict[int, float] = {}
        self.windows: dict[int, float] = {}
        self.committed = threading.Condition()
        self.client = InferenceClient(
            address,
            model,
            "infer",
            device=device,
            staged=staged,
            pause=lambda v: self.acked.__setitem__(v, time.perf_counter()),
            resume=self._resume,
        )
        self.client.register({n: Placed(t) for n, t in self.dst.items()})
        self.client.on_update(lambda event: None)

    def _resume(self, version: int) -> None:
        with self.committed:
            if version in self.acked:
                self.windows[version] = time.perf_counter() - self.acked[version]
            self.committed.notify_all()

    def wait_window(self, version: int, timeout_s: float = 60.0) -> float:
        with self.committed:
            if not self.committed.wait_for(lambda: version in self.windows, timeout_s):
                raise RuntimeError(f"no COMMIT of version {version}")
            return self.windows[version]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--refits", type=int, default=11, help="refits per mode (first is warm-up)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=16384)


def run(args: argparse.Namespace) -> int:
    cfg = GptConfig(layers=args.layers, hidden=args.hidden, ffn=4 * args.hidden, vocab=args.vocab)
    gen = WeightGenerator(SEED)
    daemon = Daemon(cpu_slots=3, extra_args=["--log-level", "warning"]).start()
    clients: list[InferenceClient | TrainerClient] = []
    try:
        modes = {"in_place": ("cpu:1", False), "staged": ("cpu:2", True)}
        shards = rank_shards(cfg, ParallelLayout(), 0)
        trainers, ranks, srcs = {}, {}, {}
        for mode, (device, staged) in modes.items():
            srcs[mode] = {s.name: torch.zeros(s.local_shape, dtype=torch.bfloat16) for s in shards}
            trainers[mode] = TrainerClient(daemon.address, f"gpt-{mode}", device="cpu:0")
            trainers[mode].register(srcs[mode])
            ranks[mode] = Rank(daemon.address, f"gpt-{mode}", cfg, device, staged)
            clients += [trainers[mode], ranks[mode].client]
        time.sleep(1.0)  # subscriptions open
        refit_s: dict[str, list[float]] = {m: [] for m in modes}
        pause_s: dict[str, list[float]] = {m: [] for m in modes}
        for version in range(1, args.refits + 1):
            for mode in modes:
                for s in shards:
                    gen.fill(srcs[mode][s.name], s, version)
                t0 = time.perf_counter()
                r = trainers[mode].refit(version, wait="committed", timeout=120)
                took = time.perf_counter() - t0
                if r.state != "committed":
                    raise RuntimeError(f"{mode} refit {version}: {r.state} {r.message}")
                window = ranks[mode].wait_window(version)
                if version > 1:
                    refit_s[mode].append(took)
                    pause_s[mode].append(window)
        for mode in modes:
            bad = [
                m for s in shards if (m := gen.mismatch(ranks[mode].dst[s.name], s, args.refits))
            ]
            if bad:
                raise RuntimeError(f"{mode}: version {args.refits} landed wrong: {bad[0]}")
        med = {
            m: {
                "pause_ms": 1e3 * statistics.median(pause_s[m]),
                "refit_ms": 1e3 * statistics.median(refit_s[m]),
            }
            for m in modes
        }
        mb = sum(t.numel() * t.element_size() for t in srcs["staged"].values()) / 1e6
        print(
            json.dumps(
                {
                    "model_mb": round(mb, 1),
                    "refits": args.refits - 1,
                    **{f"{m}_{k}": round(v, 2) for m in modes for k, v in med[m].items()},
                    "pause_ratio_staged_over_in_place": round(
                        med["staged"]["pause_ms"] / med["in_place"]["pause_ms"], 3
                    ),
                    "refit_ratio_staged_over_in_place": round(
                        med["staged"]["refit_ms"] / med["in_place"]["refit_ms"], 3
                    ),
                    "bit_exact": True,
                }
            )
        )
        return 0
    finally:
        for c in clients:
            c.close()
        daemon.stop()
