"""Megatron -> HF name maps: planner-level checks, and the proof through the daemon: a
tp=2 x pp=2 Megatron trainer (4 processes) refits tiny HF Llama and DeepSeek-V3 models
(tp=1) whose logits then equal those of the reference model the weights came from."""

from __future__ import annotations

import queue

import pytest
import torch

pytest.importorskip("transformers")

import torch.multiprocessing as mp
from _adapter_models import subscribed
from _hf_models import DSV3, LLAMA, QWEN3, QWEN3_MOE, config, megatron_weights, model, trainer_rank

from clients.hf_names import apply_name_map, hf_checkpoint_tensors, name_map_for
from refitd.client import InferenceClient
from refitd.demo.run import Daemon
from refitd.plan.errors import PlanError

BATCH = torch.tensor([[3, 17, 99, 4, 250, 8, 61, 7], [1, 2, 3, 4, 5, 6, 7, 8]])


@pytest.mark.parametrize("kind", [LLAMA, DSV3, QWEN3, QWEN3_MOE])
def test_map_covers_every_hf_tensor_and_every_megatron_tensor(kind: str) -> None:
    ref = model(kind, 0)
    name_map = name_map_for(ref.config)
    hf = hf_checkpoint_tensors(ref)
    placed = apply_name_map(hf, name_map)
    sources = {p.canonical for p in placed.values()}
    assert sources == set(megatron_weights(kind, ref))
    assert {r.dst for r in name_map.rules} == set(hf)


@pytest.mark.parametrize("kind", [LLAMA, DSV3, QWEN3, QWEN3_MOE])
def test_boxes_read_the_right_megatron_rows(kind: str) -> None:
    """Filling every HF tensor from its boxes in the Megatron globals rebuilds the model."""
    ref = model(kind, 0)
    mg = megatron_weights(kind, ref)
    hf = {n: torch.zeros_like(t) for n, t in hf_checkpoint_tensors(ref).items()}
    for p in apply_name_map(hf, name_map_for(ref.config)).values():
        for b in p.boxes:
            src = mg[p.canonical][
                tuple(slice(o, o + n) for o, n in zip(b.offset, b.shape, strict=True))
            ]
            p.tensor[
                tuple(slice(o, o + n) for o, n in zip(b.local_offset, b.shape, strict=True))
            ] = src
    want = hf_checkpoint_tensors(ref)
    assert [n for n in want if not torch.equal(hf[n], want[n])] == []


def test_wrong_dims_are_reported_with_the_tensor_name() -> None:
    ref = model(LLAMA, 0)
    hf = hf_checkpoint_tensors(ref)
    hf["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 64)
    with pytest.raises(PlanError, match=r"k_proj\.weight.*cover 32"):
        apply_name_map(hf, name_map_for(ref.config))


@pytest.mark.slow
def test_megatron_trainer_refits_hf_models_to_identical_logits(daemon: Daemon) -> None:
    from clients.hf_names import register_hf

    seed = 5
    refs = {k: model(k, seed) for k in (LLAMA, DSV3)}
    served = {k: model(k, seed + 1) for k in (LLAMA, DSV3)}  # other weights until the refit
    with torch.no_grad():
        for k in refs:
            assert not torch.equal(served[k](BATCH).logits, refs[k](BATCH).logits)
    clients = {}
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    barrier = ctx.Barrier(4)
    procs = [
        ctx.Process(
            target=trainer_rank, args=(r, daemon.address, seed, results, barrier), daemon=True
        )
        for r in range(4)
    ]
    try:
        for k, m in served.items():
            c = InferenceClient(daemon.address, k, "infer", rank=0, pool_size=1, device="cpu:0")
            register_hf(c, m, name_map_for(config(k)))
            subscribed(c)
            clients[k] = c
        for p in procs:
            p.start()
        got = []
        for _ in range(8):
            try:
                got.append(results.get(timeout=180))
            except queue.Empty:
                pytest.fail(f"trainer ranks did not report; got {got}")
            assert got[-1][1] != "error", got[-1][2]
        assert sorted(got) == sorted((r, k, "committed") for r in range(4) for k in refs)
        for k in refs:
            want = refs[k].state_dict()
            bad = [n for n, t in served[k].state_dict().items() if not torch.equal(t, want[n])]
            assert bad == [], k
            with torch.no_grad():
                torch.testing.assert_close(served[k](BATCH).logits, refs[k](BATCH).logits)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        for c in clients.values():
            c.close()
