"""A trainer or inference rank as its own process, driven by stdin lines, for the fault suite.

`python -m refitd.bench.faults.worker trainer|inference ADDRESS MODEL RANK DEVICE MB`

Trainer: on "step <v>" it fills its TP shard with version v and refits (wait committed),
then prints "refit <v> <state> <seconds> <message>". Inference: prints "ready <version>",
"paused <v> ok|mismatch" (the version served until the pause, checked before its ack:
nothing may have written it while it was served), "commit <v> ok|mismatch", "abort <v>
ok|mismatch" (the version it resumes serving) and "incomplete <v>"; every check is bit for
bit. The harness reads the lines on a thread. Both exit on "stop" or when stdin closes.

With `--density D` successive versions differ in about D of their elements (SparseVersions),
as an RL trainer's versions at a tiny learning rate do, so delta refits have something to do.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import threading
import time

import torch

from refitd.client import InferenceClient, MegatronCoords, Placed, RefitError, TrainerClient
from refitd.demo.gpt import (
    TABLE,
    GptConfig,
    ParallelLayout,
    WeightGenerator,
    megatron_parameter,
    rank_shards,
)

SEED = 77
TP = 2
TRAINER_POOL = "trainer"
INFERENCE_POOL = "infer"


class SparseVersions(WeightGenerator):
    """Weights whose successive versions differ in about `density` of their elements: each
    version redraws that fraction of the value table of the previous one (every element reads
    one table entry, so as many elements change). Any version is rebuilt from version 0;
    the last table per tensor is kept, so checking versions in order costs one step each."""

    def __init__(self, seed: int, density: float) -> None:
        super().__init__(seed)
        self.density = density
        self._last: dict[str, tuple[int, torch.Tensor]] = {}

    def table(self, canonical: str, version: int) -> torch.Tensor:
        at, table = self._last.get(canonical, (-1, None))
        if table is None or at > version:
            at, table = 0, super().table(canonical, 0)
        table = table.clone()
        for v in range(at + 1, version + 1):
            key = f"{self.seed}/sparse/{v}/{canonical}".encode()
            digest = hashlib.blake2b(key, digest_size=8).digest()
            gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
            pick = torch.rand(TABLE, generator=gen) < self.density
            table[pick] = (torch.randn(int(pick.sum()), generator=gen) * 0.02).to(table.dtype)
        self._last[canonical] = (version, table)
        return table


def generator(density: float | None) -> WeightGenerator:
    """Fresh weights per version, or sparse successive versions with a density."""
    return WeightGenerator(SEED) if density is None else SparseVersions(SEED, density)


def model_config(mb: float) -> GptConfig:
    """The suite's model: 2 layers of about `mb` MB of BF16 weights."""
    return GptConfig.for_megabytes(mb, layers=2)


def say(line: str) -> None:
    sys.stdout.write(line.replace("\n", " ") + "\n")
    sys.stdout.flush()


def _register(client: TrainerClient | InferenceClient, tensors: dict, coords: object) -> object:
    """Register, waiting out a controller or agent that is not back yet (60 s at most)."""
    deadline = time.monotonic() + 60.0
    while True:
        try:
            return client.register(tensors, coords)  # type: ignore[arg-type]
        except RefitError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def trainer(args: argparse.Namespace) -> None:
    layout = ParallelLayout(tp=TP)
    cfg = model_config(args.mb)
    gen = generator(args.density)
    shards = rank_shards(cfg, layout, args.rank)
    tensors: dict[str, torch.Tensor] = {s.name: megatron_parameter(s) for s in shards}
    client = TrainerClient(
        args.address, args.model, TRAINER_POOL, args.rank, TP, args.device, rpc_timeout_s=5.0
    )
    _register(client, tensors, MegatronCoords(tp_rank=args.rank, tp_size=TP))
    say(f"ready {client.registration.current_version}")
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "stop":
            break
        version = int(words[1])
        with torch.no_grad():
            for s in shards:
                gen.fill(tensors[s.name], s, version)
        t0 = time.monotonic()
        try:
            r = client.refit(version, wait="committed", timeout=args.refit_timeout)
            say(f"refit {version} {r.state} {time.monotonic() - t0:.3f} {r.message}")
        except RefitError as err:
            say(f"refit {version} failed {time.monotonic() - t0:.3f} {err}")
    client.close()


def inference(args: argparse.Namespace) -> None:
    layout = ParallelLayout(tp=TP)
    cfg = model_config(args.mb)
    gen = generator(args.density)
    shards = rank_shards(cfg, layout, args.rank)
    dst = {s.name: torch.zeros(s.local_shape, dtype=torch.bfloat16) for s in shards}
    placed = {s.name: Placed(dst[s.name], s.global_shape, s.boxes, canonical=s.canonical)
              for s in shards}  # fmt: skip

    def check(version: int) -> str:
        bad = [m for s in shards if (m := gen.mismatch(dst[s.name], s, version))]
        return "ok" if not bad else "mismatch " + bad[0]

    served = [0]  # the version being served (0: not serving: new, paused or incomplete)

    def paused(version: int) -> None:
        # Checked before the PAUSE ack: nothing may have written it while it was served.
        say(f"paused {version} " + (check(served[0]) if served[0] else "ok"))
        served[0] = 0

    client = InferenceClient(
        args.address,
        args.model,
        INFERENCE_POOL,
        args.rank,
        TP,
        args.device,
        pause=paused,
        incomplete=lambda v, reason: say(f"incomplete {v} {reason}"),
        rpc_timeout_s=5.0,
    )
    reg = _register(client, placed, None)

    def on_event(event: object) -> None:
        kind, version = event.kind, event.version  # type: ignore[attr-defined]
        if kind == "commit":
            served[0] = version
            say(f"commit {version} {check(version)}")
        elif kind == "abort":
            served[0] = client.served_version or 0
            say(f"abort {version} " + (check(served[0]) if served[0] else "ok"))
        elif kind == "incomplete":
            served[0] = 0

    client.on_update(on_event)
    say(f"ready {reg.current_version}")  # type: ignore[attr-defined]
    for line in sys.stdin:
        if line.strip() == "stop":
            break
    client.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["trainer", "inference"])
    p.add_argument("address")
    p.add_argument("model")
    p.add_argument("rank", type=int)
    p.add_argument("device")
    p.add_argument("mb", type=float)
    p.add_argument("--refit-timeout", type=float, default=20.0)
    p.add_argument("--density", type=float, default=None, help="sparse successive versions")
    args = p.parse_args()
    torch.set_num_threads(1)
    threading.current_thread().name = f"{args.role}-{args.rank}"
    (trainer if args.role == "trainer" else inference)(args)


if __name__ == "__main__":
    main()
