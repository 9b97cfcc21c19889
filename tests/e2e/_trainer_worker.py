"""A trainer rank as its own process (`python _trainer_worker.py ADDRESS MODEL RANK SIZE
DEVICE`), holding its tensor-parallel shard (tp = SIZE, Megatron attributes) of the TINY
model of _inference_worker.py. Prints "ready <worker_id>" ("refused <error>" and exits
when the registration is refused), then answers each stdin line "refit <v> <wait>" by
filling version v and refitting: "refit <v> <state> <served> <seconds> <message>" (state
"failed" and the error when it raises). Exits when stdin closes.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from _inference_worker import SEED, TINY  # a sibling: run as a script from this folder

from refitd.client import MegatronCoords, RefitError, TrainerClient
from refitd.demo.gpt import ParallelLayout, WeightGenerator, megatron_parameter, rank_shards


def say(line: str) -> None:
    sys.stdout.write(line.replace("\n", " ") + "\n")
    sys.stdout.flush()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("address")
    p.add_argument("model")
    p.add_argument("rank", type=int)
    p.add_argument("size", type=int)
    p.add_argument("device")
    args = p.parse_args()
    gen = WeightGenerator(SEED)
    shards = rank_shards(TINY, ParallelLayout(tp=args.size), args.rank)
    tensors: dict[str, torch.Tensor] = {s.name: megatron_parameter(s) for s in shards}
    client = TrainerClient(
        args.address, args.model, "trainer", args.rank, args.size, args.device, rpc_timeout_s=10
    )
    try:
        client.register(tensors, MegatronCoords(tp_rank=args.rank, tp_size=args.size))
    except RefitError as err:
        say(f"refused {err}")
        client.close(unregister=False)
        return
    say(f"ready {client.worker_id}")
    for line in sys.stdin:
        words = line.split()
        if len(words) != 3 or words[0] != "refit":
            continue
        version, wait = int(words[1]), words[2]
        with torch.no_grad():
            for s in shards:
                gen.fill(tensors[s.name], s, version)
        t0 = time.monotonic()
        try:
            r = client.refit(version, wait=wait, timeout=90)
            say(f"refit {version} {r.state} {r.served} {time.monotonic() - t0:.3f} {r.message}")
        except RefitError as err:
            say(f"refit {version} failed False {time.monotonic() - t0:.3f} {err}")
    client.close()


if __name__ == "__main__":
    main()
