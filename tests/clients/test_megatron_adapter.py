"""Megatron adapter: attributes, layer numbers and experts read off real modules; a refit
from a tp=2 x pp=2 (ep=2) trainer through the daemon lands bit for bit."""

from __future__ import annotations

import threading

import pytest
import torch
from _adapter_models import TinyGpt, subscribed

from clients.megatron_adapter import ParallelState, megatron_tensors, register_megatron
from clients.megatron_adapter.toy import build_rank_module
from refitd.client import InferenceClient, Placed, TrainerClient
from refitd.demo.run import Daemon
from refitd.plan.errors import PlanError

CFG = TinyGpt()


def _state(rank: int) -> ParallelState:
    tp, pp = rank % 2, rank // 2
    return ParallelState(tp_rank=tp, tp_size=2, pp_rank=pp, pp_size=2, ep_rank=tp, ep_size=2)


def _module(weights: dict[str, torch.Tensor], rank: int) -> torch.nn.Module:
    return build_rank_module(weights, CFG.layers, _state(rank), num_experts=CFG.experts)


def test_canonical_names_globalize_layers_and_experts() -> None:
    weights = CFG.weights(0)
    placed = megatron_tensors(_module(weights, 3), _state(3))  # tp 1, pp 1, ep 1
    canon = {n: p.canonical for n, p in placed.items()}
    assert canon["decoder.layers.0.self_attention.linear_qkv.weight"] == (
        "decoder.layers.2.self_attention.linear_qkv.weight"
    )
    assert canon["decoder.layers.1.mlp.experts.linear_fc1.weight0"] == (
        "decoder.layers.3.mlp.experts.linear_fc1.weight2"
    )
    assert canon["decoder.layers.1.mlp.router.expert_bias"] == (
        "decoder.layers.3.mlp.router.expert_bias"
    )
    assert "embedding.word_embeddings.weight" not in canon  # first stage only
    fc1 = placed["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert fc1.global_shape == weights["decoder.layers.2.self_attention.linear_qkv.weight"].shape


def test_sequential_experts_get_the_grouped_canonical_name() -> None:
    mod = torch.nn.Module()
    layer = torch.nn.Module()
    layer.layer_number = 6
    experts = torch.nn.ModuleList()
    for _ in range(2):
        expert = torch.nn.Module()
        expert.linear_fc1 = torch.nn.Linear(4, 8, bias=False)
        expert.linear_fc1.weight.allreduce = False
        experts.append(expert)
    layer.add_module("mlp", torch.nn.Module())
    layer.mlp.add_module("experts", torch.nn.Module())
    layer.mlp.experts.add_module("local_experts", experts)
    mod.add_module("decoder", torch.nn.Module())
    mod.decoder.add_module("layers", torch.nn.ModuleList([layer]))
    state = ParallelState(pp_rank=1, pp_size=2, ep_rank=3, ep_size=4)
    names = {p.canonical for p in megatron_tensors(mod, state).values()}
    assert names == {
        "decoder.layers.5.mlp.experts.linear_fc1.weight6",
        "decoder.layers.5.mlp.experts.linear_fc1.weight7",
    }


def test_missing_or_duplicate_layer_number_is_an_error() -> None:
    mod = _module(CFG.weights(0), 2)
    del mod.get_submodule("decoder.layers.1").layer_number
    with pytest.raises(PlanError, match=r"decoder\.layers\.1.*layer_number"):
        megatron_tensors(mod, _state(2))
    mod.get_submodule("decoder.layers.1").layer_number = mod.get_submodule(
        "decoder.layers.0"
    ).layer_number
    with pytest.raises(PlanError, match="both claim layer_number"):
        megatron_tensors(mod, _state(2))


def test_bad_partition_dim_names_the_tensor() -> None:
    mod = _module(CFG.weights(0), 0)
    mod.get_submodule("decoder.layers.0").self_attention.linear_proj.weight.partition_dim = 5
    with pytest.raises(PlanError, match=r"linear_proj\.weight.*partition_dim 5"):
        megatron_tensors(mod, _state(0))


def _refit_all(trainers: list[TrainerClient], version: int) -> list[str]:
    states: list[str] = []
    errors: list[BaseException] = []

    def ask(t: TrainerClient) -> None:
        try:
            states.append(t.refit(version, wait="committed", timeout=60).state)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(t,)) for t in trainers]
    for th in threads:
        th.start()
    for th in threads:
        th.join(90)
    if errors:
        raise errors[0]
    return states


@pytest.mark.slow
def test_megatron_trainer_refits_an_inference_pool_bit_for_bit(daemon: Daemon) -> None:
    weights = CFG.weights(1)
    modules = [_module(weights, r) for r in range(4)]
    trainers = [
        TrainerClient(daemon.address, "megatron", rank=r, pool_size=4, device=f"cpu:{r}")
        for r in range(4)
    ]
    # Inference: one rank on its own slot holding whole tensors under their canonical names.
    dst = {n: torch.zeros_like(w) for n, w in weights.items()}
    infer = InferenceClient(
        daemon.address, "megatron", "infer", rank=0, pool_size=1, device="cpu:1"
    )
    try:
        for r in range(4):
            register_megatron(trainers[r], modules[r], _state(r))
        infer.register({n: Placed(t) for n, t in dst.items()})
        subscribed(infer)
        assert _refit_all(trainers, 1) == ["committed"] * 4
        bad = [n for n, w in weights.items() if not torch.equal(dst[n], w)]
        assert bad == []

        # An in-place optimizer step on the registered parameters lands as version 2.
        with torch.no_grad():
            for m in modules:
                for t in [*m.parameters(), *m.buffers()]:
                    t.mul_(2).add_(1)
        assert _refit_all(trainers, 2) == ["committed"] * 4
        bad = [n for n, w in weights.items() if not torch.equal(dst[n], w * 2 + 1)]
        assert bad == []
    finally:
        infer.close()
        for t in trainers:
            t.close()


def _into_one_flat_buffer(module: torch.nn.Module) -> torch.Tensor:
    """Megatron's distributed-optimizer layout: every parameter becomes a view of one flat
    buffer (the first matrix a transposed, non-contiguous one); returns the buffer."""
    params = list(module.parameters())
    flat = torch.empty(sum(p.numel() for p in params), dtype=torch.bfloat16)
    offset, transposed = 0, False
    for p in params:
        view = flat[offset : offset + p.numel()]
        offset += p.numel()
        if p.dim() == 2 and not transposed:
            view, transposed = view.view(p.shape[1], p.shape[0]).t(), True
        else:
            view = view.view(p.shape)
        view.copy_(p.data)
        p.data = view
    return flat


@pytest.mark.slow
def test_parameters_that_view_one_flat_buffer_refit_what_the_buffer_holds(
    daemon: Daemon,
) -> None:
    """The distributed optimizer all-gathers each step's parameters into its flat buffer,
    not into the parameter objects: registration must move the buffer with its views."""
    weights = CFG.weights(5)
    state = ParallelState()
    module = build_rank_module(weights, CFG.layers, state, num_experts=CFG.experts)
    flat = _into_one_flat_buffer(module)
    trainer = TrainerClient(daemon.address, "megatron-flat", rank=0, pool_size=1, device="cpu:0")
    dst = {n: torch.zeros_like(w) for n, w in weights.items()}
    infer = InferenceClient(
        daemon.address, "megatron-flat", "infer", rank=0, pool_size=1, device="cpu:1"
    )
    try:
        register_megatron(trainer, module, state)
        infer.register({n: Placed(t) for n, t in dst.items()})
        subscribed(infer)
        flat.mul_(2).add_(1)  # the optimizer's all-gather writes the buffer
        assert trainer.refit(1, wait="committed", timeout=60).state == "committed"
        expect = {n: w if n.endswith("expert_bias") else w * 2 + 1 for n, w in weights.items()}
        assert [n for n, w in expect.items() if not torch.equal(dst[n], w)] == []
    finally:
        infer.close()
        trainer.close()
