"""DTensor adapter: 4 Gloo processes on a 2 x 2 CPU mesh (Shard, Replicate, uneven and
empty shards, two mesh dims on one tensor dim, an FSDP2 fully_shard Linear) refit into an
inference pool of 2 ranks with another layout (split along the last dim), bit for bit."""

from __future__ import annotations

import queue

import pytest
import torch
import torch.multiprocessing as mp
from _adapter_models import subscribed
from _dtensor_workers import FSDP, PARAMS, global_weights, trainer_rank

from clients.dtensor_adapter import canonical_dtensor_name, dtensor_tensors
from refitd.client import InferenceClient, Placed
from refitd.demo.run import Daemon, free_port
from refitd.plan.layouts import Shard, dtensor_layout


def test_wrapper_prefixes_leave_canonical_names() -> None:
    assert canonical_dtensor_name("_orig_mod.layers.0._checkpoint_wrapped_module.w") == (
        "layers.0.w"
    )


def test_plain_tensors_are_replicas() -> None:
    lin = torch.nn.Linear(3, 2)
    placed = dtensor_tensors(lin)
    assert set(placed) == {"weight", "bias"}
    assert placed["weight"].boxes is None and placed["weight"].canonical == "weight"


def _last_dim_split(t: torch.Tensor, rank: int) -> Placed:
    """Inference layout: the last dim split over 2 ranks (torch.chunk), as boxes."""
    layout = dtensor_layout(tuple(t.shape), (2,), (rank,), [Shard(t.dim() - 1)])
    local = torch.zeros(layout.local_shape, dtype=t.dtype)
    return Placed(local, tuple(t.shape), layout.boxes)


def _expected(t: torch.Tensor, rank: int) -> torch.Tensor:
    return torch.chunk(t, 2, dim=t.dim() - 1)[rank]


@pytest.mark.slow
def test_dtensor_trainer_refits_another_layout_bit_for_bit(daemon: Daemon) -> None:
    weights = global_weights(1)
    names = [*PARAMS, FSDP]
    dst = [{n: _last_dim_split(weights[n], r) for n in names} for r in range(2)]
    infer = [
        InferenceClient(daemon.address, "dtensor", "infer", rank=r, pool_size=2, device=f"cpu:{r}")
        for r in range(2)
    ]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=trainer_rank, args=(r, port, daemon.address, results), daemon=True)
        for r in range(4)
    ]
    try:
        for r in range(2):
            infer[r].register(dst[r])
            subscribed(infer[r])
        for p in procs:
            p.start()
        for version, step in ((1, "v1"), (2, "v2")):
            got = []
            for _ in range(4):
                try:
                    got.append(results.get(timeout=120))
                except queue.Empty:
                    pytest.fail(f"trainer ranks did not report {step}; got {got}")
            errors = [g for g in got if g[1] == "error"]
            assert not errors, errors[0][2]
            assert sorted(got) == [(r, step, "committed") for r in range(4)]
            expect = {n: w if version == 1 else w * 2 + 1 for n, w in weights.items()}
            bad = [
                (n, r)
                for r in range(2)
                for n in names
                if not torch.equal(dst[r][n].tensor, _expected(expect[n], r))
            ]
            assert bad == [], step
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        for c in infer:
            c.close()
