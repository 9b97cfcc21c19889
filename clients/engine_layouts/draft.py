"""The draft model of speculative decoding as an engine rank holds it: DeepSeek-V3 /
Kimi-K2 multi-token prediction (MTP) layers in vLLM's draft model (`DeepSeekMTP`), as boxes
of the tensors a trainer holds for those layers.

A trainer holds the MTP layers as extra decoder layers after the last one, under HF
checkpoint names: layer k = num_hidden_layers + i has `model.layers.{k}.enorm`, `.hnorm`
(RMSNorms of the token embedding and of the previous hidden state), `.eh_proj`
[hidden, 2 * hidden] (their concatenation projected back), `.shared_head.norm`,
`.shared_head.head` [vocab, hidden], and a decoder block named like any other layer's
(`model.layers.{k}.self_attn...`, `.mlp...`). The draft embeds tokens with the policy's
embedding (`model.embed_tokens.weight`): DeepSeek-V3 shares it between the two.

vLLM's draft model names and lays them out as follows, per TP rank:
- `model.embed_tokens.weight`: VocabParallelEmbedding, the vocabulary padded and split
  over TP, read from the trainer's `model.embed_tokens.weight`;
- `model.layers.{k}.enorm.weight`, `.hnorm.weight`, `.shared_head.norm.weight`: whole;
- `model.layers.{k}.eh_proj.weight`: a plain linear layer, whole on every rank;
- `model.layers.{k}.shared_head.head.weight`: ParallelLMHead, padded and split over TP;
- `model.layers.{k}.mtp_block.<name>`: the decoder block, laid out as the policy's layer
  k would be (MLA with `fused_qkv_a_proj`, routed experts in FusedMoE's
  `mlp.experts.routed_experts.w13_weight` / `w2_weight`) under the block's HF name with
  `mtp_block.` after the layer number.

Register the draft as a destination pool of the policy's model (`register_engine`): every
version then lands in the policy and its draft together, or in neither.
"""

from __future__ import annotations

from dataclasses import replace

from clients.engine_layouts.layouts import (
    VOCAB_PADDING,
    EngineLayout,
    EngineParallel,
    EngineTensor,
    _naming,
    _vocab,
    _whole,
    deepseek_v3_layer,
)
from clients.hf_names.maps import DeepseekV3Dims
from refitd.plan.errors import PlanError
from refitd.plan.names import NameMap

MTP_BLOCK = "mtp_block"


def mtp_layer_index(d: DeepseekV3Dims, i: int) -> int:
    """The layer number of MTP layer i: the MTP layers follow the decoder's last."""
    if not 0 <= i < d.mtp_layers:
        raise PlanError(f"MTP layer {i} outside 0..{d.mtp_layers - 1}")
    return d.layers + i


def _in_block(t: EngineTensor, layer: str) -> EngineTensor:
    """A decoder-block tensor of `layer` under vLLM's draft name (`<layer>.mtp_block.`)."""
    return replace(t, name=t.name.replace(f"{layer}.", f"{layer}.{MTP_BLOCK}.", 1))


def deepseek_mtp_engine_layout(
    d: DeepseekV3Dims,
    p: EngineParallel,
    engine: str = "vllm",
    padding: int = VOCAB_PADDING,
    source_naming: str = "hf",
) -> EngineLayout:
    """The MTP layers of DeepSeek-V3 / Kimi-K2 as a rank of vLLM's draft model holds them,
    reading a trainer that holds them under HF names ("hf": transformers' fused experts in
    the block, or "hf-checkpoint": per-expert experts)."""
    if engine != "vllm":
        raise ValueError(f"draft engine {engine!r}: the MTP draft layout is vLLM's")
    if _naming(source_naming) == "megatron":
        raise ValueError(
            "source_naming 'megatron': the MTP draft layout reads MTP layers held under HF "
            "names (`model.layers.{num_hidden_layers + i}.*`); use 'hf' or 'hf-checkpoint'"
        )
    if d.mtp_layers < 1:
        raise PlanError("the model has no MTP layers (num_nextn_predict_layers is 0)")
    embed = "model.embed_tokens.weight"
    t_embed, r_embed = _vocab(embed, embed, d.vocab, d.hidden, p, padding)
    tensors, rules = [t_embed], [r_embed]
    fused = source_naming == "hf"
    for i in range(d.mtp_layers):
        k = mtp_layer_index(d, i)
        layer = f"model.layers.{k}"
        head = f"{layer}.shared_head.head.weight"
        t_head, r_head = _vocab(head, head, d.vocab, d.hidden, p, padding)
        tensors += [
            _whole(f"{layer}.enorm.weight", (d.hidden,)),
            _whole(f"{layer}.hnorm.weight", (d.hidden,)),
            _whole(f"{layer}.eh_proj.weight", (d.hidden, 2 * d.hidden)),
            _whole(f"{layer}.shared_head.norm.weight", (d.hidden,)),
            t_head,
        ]
        tensors += [_in_block(t, layer) for t in deepseek_v3_layer(k, d, p, engine, fused)]
        rules.append(r_head)
    return EngineLayout(tuple(tensors), NameMap(tuple(rules)), source_naming)
