"""The worker ranks of one emulated host in one process, driven by stdin lines.

`python -m refitd.bench.cluster.host_workers ADDRESS MODEL --mb MB
[--rank POOL:RANK:SIZE:DEVICE ...]`

Every rank is its own client (a TrainerClient for pool "trainer", else an InferenceClient)
holding its TP shard of a GPT-like model (refitd.demo.gpt; trainer shards carry Megatron
attributes, inference shards explicit boxes). Lines out: "ready" once every rank registered;
"refit POOL RANK V STATE SECONDS MESSAGE" per trainer rank and "step"; "commit POOL RANK V
ok|mismatch ...", "abort POOL RANK V ok|mismatch ...", "incomplete POOL RANK V", "paused
POOL RANK V ok|mismatch" (the served version checked before the pause ack: nothing may
have written it while served), all bit for bit; "status JSON" for "status". Lines in:
"step V [TIMEOUT]" (trainer ranks fill version V and refit it, wait committed, at once),
"status", "stop". Without ranks it only answers "status" (a light probe: no torch).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

SEED = 1234
PRINT = threading.Lock()


def say(line: str) -> None:
    with PRINT:
        sys.stdout.write(line.replace("\n", " ") + "\n")
        sys.stdout.flush()


@dataclass(frozen=True)
class RankSpec:
    pool: str
    rank: int
    size: int
    device: str

    @classmethod
    def parse(cls, text: str) -> RankSpec:
        pool, rank, size, dev_kind, dev_index = text.split(":")
        return cls(pool, int(rank), int(size), f"{dev_kind}:{dev_index}")


def _register(client: Any, tensors: dict, coords: Any, deadline_s: float = 60.0) -> Any:
    from refitd.client import RefitError

    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return client.register(tensors, coords)
        except RefitError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


class Ranks:
    """The ranks of this process and their checks."""

    def __init__(self, args: argparse.Namespace) -> None:
        from refitd.demo.gpt import GptConfig, WeightGenerator

        self.args = args
        self.config = GptConfig.for_megabytes(args.mb, layers=2)
        self.gen = WeightGenerator(SEED)
        self.trainers: list[tuple[RankSpec, Any, dict, list]] = []
        self.inference: list[Any] = []

    def start(self, specs: list[RankSpec]) -> None:
        threads = [threading.Thread(target=self._start_one, args=(s,)) for s in specs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _start_one(self, spec: RankSpec) -> None:
        import torch

        from refitd.client import InferenceClient, MegatronCoords, Placed, TrainerClient
        from refitd.demo.gpt import ParallelLayout, megatron_parameter, rank_shards

        layout = ParallelLayout(tp=spec.size)
        shards = rank_shards(self.config, layout, spec.rank)
        a = self.args
        if spec.pool == "trainer":
            tensors: dict[str, Any] = {s.name: megatron_parameter(s) for s in shards}
            client = TrainerClient(a.address, a.model, spec.pool, spec.rank, spec.size,
                                   spec.device, rpc_timeout_s=a.rpc_timeout)  # fmt: skip
            _register(client, tensors, MegatronCoords(tp_rank=spec.rank, tp_size=spec.size))
            self.trainers.append((spec, client, tensors, shards))
            return
        dst = {s.name: torch.zeros(s.local_shape, dtype=torch.bfloat16) for s in shards}
        placed = {
            s.name: Placed(dst[s.name], s.global_shape, s.boxes, canonical=s.canonical)
            for s in shards
        }
        self.inference.append(self._inference(spec, dst, shards, placed, InferenceClient))

    def _inference(self, spec: RankSpec, dst: dict, shards: list, placed: dict, cls: Any) -> Any:
        who = f"{spec.pool} {spec.rank}"
        served = [0]

        def check(version: int) -> str:
            bad = [m for s in shards if (m := self.gen.mismatch(dst[s.name], s, version))]
            return "ok" if not bad else "mismatch " + bad[0]

        def paused(version: int) -> None:
            checked = served[0] and not self.args.no_pause_check
            say(f"paused {who} {version} " + (check(served[0]) if checked else "ok"))
            served[0] = 0

        client = cls(self.args.address, self.args.model, spec.pool, spec.rank, spec.size,
                     spec.device, pause=paused, rpc_timeout_s=self.args.rpc_timeout,
                     incomplete=lambda v, reason: say(f"incomplete {who} {v} {reason}"))  # fmt: skip

        def on_event(event: Any) -> None:
            if event.kind == "commit":
                served[0] = event.version
                say(f"commit {who} {event.version} {check(event.version)}")
            elif event.kind == "abort":
                served[0] = client.served_version or 0
                say(f"abort {who} {event.version} " + (check(served[0]) if served[0] else "ok"))
            elif event.kind == "incomplete":
                served[0] = 0

        _register(client, placed, None)
        client.on_update(on_event)
        return client

    def step(self, version: int, timeout_s: float) -> None:
        def one(spec: RankSpec, client: Any, tensors: dict, shards: list) -> None:
            import torch

            from refitd.client import RefitError

            with torch.no_grad():
                for s in shards:
                    self.gen.fill(tensors[s.name], s, version)
            t0 = time.monotonic()
            try:
                r = client.refit(version, wait="committed", timeout=timeout_s)
                state, msg = r.state, r.message
            except RefitError as err:
                state, msg = "failed", str(err)
            took = time.monotonic() - t0
            say(f"refit {spec.pool} {spec.rank} {version} {state} {took:.4f} {msg}")

        for entry in self.trainers:
            threading.Thread(target=one, args=entry, daemon=True).start()

    def close(self) -> None:
        for _, client, _, _ in self.trainers:
            client.close()
        for client in self.inference:
            client.close()


def status(args: argparse.Namespace) -> str:
    import grpc

    from refitd._proto import refitd_pb2 as pb
    from refitd._proto import refitd_pb2_grpc as pbg

    with grpc.insecure_channel(args.address) as ch:
        try:
            resp = pbg.RefitStub(ch).GetStatus(pb.StatusRequest(), timeout=args.rpc_timeout)
        except grpc.RpcError as e:
            return json.dumps({"error": f"{e.code().name}: {e.details()}"})
    return json.dumps(json.loads(resp.json))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("address")
    p.add_argument("model")
    p.add_argument("--mb", type=float, default=0.25)
    p.add_argument("--rank", action="append", default=[], type=RankSpec.parse)
    p.add_argument("--rpc-timeout", type=float, default=5.0)
    p.add_argument(
        "--no-pause-check",
        action="store_true",
        help="do not check the served version before acking PAUSE (benchmarks: it delays "
        "the ack by a read of the whole shard)",
    )
    args = p.parse_args()
    ranks = None
    if args.rank:
        import torch

        torch.set_num_threads(1)
        ranks = Ranks(args)
        ranks.start(args.rank)
    say("ready")
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "stop":
            break
        if words[0] == "status":
            say("status " + status(args))
        elif words[0] == "step" and ranks is not None:
            timeout = float(words[2]) if len(words) > 2 else 30.0
            ranks.step(int(words[1]), timeout)
    if ranks is not None:
        ranks.close()


if __name__ == "__main__":
    main()
