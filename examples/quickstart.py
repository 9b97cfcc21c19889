"""A trainer of two TP ranks refitting a one-rank inference engine through the daemon.

Run: `python examples/quickstart.py` (starts `refitd serve` itself on free loopback ports).
Each role is its own process, as in production; the inference side checks every version bit
for bit against what the trainer holds.
"""

from __future__ import annotations

import multiprocessing as mp
import sys

import torch

from refitd.client import InferenceClient, MegatronCoords, TrainerClient
from refitd.demo.run import Daemon

NAME = "decoder.layers.0.mlp.linear_fc1.weight"
ROWS, COLS, TP, STEPS = 2048, 512, 2, 3


def global_weight(step: int) -> torch.Tensor:
    """The trainer's full weight after `step` optimizer steps (what inference must see)."""
    g = torch.Generator().manual_seed(0)
    return (torch.randn(ROWS, COLS, generator=g) + 0.01 * step).to(torch.bfloat16)


def trainer(controller: str, tp_rank: int) -> None:
    # This rank's half of a column-parallel weight, with the attributes Megatron sets.
    rows = ROWS // TP
    weight = global_weight(0)[tp_rank * rows : (tp_rank + 1) * rows].clone()
    weight.tensor_model_parallel, weight.partition_dim, weight.partition_stride = True, 0, 1
    with TrainerClient(
        controller, model="gpt", pool="trainer", rank=tp_rank, pool_size=TP, device="cpu:0"
    ) as client:
        client.register({NAME: weight}, MegatronCoords(tp_rank=tp_rank, tp_size=TP))
        for step in range(1, STEPS + 1):
            with torch.no_grad():  # the optimizer step, in place
                weight.copy_(global_weight(step)[tp_rank * rows : (tp_rank + 1) * rows])
            client.refit(step, wait="committed")


def inference(controller: str, ready: mp.Event, result: mp.Queue) -> None:
    full = torch.empty(ROWS, COLS, dtype=torch.bfloat16)
    seen: list[tuple[int, bool]] = []
    with InferenceClient(
        controller,
        model="gpt",
        pool="infer",
        rank=0,
        pool_size=1,
        device="cpu:1",
        pause=lambda v: None,  # a real engine stops reading weights here
        resume=lambda v: seen.append((v, torch.equal(full, global_weight(v)))),
    ) as engine:
        engine.register({NAME: full})
        for event in engine.subscribe():
            if event.kind == "hello":
                ready.set()
            if event.kind == "commit" and event.version == STEPS:
                break
    result.put(seen)


def main() -> int:
    daemon = Daemon(cpu_slots=2).start()
    ctx = mp.get_context("spawn")
    ready, result = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=inference, args=(daemon.address, ready, result))]
    procs[0].start()
    try:
        if not ready.wait(60):
            raise TimeoutError("the inference worker did not subscribe within 60 s")
        procs += [ctx.Process(target=trainer, args=(daemon.address, r)) for r in range(TP)]
        for p in procs[1:]:
            p.start()
        seen = result.get(timeout=120)
        for p in procs:
            p.join(60)
        for version, equal in seen:
            print(f"version {version}: {'bit for bit' if equal else 'MISMATCH'}")
        ok = [v for v, _ in seen] == list(range(1, STEPS + 1)) and all(e for _, e in seen)
        ok = ok and all(p.exitcode == 0 for p in procs)
        print("quickstart", "ok" if ok else "FAILED")
        return 0 if ok else 1
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        daemon.stop()


if __name__ == "__main__":
    sys.exit(main())
