"""The draft pool's ranks in a process of their own (so a test can kill -9 them): `tp`
ranks of vLLM's MTP draft model of the tiny DeepSeek-V3 (_draft_models), registered in
place as pool `draft` of the model. One line per event on stdout: "ready", "paused <v>",
"commit <v> <rank> <digest>" with the digest of what the rank holds (_draft_models.digest),
which the test compares with what vLLM's loaders make of version v. It registers once a
line comes on stdin, so a test can start it ahead (its imports take seconds)."""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch
from _draft_models import digest, layouts, shapes_of
from _engine_models import PAD_FILL

from clients.engine_layouts import register_engine
from clients.hf_names import DeepseekV3Dims
from refitd.client import InferenceClient


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("address")
    p.add_argument("model")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dims", required=True, help="DeepseekV3Dims as JSON")
    args = p.parse_args()
    say_lock = threading.Lock()

    def say(line: str) -> None:
        with say_lock:
            print(line, flush=True)

    lays = layouts(args.tp, True, DeepseekV3Dims(**json.loads(args.dims)))
    held = [
        {n: torch.full(s, PAD_FILL, dtype=torch.bfloat16) for n, s in shapes_of(lays)(r).items()}
        for r in range(args.tp)
    ]

    def resume(rank: int, version: int) -> None:
        say(f"commit {version} {rank} {digest(held[rank])}")

    say("started")
    sys.stdin.readline()
    clients = []
    for r in range(args.tp):
        c = InferenceClient(
            args.address, args.model, "draft", r, args.tp, f"cpu:{1 + r}",
            pause=lambda v: say(f"paused {v}"),
            resume=lambda v, r=r: resume(r, v),
        )  # fmt: skip
        register_engine(c, held[r], lays[r])
        c.on_update(lambda e: None)
        clients.append(c)
    say("ready")
    sys.stdin.read()  # until the test closes stdin (or kills this process)
    for c in clients:
        c.close()


if __name__ == "__main__":
    main()
