"""The draft model of speculative decoding as an engine rank holds it: DeepSeek-V3 /
Kimi-K2 multi-token prediction (MTP) layers in vLLM's draft model (`DeepSeekMTP`) or
SGLang's (`DeepseekV3ForCausalLMNextN`), as boxes of the tensors a trainer holds for them.

A trainer holds the MTP layers under HF names, as extra decoder layers after the last one:
layer k = num_hidden_layers + i has `model.layers.{k}.enorm`, `.hnorm` (RMSNorms of the
token embedding and of the previous hidden state), `.eh_proj` [hidden, 2 * hidden] (their
concatenation projected back), `.shared_head.norm`, `.shared_head.head` [vocab, hidden],
and a decoder block named like any other layer's. Or, a Megatron-Core trainer, under
`mtp.layers.{i}` (clients.hf_names.deepseek_mtp_name_map). The draft embeds tokens with
the policy's embedding: DeepSeek-V3 shares it between the two.

vLLM's draft names and lays them out per TP rank as:
- `model.embed_tokens.weight`: VocabParallelEmbedding, padded and split over TP;
- `model.layers.{k}.enorm.weight`, `.hnorm.weight`, `.shared_head.norm.weight`: whole;
- `model.layers.{k}.eh_proj.weight`: a plain linear layer, whole on every rank;
- `model.layers.{k}.shared_head.head.weight`: ParallelLMHead, padded and split over TP;
- `model.layers.{k}.mtp_block.<name>`: the decoder block, laid out as the policy's layer k.
SGLang's draft holds one MTP layer, without the layer number: `model.enorm.weight`,
`model.hnorm.weight`, `model.eh_proj.weight`, `model.shared_head.norm.weight` whole and
`model.decoder.<name>` laid out as the policy's layer k. Its embedding and output layer
are the policy's own tensors (SGLang's speculative worker hands them over), so the policy
pool's refit writes them and the draft layout leaves them out: the trainer's
`shared_head.head` reaches no SGLang draft.

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
    _engine,
    _naming,
    _vocab,
    _whole,
    deepseek_v3_layer,
)
from clients.hf_names.maps import DeepseekV3Dims, deepseek_mtp_name_map
from refitd.plan.errors import PlanError
from refitd.plan.names import NameMap

MTP_BLOCK = "mtp_block"  # vLLM: model.layers.{k}.mtp_block.<name>
SGLANG_BLOCK = "model.decoder"  # SGLang: model.decoder.<name>


def mtp_layer_index(d: DeepseekV3Dims, i: int) -> int:
    """The layer number of MTP layer i: the MTP layers follow the decoder's last."""
    if not 0 <= i < d.mtp_layers:
        raise PlanError(f"MTP layer {i} outside 0..{d.mtp_layers - 1}")
    return d.layers + i


def _moved(t: EngineTensor, old: str, new: str) -> EngineTensor:
    """A decoder-block tensor of `old` held under the draft's prefix `new` instead."""
    return replace(t, name=t.name.replace(f"{old}.", f"{new}.", 1))


def deepseek_mtp_engine_layout(
    d: DeepseekV3Dims,
    p: EngineParallel,
    engine: str = "vllm",
    padding: int = VOCAB_PADDING,
    source_naming: str = "hf",
) -> EngineLayout:
    """The MTP layers of DeepSeek-V3 / Kimi-K2 as a rank of vLLM's or SGLang's draft model
    holds them, reading a trainer that names them as `source_naming` says ("hf":
    transformers' fused experts in the block, "hf-checkpoint": per-expert experts,
    "megatron": Megatron-Core's MTP block)."""
    _engine(engine)
    naming = _naming(source_naming)
    if d.mtp_layers < 1:
        raise PlanError("the model has no MTP layers (num_nextn_predict_layers is 0)")
    if engine == "sglang" and d.mtp_layers != 1:
        raise PlanError(f"SGLang's MTP draft holds one MTP layer; the model has {d.mtp_layers}")
    megatron = naming == "megatron"
    rules = {r.dst: r for r in deepseek_mtp_name_map(d).rules} if megatron else {}
    tensors: list[EngineTensor] = []
    if engine == "vllm":
        embed = "model.embed_tokens.weight"
        src = "embedding.word_embeddings.weight" if megatron else embed
        t_embed, r_embed = _vocab(embed, src, d.vocab, d.hidden, p, padding)
        tensors.append(t_embed)
        rules[r_embed.dst] = r_embed
    fused = naming == "hf"
    for i in range(d.mtp_layers):
        k = mtp_layer_index(d, i)
        layer = f"model.layers.{k}"
        own = ("enorm", "hnorm", "eh_proj", "shared_head.norm")
        shapes = {"eh_proj": (d.hidden, 2 * d.hidden)}
        held = layer if engine == "vllm" else "model"
        tensors += [
            _whole(f"{held}.{n}.weight", shapes.get(n, (d.hidden,)), f"{layer}.{n}.weight")
            for n in own
        ]
        block = f"{layer}.{MTP_BLOCK}" if engine == "vllm" else SGLANG_BLOCK
        tensors += [_moved(t, layer, block) for t in deepseek_v3_layer(k, d, p, engine, fused)]
        if engine == "vllm":
            head = f"{layer}.shared_head.head.weight"
            src = rules[head].parts[0].source if megatron else head
            t_head, r_head = _vocab(head, src, d.vocab, d.hidden, p, padding)
            tensors.append(t_head)
            rules[head] = r_head
    return EngineLayout(tuple(tensors), NameMap(tuple(rules.values())), source_naming)
