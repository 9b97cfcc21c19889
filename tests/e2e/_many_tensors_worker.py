"""A worker holding many small tensors, as its own process (`python _many_tensors_worker.py`).

Both roles build the same `count` tensors (mixed sizes from 1 element to 1 MiB, float32 and
bfloat16, 1-D and 2-D) from `seed`. The trainer fills version v from a known pattern of the
version and the tensor's place in a flat global buffer; the inference rank starts at zeros
and, on each commit, compares every tensor with that pattern bit for bit.

stdout lines: "ready <seconds to register> <open descriptors>", then per version: trainer
"refit <v> <state>" (after stdin line "refit <v>"), inference "commit <v> ok" or
"commit <v> mismatch <what>".
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import torch

from refitd.client import InferenceClient, Placed, TrainerClient

MIB_EVERY = 2000  # every MIB_EVERY-th tensor holds 1 MiB; the others 1..512 elements


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def shapes(count: int, seed: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    g = torch.Generator().manual_seed(seed)
    small = torch.randint(1, 513, (count,), generator=g).tolist()
    kinds = torch.randint(0, 4, (count,), generator=g).tolist()
    out: list[tuple[tuple[int, ...], torch.dtype]] = []
    for i, (n, kind) in enumerate(zip(small, kinds, strict=True)):
        dtype = torch.bfloat16 if kind % 2 else torch.float32
        if i % MIB_EVERY == MIB_EVERY - 1:
            n = (1 << 20) // (4 if dtype == torch.float32 else 2)
        shape = (n // 8, 8) if kind >= 2 and n >= 8 and n % 8 == 0 else (n,)
        out.append((shape, dtype))
    return out


def expected(total: int, version: int) -> torch.Tensor:
    """The global flat buffer of version v: small integers, exact in float32 and bfloat16."""
    return ((torch.arange(total, dtype=torch.int32) * 7 + version * 101) % 251 - 125).float()


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1).float() for t in tensors])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("address")
    p.add_argument("model")
    p.add_argument("role", choices=("trainer", "infer"))
    p.add_argument("--count", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--device", default="cpu:0")
    args = p.parse_args()
    layout = shapes(args.count, args.seed)
    tensors = [torch.zeros(s, dtype=d) for s, d in layout]
    total = sum(t.numel() for t in tensors)
    named = {f"block{i // 100}.t{i}": t for i, t in enumerate(tensors)}
    if args.role == "trainer":
        client: TrainerClient | InferenceClient = TrainerClient(
            args.address, args.model, rank=0, pool_size=1, device=args.device
        )
    else:
        client = InferenceClient(
            args.address, args.model, "infer", rank=0, pool_size=1, device=args.device
        )

        def on_event(event: object) -> None:
            if event.kind != "commit":  # type: ignore[attr-defined]
                return
            v = event.version  # type: ignore[attr-defined]
            got, want = flat(tensors), expected(total, v)
            if torch.equal(got, want):
                say(f"commit {v} ok")
            else:
                bad = int((got != want).nonzero()[0])
                say(f"commit {v} mismatch at flat element {bad}: {got[bad]} != {want[bad]}")

    t0 = time.monotonic()
    client.register({n: Placed(t) for n, t in named.items()})
    if isinstance(client, InferenceClient):
        client.on_update(on_event)
    fds = len(os.listdir("/proc/self/fd"))
    say(f"ready {time.monotonic() - t0:.3f} {fds}")
    if args.role == "infer":
        threading.Event().wait()
    for line in sys.stdin:
        v = int(line.split()[1])
        want, pos = expected(total, v), 0
        for t in tensors:
            t.copy_(want[pos : pos + t.numel()].view(t.shape))
            pos += t.numel()
        result = client.refit(v, wait="committed", timeout=120)  # type: ignore[union-attr]
        say(f"refit {v} {result.state} {result.message}".rstrip())


if __name__ == "__main__":
    main()
