"""Empty DTensor shards: 4 Gloo trainer processes on a 1-D mesh hold tensors shorter than
the mesh (real distribute_tensor and real FSDP2 fully_shard; rank 3 holds nothing at all)
and refit an unsharded pool and two pools split another way, whose trailing ranks hold
empty shards too (two of them only empty ones), bit for bit."""

from __future__ import annotations

import queue
import threading

import pytest
import torch
import torch.multiprocessing as mp
from _dtensor_workers import EMPTY, empty_shard_trainer_rank, empty_shard_weights

from refitd.client import InferenceClient, Placed, VersionEvent
from refitd.demo.run import Daemon, free_port
from refitd.plan.layouts import Shard, dtensor_layout

# Destination pools: name -> (ranks, split dim or None, slot of each rank). "split" cuts the
# last dim (its rank 2 holds empty shards of "e" and "router"); "wide" cuts dim 0 into 5
# (ranks 3 and 4 hold only empty shards, on cpu:3 beside trainer rank 3, which holds only
# empty ones too: that slot has nothing to send or receive).
POOLS: dict[str, tuple[int, int | None, list[int]]] = {
    "full": (1, None, [0]),
    "split": (3, -1, [0, 1, 2]),
    "wide": (5, 0, [0, 1, 2, 3, 3]),
}


def torch_chunk(t: torch.Tensor, parts: int, dim: int, index: int) -> torch.Tensor:
    """Part `index` of torch.chunk (DTensor's Shard semantics): empty past the last chunk."""
    chunks = torch.chunk(t, parts, dim)
    return chunks[index] if index < len(chunks) else t.narrow(dim, t.shape[dim], 0)


class Landed:
    """HELLO and COMMIT events of one inference client, waited on as conditions."""

    def __init__(self, client: InferenceClient) -> None:
        self._cond = threading.Condition()
        self.hello = False
        self.commits: list[int] = []
        client.on_update(self._on)

    def _on(self, event: VersionEvent) -> None:
        with self._cond:
            if event.kind == "hello":
                self.hello = True
            elif event.kind == "commit":
                self.commits.append(event.version)
            self._cond.notify_all()

    def wait(self, what: str, pred: object, timeout_s: float = 60.0) -> None:
        with self._cond:
            if not self._cond.wait_for(pred, timeout_s):  # type: ignore[arg-type]
                pytest.fail(f"no {what} within {timeout_s} s")


def _placed(shape: tuple[int, ...], dtype: torch.dtype, pool: str, rank: int) -> Placed:
    """A destination shard of `pool`: torch.chunk of its split dim, as boxes."""
    size, dim, _ = POOLS[pool]
    if dim is None:
        return Placed(torch.zeros(shape, dtype=dtype))
    layout = dtensor_layout(shape, (size,), (rank,), [Shard(dim % len(shape))])
    return Placed(torch.zeros(layout.local_shape, dtype=dtype), shape, layout.boxes)


def _expected(t: torch.Tensor, pool: str, rank: int) -> torch.Tensor:
    size, dim, _ = POOLS[pool]
    return t if dim is None else torch_chunk(t, size, dim % t.dim(), rank)


@pytest.mark.slow
def test_empty_shards_register_and_refit_bit_for_bit(daemon: Daemon) -> None:
    weights = empty_shard_weights()
    dst = {
        (pool, r): {n: _placed(s, d, pool, r) for n, (s, d) in EMPTY.items()}
        for pool, (size, _, _) in POOLS.items()
        for r in range(size)
    }
    assert all(p.tensor.numel() == 0 for k in (3, 4) for p in dst[("wide", k)].values())
    assert dst[("split", 2)]["e"].tensor.numel() == 0
    infer = {
        (pool, r): InferenceClient(
            daemon.address, "empty", pool, rank=r, pool_size=size, device=f"cpu:{slots[r]}"
        )
        for pool, (size, _, slots) in POOLS.items()
        for r in range(size)
    }
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=empty_shard_trainer_rank, args=(r, port, daemon.address, results), daemon=True
        )
        for r in range(4)
    ]
    try:
        landed = []
        for key, c in infer.items():
            c.register(dst[key])
            landed.append(Landed(c))
            landed[-1].wait("HELLO", lambda w=landed[-1]: w.hello)
        for p in procs:
            p.start()
        got: dict[tuple[int, str], object] = {}
        while len(got) < 8:
            try:
                rank, kind, value = results.get(timeout=120)
            except queue.Empty:
                pytest.fail(f"trainer ranks did not report; got {got}")
            assert kind != "error", value
            got[(rank, kind)] = value
        # torch's own uneven chunking gave the trailing ranks empty shards
        assert got[(3, "shapes")] == {
            "e": (0, 4),
            "router": (0,),
            "fsdp.weight": (0, 12),
            "fsdp.bias": (0,),
        }
        assert got[(2, "shapes")]["router"] == (0,)
        assert all(got[(r, "v1")] == "committed" for r in range(4)), got
        for w in landed:
            w.wait("COMMIT of version 1", lambda w=w: 1 in w.commits)
        bad = [
            f"{n} of {pool} rank {r}"
            for (pool, r), tensors in dst.items()
            for n, t in weights.items()
            if not torch.equal(tensors[n].tensor, _expected(t, pool, r))
        ]
        assert bad == []
    finally:
        for p in procs:
            if p.pid is None:
                continue  # not started
            p.join(30)
            if p.is_alive():
                p.kill()
        for c in infer.values():
            c.close()
