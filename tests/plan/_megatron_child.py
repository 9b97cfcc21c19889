"""Child process of test_bench_megatron.py: Megatron-Core is imported here, never in the
test process (its import loads triton, sympy and setuptools and sets environment
variables). Checks Megatron's plans over the metadata `refitd bench plan` fills against
Megatron's split rule, prints `checked N`, then runs `refitd bench plan` with argv[1:]."""

from __future__ import annotations

import sys

import torch

from refitd.bench.plan_megatron import load, plan_all, side_metadata
from refitd.bench.presets import BF16, FP32, Parallel, Preset, TensorDef, rank_tensors

MODULES, WHY = load()


def _tiny_moe() -> Preset:
    """A 3-layer MoE model in kimi-k2's shape of things at toy sizes: a dense first layer,
    8 experts, GLU weights split with stride 2, an FP32 router bias."""
    h, ffn, eff, experts = 8, 16, 4, 8
    attn = (
        TensorDef("input_layernorm.weight", (h,)),
        TensorDef("self_attention.linear_qkv.weight", (24, h), shard=("tp", 0, 1)),
        TensorDef("self_attention.linear_proj.weight", (h, 16), shard=("tp", 1, 1)),
    )
    dense = (*attn, TensorDef("mlp.linear_fc1.weight", (2 * ffn, h), shard=("tp", 0, 2)))
    moe = (*attn, TensorDef("mlp.router.expert_bias", (experts,), FP32))
    expert = (
        TensorDef("mlp.experts.linear_fc1.weight", (2 * eff, h), shard=("etp", 0, 2)),
        TensorDef("mlp.experts.linear_fc2.weight", (h, eff), shard=("etp", 1, 1)),
    )
    head = (TensorDef("embedding.word_embeddings.weight", (32, h), BF16, ("tp", 0, 1)),)
    tail = (TensorDef("output_layer.weight", (32, h), shard=("tp", 0, 1)),)
    return Preset("tiny-moe", 3, experts, head, tail, dense, moe, expert, 1, 0)


def _megatron_shard(full, shard: tuple[str, int, int], rank: int, size: int):
    """Rank `rank`'s piece of `full` by Megatron's split rule: the partition dim cut into
    size * stride equal chunks, rank r holding chunks r, r + size, ... concatenated."""
    kind, dim, stride = shard
    if kind == "rep":
        return full
    chunks = torch.chunk(full, size * stride, dim)
    return torch.cat(chunks[rank::size], dim)


def _shards(preset: Preset, par: Parallel, base: int) -> dict:
    """(global rank, local name) -> the expected shard of every tensor of one side: the
    global tensor (values that name it) split by Megatron's rule."""
    out = {}
    for rank in range(par.world):
        for t, name, canonical, r, size in rank_tensors(preset, par, rank):
            numel = 1
            for s in t.shape:
                numel *= s
            seed = sum(map(ord, canonical)) * 1_000_003 + len(canonical) * 7_919
            full = (torch.arange(numel, dtype=torch.float64) + seed).reshape(t.shape)
            out[(base + rank, name)] = _megatron_shard(full, t.shard, r, size)
    return out


def check_plans(collocated: bool) -> int:
    """Megatron's plans over the metadata the bench fills, executed by slicing: every
    destination shard equals Megatron's split of the global tensor; the shards checked."""
    preset = _tiny_moe()
    src_par = Parallel.parse("tp=2,pp=3,ep=4", 24)
    dst_par = Parallel.parse("tp=4,ep=2", 8)
    dst_base = 0 if collocated else 24
    src = side_metadata(MODULES[1], preset, src_par, 0)
    dst = side_metadata(MODULES[1], preset, dst_par, dst_base)
    plans = plan_all(MODULES, src, dst)
    held = _shards(preset, src_par, 0)
    want = _shards(preset, dst_par, dst_base)
    sends = {op.task_id: op for plan in plans.values() for op in plan.send_ops}
    got = {}
    for rank, metas in dst.items():
        for m in metas:
            got[(rank, m.name)] = torch.full(m.shape, float("nan"), dtype=torch.float64)
        for op in plans[rank].recv_ops:
            send = sends[op.task_id]
            assert send.peer_rank == rank and send.my_slice == op.peer_slice
            piece = held[(op.peer_rank, send.param_name)][op.peer_slice]
            got[(rank, op.param_name)][op.my_slice] = piece
    assert got.keys() == want.keys() and len(got) > 100
    for key, shard in want.items():
        assert torch.equal(got[key], shard), key
    return len(want)


if __name__ == "__main__":
    assert MODULES is not None, WHY
    print(f"checked {check_plans(False) + check_plans(True)}", flush=True)
    from refitd.cli.main import main

    sys.exit(main(sys.argv[1:]))
