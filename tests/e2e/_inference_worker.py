"""An inference rank as its own process, for fault tests (`python _inference_worker.py ...`).

Registers zeros for the TINY model's shards on `device`, follows version events and prints
one line per event on stdout: "ready <current_version>", "paused <v>", "commit <v> ok" or
"commit <v> mismatch <what>", "abort <v>", "incomplete <v> <reason>". With a gate
directory, the pause hook of version v waits (up to 60 s) for the file <gate>/<v>.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import torch

from refitd.client import InferenceClient, Placed
from refitd.demo.gpt import GptConfig, ParallelLayout, WeightGenerator, rank_shards

TINY = GptConfig(layers=2, hidden=64, ffn=256, vocab=512)
SEED = 23


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("address")
    p.add_argument("model")
    p.add_argument("--device", default="cpu:1")
    p.add_argument("--pool", default="infer")
    p.add_argument("--gate", default="")
    args = p.parse_args()
    gen = WeightGenerator(SEED)
    shards = rank_shards(TINY, ParallelLayout(), 0)
    dst = {s.name: torch.zeros(s.local_shape, dtype=torch.bfloat16) for s in shards}

    def pause(version: int) -> None:
        say(f"paused {version}")
        if args.gate:
            gate = os.path.join(args.gate, str(version))
            deadline = time.monotonic() + 60
            while not os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.02)

    client = InferenceClient(
        args.address,
        args.model,
        args.pool,
        rank=0,
        pool_size=1,
        device=args.device,
        pause=pause,
        incomplete=lambda v, reason: say(f"incomplete {v} {reason}"),
    )
    reg = client.register({n: Placed(t) for n, t in dst.items()})

    def on_event(event: object) -> None:
        kind, version = event.kind, event.version  # type: ignore[attr-defined]
        if kind == "commit":
            bad = [m for s in shards if (m := gen.mismatch(dst[s.name], s, version))]
            say(f"commit {version} " + ("ok" if not bad else f"mismatch {bad[0]}"))
        elif kind == "abort":
            say(f"abort {version}")

    client.on_update(on_event)
    say(f"ready {reg.current_version}")
    threading.Event().wait()


if __name__ == "__main__":
    main()
