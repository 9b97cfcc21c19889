"""The MTP draft layouts against the engines' own draft model code: every vLLM draft
tensor's name is what vLLM 0.33's `DeepSeekMTP` loader makes of the HF names of its pieces
(its spec-layer rewrite, then its stacked-parameter fusions or its FusedMoE expert-params
mapping), and the vocabulary tensors have the shapes vLLM's own VocabParallelEmbedding /
SharedHead allocate on each TP rank; SGLang 0.5.23's own DeepSeek NextN weight loader, fed
the HF tensors of the MTP layer, loads each into the SGLang draft tensor, shard and expert
the layout says. Every layout, read from an HF- or a Megatron-named trainer, then holds
what the loaders make of the trainer's tensors, bit for bit."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from _draft_models import (
    as_megatron_serves,
    dims,
    draft_names,
    engine,
    layouts,
    megatron_trainer,
    mismatches,
    trainer_tensors,
)
from _engine_models import fill_from, loaded_buffers
from _hf_models import DSV3, config
from _lora_models import _tp

from clients.engine_layouts import EngineParallel
from clients.engine_layouts.draft import deepseek_mtp_engine_layout
from refitd.plan.errors import PlanError

# vLLM's DeepSeekMTP.load_weights fuses these checkpoint names into one parameter each
STACKED = (
    ("gate_up_proj", "gate_proj"),
    ("gate_up_proj", "up_proj"),
    ("fused_qkv_a_proj", "q_a_proj"),
    ("fused_qkv_a_proj", "kv_a_proj_with_mqa"),
)


def vllm_name(hf: str, layer: int, experts: int) -> str:
    """The draft parameter vLLM's loader puts the HF checkpoint tensor `hf` in: its
    stacked-parameter fusions, else its FusedMoE expert-params mapping."""
    from vllm.model_executor.layers.fused_moe.layer import fused_moe_make_expert_params_mapping
    from vllm.model_executor.models.deepseek_mtp import DeepSeekMTP

    name = DeepSeekMTP._rewrite_spec_layer_name(None, layer, hf)  # uses no instance state
    for param, weight in STACKED:
        if weight in name and ".mlp.experts." not in name:
            return name.replace(weight, param)
    mapping = fused_moe_make_expert_params_mapping(
        torch.nn.Module(), "gate_proj", "down_proj", "up_proj", experts
    )
    for param, weight, _, _ in mapping:
        if weight in name:
            return name.replace(weight, param)
    return name


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_draft_names_are_what_vllm_loads_them_as(tp: int) -> None:
    d = dims()
    for lay in layouts(tp, draft=True, d=d):
        assert lay.source_naming == "hf"
    checkpoint = deepseek_mtp_engine_layout(d, EngineParallel(tp, 0), source_naming="hf-checkpoint")
    seen = 0
    for t in checkpoint.tensors:
        for p in t.pieces:
            hf = p.canonical
            if hf == "model.embed_tokens.weight":  # the model's embedding, shared
                hf = f"model.layers.{d.layers}.embed_tokens.weight"
            assert t.name == vllm_name(hf, d.layers, d.experts), hf
            seen += 1
    assert seen >= 20 + 3 * d.experts  # and gate, up, down of every routed expert


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocabulary_shapes_are_vllms(tp: int) -> None:
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.models.deepseek_mtp import SharedHead

    cfg, d = config(DSV3), dims()
    k = d.layers
    for r, lay in enumerate(layouts(tp, draft=True, d=d)):
        with _tp(tp, r), set_current_vllm_config(VllmConfig(device_config=DeviceConfig("cpu"))):
            head = SharedHead(cfg, prefix=f"model.layers.{k}")
            embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        shapes = {t.name: t.local_shape for t in lay.tensors}
        assert shapes["model.embed_tokens.weight"] == tuple(embed.weight.shape)
        assert shapes[f"model.layers.{k}.shared_head.head.weight"] == tuple(head.head.weight.shape)
        assert shapes[f"model.layers.{k}.shared_head.norm.weight"] == tuple(head.norm.weight.shape)


def sglang_loads(sources: dict[str, torch.Tensor], params: list[str]) -> list[tuple]:
    """(parameter, shard, expert, HF source or the loaded tensor) for every load SGLang's
    DeepSeek weight loader makes, as its NextN draft (is_nextn), of `sources` into a model
    holding `params`."""
    from _torchvision_stand_in import torchvision_stand_in

    with torchvision_stand_in():
        from sglang.srt.models.deepseek_common.deepseek_weight_loader import (
            DeepseekV2WeightLoaderMixin,
        )
    by_ptr = {t.data_ptr(): n for n, t in sources.items()}
    calls: list[tuple] = []

    def loader(name: str) -> Callable[..., None]:
        def load(param: object, w: torch.Tensor, *args: object, **kw: object) -> None:
            shard = kw.get("shard_id", args[-1] if args else None)
            calls.append((name, shard, kw.get("expert_id"), by_ptr.get(w.data_ptr(), w)))

        return load

    held = {}
    for n in params:
        held[n] = torch.nn.Parameter(torch.empty(0), requires_grad=False)
        held[n].weight_loader = loader(n)

    class Draft(DeepseekV2WeightLoaderMixin, torch.nn.Module):
        """SGLang's loader over the draft's parameters; no post-load step (it derives MLA's
        absorbed weights from attention modules this holder has not)."""

        def named_parameters(self, *_: object, **__: object) -> Iterator:
            return iter(held.items())

        def post_load_weights(self, *_: object, **__: object) -> None:
            pass

    m = Draft()
    m.config, m.quant_config, m.num_fused_shared_experts = config(DSV3), None, 0
    m.pp_group, m.model = SimpleNamespace(is_last_rank=True), torch.nn.Module()
    m.do_load_weights(iter(sources.items()), is_nextn=True)
    return calls


SHARD_ORDER = {None: 0, 0: 0, 1: 1, "w1": 0, "w3": 1, "w2": 0}


def test_sglang_draft_is_what_sglang_loads() -> None:
    d = dims()
    lay = deepseek_mtp_engine_layout(
        d, EngineParallel(2, 1), "sglang", source_naming="hf-checkpoint"
    )
    g = torch.Generator().manual_seed(0)
    sources = {
        p.canonical: torch.randn(p.global_shape, generator=g) for t in lay.tensors for p in t.pieces
    }
    k = d.layers  # and what the draft must not load: the policy's, the layer's embedding, head
    for skip in (f"model.layers.{k}.shared_head.head.weight", f"model.layers.{k}.embed_tokens.weight",
                 "model.layers.0.input_layernorm.weight"):  # fmt: skip
        sources[skip] = torch.randn(2, 2, generator=g)
    calls = sglang_loads(sources, sorted({t.name for t in lay.tensors}))
    got: dict[tuple, list] = {}
    for name, _shard, expert, src in sorted(calls, key=lambda c: SHARD_ORDER[c[1]]):
        got.setdefault((name, expert), []).append(src)
    want = {(t.name, t.index): [p.canonical for p in t.pieces] for t in lay.tensors}
    assert set(got) == set(want)
    for key, srcs in got.items():
        if len(srcs) == 1 and isinstance(srcs[0], torch.Tensor):  # fused on load: q_a, kv_a
            assert torch.equal(srcs[0], torch.cat([sources[n] for n in want[key]])), key
        else:
            assert srcs == want[key], key
    assert len(calls) == sum(len(t.pieces) for t in lay.tensors) - 1  # the fused a-projection


@pytest.mark.parametrize(
    ("engine_name", "naming"), [("vllm", "megatron"), ("sglang", "hf"), ("sglang", "megatron")]
)
def test_draft_holds_what_the_loaders_make(engine_name: str, naming: str) -> None:
    """Every draft rank (tp=2) filled through its layout from the trainer's tensors holds what
    the engine's loader puts there (tests/clients/_engine_models.loaded_buffers), bit for
    bit; a Megatron trainer's MTP block serves the model's output layer as its head."""
    eng, lays = engine(2, True, engine_name, naming)
    d = dims()
    sources = megatron_trainer(1) if naming == "megatron" else trainer_tensors(1)
    fill_from(sources, eng, lays)
    served = as_megatron_serves(1) if naming == "megatron" else trainer_tensors(1)
    for r in range(eng.tp):
        want = loaded_buffers(eng, r, draft_names(served, d, engine_name))
        assert set(want) == set(eng.ranks[r])
        assert mismatches(eng.ranks[r], want) == [], r


def test_draft_layout_refuses_what_it_cannot_lay_out() -> None:
    d = dims()
    with pytest.raises(ValueError, match="'tensorrt'"):
        deepseek_mtp_engine_layout(d, EngineParallel(1, 0), engine="tensorrt")
    with pytest.raises(PlanError, match="SGLang's MTP draft holds one MTP layer; the model has 2"):
        deepseek_mtp_engine_layout(replace(d, mtp_layers=2), EngineParallel(), "sglang")
    with pytest.raises(PlanError, match="no MTP layers"):
        deepseek_mtp_engine_layout(replace(d, mtp_layers=0), EngineParallel())
