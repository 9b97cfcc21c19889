"""An inference rank as its own process, for fault tests (`python _inference_worker.py ...`).

Registers zeros for the TINY model's shards on `device`, follows version events and prints
one line per event on stdout: "ready <current_version>", "paused <v>", "commit <v> ok" or
"commit <v> mismatch <what>", "abort <v>", "incomplete <v> <reason>". With a gate
directory, the pause hook of version v waits (up to 60 s) for the file <gate>/<v>. With a
resume gate, the resume hook of v prints "resuming <v>" and waits (up to 60 s) for the file
<resume gate>/<v>; --resume-delay makes every resume that slow (a slow engine). With
--queries it answers each "query" line on stdin with "served <served_version> <state>",
read on the main thread (not the one delivering events).
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


def wait_for(path: str) -> None:
    """Until the file exists (the test's gate), 60 s at most."""
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("address")
    p.add_argument("model")
    p.add_argument("--device", default="cpu:1")
    p.add_argument("--pool", default="infer")
    p.add_argument("--gate", default="")
    p.add_argument("--resume-gate", default="")
    p.add_argument("--resume-delay", type=float, default=0.0)
    p.add_argument("--queries", action="store_true")
    args = p.parse_args()
    gen = WeightGenerator(SEED)
    shards = rank_shards(TINY, ParallelLayout(), 0)
    dst = {s.name: torch.zeros(s.local_shape, dtype=torch.bfloat16) for s in shards}

    def pause(version: int) -> None:
        say(f"paused {version}")
        if args.gate:
            wait_for(os.path.join(args.gate, str(version)))

    def resume(version: int) -> None:
        if args.resume_gate:
            say(f"resuming {version}")
            wait_for(os.path.join(args.resume_gate, str(version)))
        time.sleep(args.resume_delay)  # a slow engine, not a synchronisation

    client = InferenceClient(
        args.address,
        args.model,
        args.pool,
        rank=0,
        pool_size=1,
        device=args.device,
        pause=pause,
        resume=resume,
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
    if not args.queries:
        threading.Event().wait()
    for line in sys.stdin:
        if line.strip() == "query":
            say(f"served {client.served_version} {client.state}")


if __name__ == "__main__":
    main()
