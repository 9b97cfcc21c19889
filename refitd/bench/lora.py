"""`refitd bench lora`: LoRA adapter refits (no pause, a slot flip) beside a dense refit of
the same model.

Starts `refitd serve` (2 CPU slots). A Llama-shaped model (`--layers`, `--hidden`) has
`--adapters` LoRA adapters of rank `--rank` on q/k/v/o and gate/up/down, each its own
refitd model: a trainer rank on cpu:0 holding the adapter's PEFT-named A and B, and an
engine rank on cpu:1 holding it in two slots of vLLM-shaped stacked buffers
(`register_adapter`; on CPU each adapter has buffers of its own: two clients of one process
cannot share storages, which each moves into its own shared memory). A dense model of the same shape is
refitted from an HF-named trainer into the engine layout of vLLM (fused qkv / gate_up).
Each refit waits until every engine rank serves it (`wait="served"`). Times are medians
after a warm-up; `pauses` counts PAUSE events and pause hooks of the adapter ranks (0
expected); `verified`: every served slot and the dense weights equal the trainer's
tensors of the last version, bit for bit. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Mapping

import torch

from clients.engine_layouts import EngineLayout, EngineParallel, engine_placements
from clients.engine_layouts.layouts import llama_engine_layout
from clients.engine_layouts.lora import (
    lora_buffer_shapes,
    lora_engine_layout,
    lora_slot_views,
)
from clients.hf_names import LlamaDims
from refitd.client import InferenceClient, TrainerClient
from refitd.client.inference import VersionEvent
from refitd.demo.run import Daemon


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--adapters", type=int, default=8, help="LoRA adapters, one model each")
    p.add_argument("--rank", type=int, default=16, help="adapter rank")
    p.add_argument("--refits", type=int, default=6, help="refits per adapter (first: warm-up)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)


def _dims(args: argparse.Namespace) -> LlamaDims:
    heads = max(2, args.hidden // 64)
    return LlamaDims(
        layers=args.layers, hidden=args.hidden, heads=heads, kv_heads=heads // 2, head_dim=64,
        ffn=int(args.hidden * 2.75) // 64 * 64, vocab=8192,
    )  # fmt: skip


def _globals(layout: EngineLayout) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor the layout reads, with its global shape."""
    return {p.canonical: p.global_shape for t in layout.tensors for p in t.pieces}


def _fill(tensors: Mapping[str, torch.Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name in sorted(tensors):
        x = tensors[name]
        x.copy_(torch.randn(x.shape, generator=g))


def _matches(layout: EngineLayout, held: Mapping[str, torch.Tensor], src: Mapping) -> bool:
    """Each engine tensor equals the trainer's pieces it is made of, bit for bit."""
    for t in layout.tensors:
        for p in t.pieces:
            want = src[p.canonical].narrow(p.dim, p.start, p.length)
            if not torch.equal(held[t.name].narrow(p.dim, p.local, p.length), want):
                return False
    return True


class Engine:
    """The engine rank's side of one refitd model: events counted, served versions."""

    def __init__(self, client: InferenceClient) -> None:
        self.client = client
        self.pauses = 0
        self.hello = threading.Event()
        client.on_update(self._event)

    def _event(self, event: VersionEvent) -> None:
        self.pauses += event.kind == "pause"
        if event.kind == "hello":
            self.hello.set()


def run(args: argparse.Namespace) -> int:
    d = _dims(args)
    p = EngineParallel(1, 0)
    daemon = Daemon(cpu_slots=2, extra_args=["--log-level", "warning"]).start()
    clients: list[InferenceClient | TrainerClient] = []
    try:
        lora = lora_engine_layout(d, p, args.rank)
        shapes = lora_buffer_shapes(lora, 2, args.rank)
        hook_pauses = [0]
        adapters = []
        for i in range(args.adapters):
            buffers = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}
            src = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in _globals(lora).items()}
            trainer = TrainerClient(daemon.address, f"lora-{i}", device="cpu:0")
            trainer.register(src)
            inf = InferenceClient(
                daemon.address, f"lora-{i}", "infer", device="cpu:1",
                pause=lambda v: hook_pauses.__setitem__(0, hook_pauses[0] + 1),
            )  # fmt: skip
            inf.register_adapter(
                lambda s, b=buffers: engine_placements(lora_slot_views(b, lora, s), lora)
            )
            clients += [trainer, inf]
            adapters.append((trainer, src, Engine(inf), buffers))
        dense = llama_engine_layout(d, p, "vllm", source_naming="hf")
        dsrc = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in _globals(dense).items()}
        dtrainer = TrainerClient(daemon.address, "dense", device="cpu:0")
        dtrainer.register(dsrc)
        held = {t.name: torch.zeros(t.local_shape, dtype=torch.bfloat16) for t in dense.tensors}
        dinf = InferenceClient(daemon.address, "dense", "infer", device="cpu:1")
        dinf.register(engine_placements(held, dense))
        clients += [dtrainer, dinf]
        dengine = Engine(dinf)
        for e in [dengine, *(a[2] for a in adapters)]:
            if not e.hello.wait(30):
                raise RuntimeError("an engine rank never subscribed")

        def refit(trainer: TrainerClient, src: dict, version: int, seed: int) -> float:
            _fill(src, seed)
            t0 = time.perf_counter()
            r = trainer.refit(version, wait="served", timeout=120)
            if r.state != "committed" or not r.served:
                raise RuntimeError(f"{trainer.model} v{version}: {r.state} {r.message}")
            return time.perf_counter() - t0

        failures: list[BaseException] = []

        def refit_in_thread(trainer: TrainerClient, src: dict, version: int, seed: int) -> None:
            try:
                refit(trainer, src, version, seed)
            except BaseException as e:  # reported after the join
                failures.append(e)

        one, every, dense_s = [], [], []
        for v in range(1, args.refits + 1):
            # one adapter at a time (version 2v - 1), then all at once (version 2v)
            took = [refit(a[0], a[1], 2 * v - 1, 1000 * i + v) for i, a in enumerate(adapters)]
            t0 = time.perf_counter()
            threads = [
                threading.Thread(
                    target=refit_in_thread, args=(a[0], a[1], 2 * v, 1000 * i + 500 + v)
                )
                for i, a in enumerate(adapters)
            ]
            for th in threads:
                th.start()
            for th in threads:
                th.join(300)
            both = time.perf_counter() - t0
            if failures:
                raise RuntimeError(f"adapter refits at once: {failures[0]}") from failures[0]
            dtook = refit(dtrainer, dsrc, v, v)
            if v > 1:
                one += took
                every.append(both)
                dense_s.append(dtook)
        last = 2 * args.refits
        verified = _matches(dense, held, dsrc)
        for _, src, e, buffers in adapters:
            slot = e.client.serving_slot
            verified = verified and e.client.served_version == last and slot is not None
            verified = verified and _matches(lora, lora_slot_views(buffers, lora, slot or 0), src)
        adapter_ms = 1e3 * statistics.median(one)
        dense_ms = 1e3 * statistics.median(dense_s)
        nbytes = sum(x.numel() * 2 for x in adapters[0][1].values())
        print(
            json.dumps(
                {
                    "adapters": args.adapters,
                    "rank": args.rank,
                    "adapter_mb": round(nbytes / 1e6, 3),
                    "dense_mb": round(sum(x.numel() * 2 for x in dsrc.values()) / 1e6, 1),
                    "refits": args.refits - 1,
                    "adapter_refit_ms": round(adapter_ms, 2),
                    "all_adapters_refit_ms": round(1e3 * statistics.median(every), 2),
                    "dense_refit_ms": round(dense_ms, 2),
                    "adapter_over_dense": round(adapter_ms / dense_ms, 3),
                    "pauses": hook_pauses[0] + sum(a[2].pauses for a in adapters),
                    "verified": verified,
                }
            )
        )
        return 0 if verified else 1
    finally:
        for c in clients:
            c.close()
        daemon.stop()
