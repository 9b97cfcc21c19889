"""The demo's worker processes: trainer ranks and inference ranks linking refitd.client.

Trainer ranks hold Megatron-style shards (parameters carrying tensor_model_parallel /
partition_dim / partition_stride, local layer names plus a PP layer offset) and, per step,
refill them with the weights of the next version, then refit. Inference ranks register
either explicit boxes or whole replicas and check every landed version bit for bit against
the same reproducible weights. Each process reports to the parent through a queue.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from refitd.client import InferenceClient, MegatronCoords, Placed, RefitError, TrainerClient
from refitd.demo.gpt import (
    GptConfig,
    ParallelLayout,
    WeightGenerator,
    megatron_parameter,
    rank_shards,
)

REGISTER_RETRY_S = 60.0


@dataclass(frozen=True)
class WorkerSpec:
    """Everything one worker process needs, picklable for a spawned process."""

    controller: str
    model: str
    pool: str
    rank: int
    layout: ParallelLayout
    device: str
    config: GptConfig
    seed: int
    placement: str = "megatron"  # "megatron" (attributes), "boxes" (Placed) or "replica"
    timeout_s: float = 120.0


def _tensors(spec: WorkerSpec) -> tuple[dict[str, Any], MegatronCoords, list]:
    """Allocate the rank's tensors and describe their placement the way `spec` asks."""
    shards = rank_shards(spec.config, spec.layout, spec.rank)
    tp_rank, _, _ = spec.layout.coords(spec.rank)
    offset = shards[0].layer_offset if shards else 0
    coords = MegatronCoords(tp_rank=tp_rank, tp_size=spec.layout.tp, layer_offset=offset)
    tensors: dict[str, Any] = {}
    for s in shards:
        if spec.placement == "megatron":
            tensors[s.name] = megatron_parameter(s)
            continue
        t = torch.zeros(s.local_shape, dtype=torch.bfloat16)
        if spec.placement == "boxes":
            tensors[s.name] = Placed(t, s.global_shape, s.boxes, canonical=s.canonical)
        else:
            tensors[s.name] = t
    return tensors, coords, shards


def _local(value: Any) -> torch.Tensor:
    return value.tensor if isinstance(value, Placed) else value


def _register(client: Any, tensors: dict[str, Any], coords: MegatronCoords) -> None:
    """Register, waiting out a controller whose agent has not yet registered its slots."""
    deadline = time.monotonic() + REGISTER_RETRY_S
    while True:
        try:
            client.register(tensors, coords)
            return
        except RefitError as err:
            waiting = err.code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE)
            if not waiting or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def trainer_main(spec: WorkerSpec, commands: mp.Queue, out: mp.Queue) -> None:
    """A trainer rank: on ("step", v) refill its shards with version v and refit."""
    try:
        torch.set_num_threads(1)
        gen = WeightGenerator(spec.seed)
        tensors, coords, shards = _tensors(spec)
        client = TrainerClient(
            spec.controller, spec.model, spec.pool, spec.rank, spec.layout.world, spec.device
        )
        _register(client, tensors, coords)
        out.put(("registered", spec.pool, spec.rank, client.registration.slot))
        while True:
            cmd = commands.get(timeout=3600)
            if cmd[0] == "stop":
                break
            _, version, wait = cmd
            start = time.perf_counter()
            with torch.no_grad():
                for s in shards:
                    gen.fill(_local(tensors[s.name]), s, version)
            stepped = time.perf_counter()
            result = client.refit(version, wait=wait, timeout=spec.timeout_s)
            out.put(
                (
                    "refit",
                    spec.pool,
                    spec.rank,
                    version,
                    result.state,
                    result.seconds,
                    result.bytes,
                    stepped - start,
                    time.perf_counter() - stepped,
                )
            )
        client.close()
    except Exception:
        out.put(("error", spec.pool, spec.rank, traceback.format_exc()))


def inference_main(spec: WorkerSpec, stop: Any, out: mp.Queue) -> None:
    """An inference rank: follow version events, check every committed version bit for bit."""
    try:
        torch.set_num_threads(1)
        gen = WeightGenerator(spec.seed)
        tensors, coords, shards = _tensors(spec)
        serving = threading.Event()

        client = InferenceClient(
            spec.controller,
            spec.model,
            spec.pool,
            spec.rank,
            spec.layout.world,
            spec.device,
            pause=lambda version: serving.clear(),
            resume=lambda version: serving.set(),
        )
        _register(client, tensors, coords)
        out.put(("registered", spec.pool, spec.rank, client.registration.slot))

        def on_event(event: Any) -> None:
            if event.kind == "commit":
                start = time.perf_counter()
                bad = [
                    m
                    for s in shards
                    if (m := gen.mismatch(_local(tensors[s.name]), s, event.version))
                ]
                out.put(
                    (
                        "verified",
                        spec.pool,
                        spec.rank,
                        event.version,
                        not bad,
                        "; ".join(bad[:3]),
                        time.perf_counter() - start,
                    )
                )
            elif event.kind in ("abort", "incomplete"):
                out.put(("event", spec.pool, spec.rank, event.kind, event.version, event.reason))

        client.on_update(on_event)
        while not stop.wait(0.5):
            pass
        client.close()
    except Exception:
        out.put(("error", spec.pool, spec.rank, traceback.format_exc()))
