"""A tiny DeepSeek-V3 with one MTP layer, as a trainer holds it (the transformers model
plus the MTP layer as an extra decoder layer under HF names), and what vLLM's loaders put
in a policy rank and a draft rank from it.

The draft's expected tensors are written here from vLLM's draft loader semantics
(DeepSeekMTP._rewrite_spec_layer_name: a tensor of MTP layer k that is not enorm, hnorm,
eh_proj or shared_head belongs to its decoder block, `model.layers.{k}.mtp_block.`; the
embedding is the model's), then filled by the same per-tensor loader rules as the policy
(`loaded_buffers`), independently of clients.engine_layouts. What the layouts give is
only each rank's allocation (names and shapes)."""

from __future__ import annotations

import copy
import functools
import hashlib
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from _engine_models import EngineModel, loaded_buffers
from _hf_models import DSV3, config, megatron_weights, model

from clients.engine_layouts import EngineLayout, EngineParallel, deepseek_v3_engine_layout
from clients.engine_layouts.draft import deepseek_mtp_engine_layout
from clients.hf_names import DeepseekV3Dims

OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")  # an MTP layer's own tensors


def dims() -> DeepseekV3Dims:
    d = DeepseekV3Dims.from_hf_config(config(DSV3))
    assert d.mtp_layers == 1
    return d


def mtp_layer(cfg: Any) -> dict[str, torch.Tensor]:
    """MTP layer k = num_hidden_layers under HF checkpoint names: its norms, eh_proj,
    shared head, and a DeepSeek-V3 decoder block (transformers' own, fused experts)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3DecoderLayer,
        DeepseekV3RMSNorm,
    )

    h, k = cfg.hidden_size, cfg.num_hidden_layers
    mods = {
        "enorm": DeepseekV3RMSNorm(h),
        "hnorm": DeepseekV3RMSNorm(h),
        "eh_proj": torch.nn.Linear(2 * h, h, bias=False),
        "shared_head.norm": DeepseekV3RMSNorm(h),
        "shared_head.head": torch.nn.Linear(h, cfg.vocab_size, bias=False),
        "": DeepseekV3DecoderLayer(cfg, layer_idx=k),
    }
    return {
        f"model.layers.{k}.{name}.{pn}".replace("..", "."): t
        for name, m in mods.items()
        for pn, t in m.state_dict().items()
    }


@functools.cache
def _shapes() -> dict[str, tuple[int, ...]]:
    """Every tensor the trainer holds: the transformers model's and its MTP layer's."""
    held = {**model(DSV3, 0).state_dict(), **mtp_layer(config(DSV3))}
    return {n: tuple(t.shape) for n, t in held.items()}


@functools.cache
def trainer_tensors(seed: int) -> dict[str, torch.Tensor]:
    """Version `seed` of the whole trainer: the policy's tensors and its MTP layer's, drawn
    from a generator seeded with `seed` (cached: copy them before writing or registering)."""
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in _shapes().items()}


def draft_names(
    tensors: dict[str, torch.Tensor], d: DeepseekV3Dims, engine: str = "vllm"
) -> dict[str, torch.Tensor]:
    """The trainer's tensors under the names the engine's draft loads them as. vLLM
    (DeepSeekMTP._rewrite_spec_layer_name): an MTP layer's own tensors keep their names, its
    decoder block goes under `mtp_block.`, the embedding is the model's. SGLang (its NextN
    loader): own tensors under `model.`, the block under `model.decoder.`, and the layer's
    embedding and shared head skipped (the draft serves the policy's)."""
    out = {"model.embed_tokens.weight": tensors["model.embed_tokens.weight"]}
    if engine == "sglang":
        out = {}
    for k in range(d.layers, d.layers + d.mtp_layers):
        pre = f"model.layers.{k}."
        for n, t in tensors.items():
            if not n.startswith(pre):
                continue
            rest = n[len(pre) :]
            if engine == "vllm":
                out[n if rest.startswith(OWN) else f"{pre}mtp_block.{rest}"] = t
            elif not rest.startswith(("shared_head.head", "embed_tokens")):
                out[f"model.{rest}" if rest.startswith(OWN) else f"model.decoder.{rest}"] = t
    return out


def megatron_trainer(seed: int) -> dict[str, torch.Tensor]:
    """Version `seed` as a Megatron-Core trainer holds it: the policy's GPT tensors and its
    MTP block `mtp.layers.0` (enorm, hnorm, eh_proj, final_layernorm = HF's
    shared_head.norm, and the decoder layer as `transformer_layer`); Megatron's MTP has no
    head of its own, it reads the model's output layer."""
    hf = trainer_tensors(seed)
    cfg = copy.deepcopy(config(DSV3))
    k = cfg.num_hidden_layers
    cfg.num_hidden_layers = k + 1  # convert the MTP block as one more decoder layer
    held = megatron_weights(DSV3, SimpleNamespace(config=cfg, state_dict=lambda: hf))
    out, block = {}, f"decoder.layers.{k}."
    for n, t in held.items():
        out[n.replace(block, "mtp.layers.0.transformer_layer.") if n.startswith(block) else n] = t
    for mg, name in (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"),
                     ("final_layernorm", "shared_head.norm")):  # fmt: skip
        out[f"mtp.layers.0.{mg}.weight"] = hf[f"model.layers.{k}.{name}.weight"]
    return out


def as_megatron_serves(seed: int) -> dict[str, torch.Tensor]:
    """Version `seed` under HF names as a draft reading a Megatron trainer serves it: the
    MTP layer's shared head is the model's output layer."""
    hf = dict(trainer_tensors(seed))
    hf[f"model.layers.{dims().layers}.shared_head.head.weight"] = hf["lm_head.weight"]
    return hf


def layouts(
    tp: int,
    draft: bool,
    d: DeepseekV3Dims | None = None,
    engine_name: str = "vllm",
    naming: str = "hf",
) -> list[EngineLayout]:
    make = deepseek_mtp_engine_layout if draft else deepseek_v3_engine_layout
    d = d or dims()
    return [make(d, EngineParallel(tp, r), engine_name, source_naming=naming) for r in range(tp)]


def shapes_of(lays: list[EngineLayout]) -> Callable[[int], dict[str, tuple[int, ...]]]:
    """What each rank allocates (stacked experts: local experts x slice shape)."""

    def shapes(r: int) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {}
        for t in lays[r].tensors:
            out[t.name] = t.local_shape if t.index is None else (t.index + 1, *t.local_shape)
        return out

    return shapes


def engine(
    tp: int, draft: bool, engine_name: str = "vllm", naming: str = "hf"
) -> tuple[EngineModel, list[EngineLayout]]:
    """What `tp` policy or draft ranks allocate (padding rows hold PAD_FILL)."""
    lays = layouts(tp, draft, engine_name=engine_name, naming=naming)
    cfg = SimpleNamespace(config=config(DSV3))  # the loaders' reference reads only the config
    return EngineModel(cfg, tp, 1, engine_name, shapes_of(lays)), lays


def expected(eng: EngineModel, draft: bool, seed: int) -> list[dict[str, torch.Tensor]]:
    """Per rank, what vLLM's loaders put in each engine tensor from version `seed`."""
    tensors = trainer_tensors(seed)
    hf = draft_names(tensors, dims()) if draft else tensors
    return [loaded_buffers(eng, r, hf) for r in range(eng.tp)]


def mismatches(held: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    return [n for n, w in want.items() if not torch.equal(held[n], w)]


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor's name and bytes, in name order: equal digests, equal
    tensors bit for bit."""
    h = hashlib.sha256()
    for n in sorted(tensors):
        h.update(n.encode())
        h.update(tensors[n].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
