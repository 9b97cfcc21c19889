"""`refitd bench backend`: one start -> update -> finish sequence of the vLLM backend beside
refitd's plain client refit of the same model, in the same run (target: ratio <= 1.1).

Starts `refitd serve` (3 CPU slots) and two models of the same Llama shape (transformers
config, random BF16 weights, HF names), each with its own trainer rank on cpu:0: the plain
one feeds an InferenceClient rank on cpu:1 registered through the vLLM engine layout
(`refit(v, wait="served")`), the other a `refitd` WeightTransferEngine on cpu:2 built by
vLLM's factory (start, update_weights({"version": v}) beside `refit(v, wait="committed")`,
finish). Refits alternate, each path going first every other round; the first of each is
not timed (it plans). Both engine ranks are checked bit for bit against each other at the
end. Prints one JSON line with the medians, their ratio (the target), the ratio of the
fastest refits (less sensitive to a loaded machine) and the median time the sequence
spends beyond the trainer's refit call (start, the update's return, finish). Needs vLLM 0.33
(requirements/engines.txt).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from typing import Any

import torch

from refitd.client import InferenceClient, TrainerClient
from refitd.demo.run import Daemon

TARGET = 1.1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=512, help="Llama hidden size")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary")
    parser.add_argument("--refits", type=int, default=10, help="timed refits of each path")


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # vLLM reads a local config.json only
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    try:
        out = measure(args.hidden, args.layers, args.vocab, args.refits)
    except ImportError as exc:
        print(json.dumps({"bench": "backend", "error": f"needs vLLM 0.33: {exc}"}))
        return 1
    print(json.dumps(out))
    return 0 if out["ok"] else 1


def measure(hidden: int, layers: int, vocab: int, refits: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from clients.engine_layouts import EngineParallel, engine_layout_for, register_engine

    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3,
        num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=2,
        head_dim=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    weights = {n: t.detach().clone() for n, t in hf.state_dict().items()}
    del hf
    layout = engine_layout_for(cfg, EngineParallel(1, 0), "vllm", source_naming="hf")

    def engine_tensors() -> dict[str, torch.Tensor]:
        return {t.name: torch.zeros(t.local_shape, dtype=torch.bfloat16) for t in layout.tensors}

    daemon = Daemon(cpu_slots=3, extra_args=["--log-level", "warning"]).start()
    closers: list[Any] = []
    try:
        trainers, held = {}, {}
        for kind in ("plain", "backend"):
            t = TrainerClient(daemon.address, f"bench-{kind}", rank=0, device="cpu:0")
            closers.append(t.close)
            held[kind] = {n: w.clone() for n, w in weights.items()}
            t.register(held[kind])
            trainers[kind] = t
        plain_params = engine_tensors()
        plain = InferenceClient(daemon.address, "bench-plain", "infer", device="cpu:1")
        closers.append(plain.close)
        register_engine(plain, plain_params, layout)
        plain.on_update(lambda event: None)
        engine, backend_params = _backend_engine(cfg, engine_tensors(), daemon.address)
        closers.append(engine.shutdown)

        def refit_plain(v: int) -> float:
            t0 = time.perf_counter()
            result = trainers["plain"].refit(v, wait="served", timeout=300)
            if not result.served:
                raise RuntimeError(f"plain refit of v{v}: {result.message}")
            return time.perf_counter() - t0

        around: list[float] = []  # the sequence's time beyond the trainer's refit call

        def refit_backend(v: int) -> float:
            t0 = time.perf_counter()
            engine.start_weight_update()
            update = threading.Thread(target=engine.update_weights, args=({"version": v},))
            update.start()
            t1 = time.perf_counter()
            trainers["backend"].refit(v, wait="committed", timeout=300)
            t2 = time.perf_counter()
            update.join(300)
            engine.finish_weight_update(str(v))
            total = time.perf_counter() - t0
            if v > 1:
                around.append(total - (t2 - t1))
            return total

        times: dict[str, list[float]] = {"plain": [], "backend": []}
        paths = [("plain", refit_plain), ("backend", refit_backend)]
        for v in range(1, refits + 2):
            for kind, fn in paths if v % 2 else paths[::-1]:  # neither always goes first
                held[kind]["model.norm.weight"].fill_(float(v))  # a step's worth of change
                dt = fn(v)
                if v > 1:
                    times[kind].append(dt)
        same = all(torch.equal(plain_params[n], backend_params[n]) for n in plain_params)
        landed = engine.served_version == refits + 1
    finally:
        for close in reversed(closers):
            close()
        daemon.stop()
    plain_s = statistics.median(times["plain"])
    backend_s = statistics.median(times["backend"])
    ratio = backend_s / plain_s
    ratio_min = min(times["backend"]) / min(times["plain"])
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    return {
        "bench": "backend",
        "model_mb": round(nbytes / 2**20, 1),
        "refits": refits,
        "plain_s": round(plain_s, 4),
        "backend_s": round(backend_s, 4),
        "ratio": round(ratio, 3),
        "ratio_min": round(ratio_min, 3),
        "around_refit_s": round(statistics.median(around), 5),
        "target": TARGET,
        "bit_for_bit": same and landed,
        "ok": ratio <= TARGET and same and landed,
    }


def _backend_engine(
    cfg: Any, params: dict[str, torch.Tensor], controller: str
) -> tuple[Any, dict[str, torch.Tensor]]:
    """A `refitd` engine built by vLLM's factory for a module holding `params`."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    from clients.engine_layouts import engine_module
    from clients.vllm_backend import register
    from clients.vllm_backend.offline import worker_config

    register()
    module = engine_module(params)
    vc = worker_config(cfg, tempfile.mkdtemp(prefix="refitd-bench-backend-"))
    engine = WeightTransferEngineFactory.create_engine(
        vc.weight_transfer_config, vc, torch.device("cpu"), module
    )
    info = {"controller": controller, "model": "bench-backend", "device": "cpu:2"}
    engine.init_transfer_engine(engine.parse_init_info(info))
    return engine, dict(module.named_parameters())
