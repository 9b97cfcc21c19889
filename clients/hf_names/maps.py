"""Name maps from Megatron-Core naming to Hugging Face checkpoint naming.

Destinations are HF checkpoint names (what vLLM and SGLang load, and what transformers
modules hold once fused experts are viewed per expert, see clients.hf_names.destination);
sources are Megatron canonical names (global layer and expert indices). Fused QKV is split
per KV group into q/k/v, gated fc1 into gate/up, everything else is renamed. The maps are
refitd.plan NameMaps: the planner applies them box by box, no tensor is gathered whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from refitd.plan.names import NameMap, NameRule, rename, split_fused_qkv, split_gated_fc1


@dataclass(frozen=True, slots=True)
class LlamaDims:
    """Sizes of a Llama / Qwen2 / Mistral-style model that the map needs."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    qkv_bias: bool = False
    tie_embeddings: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k
    experts: int = 0  # Qwen3-MoE: routed experts (no shared expert) in every MoE layer
    expert_ffn: int = 0
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP when experts > 0

    @classmethod
    def from_hf_config(cls, cfg: Any) -> LlamaDims:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        experts = int(getattr(cfg, "num_experts", 0) or 0)
        step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
        dense = tuple(
            i
            for i in range(cfg.num_hidden_layers)
            if experts
            and (i in (getattr(cfg, "mlp_only_layers", None) or ()) or (i + 1) % step != 0)
        )
        return cls(
            layers=cfg.num_hidden_layers,
            hidden=cfg.hidden_size,
            heads=cfg.num_attention_heads,
            kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
            head_dim=head_dim,
            ffn=cfg.intermediate_size,
            vocab=cfg.vocab_size,
            qkv_bias=bool(getattr(cfg, "attention_bias", False))
            or cfg.model_type.startswith("qwen2"),
            tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qk_norm=cfg.model_type.startswith("qwen3"),
            experts=experts,
            expert_ffn=int(getattr(cfg, "moe_intermediate_size", 0) or 0) if experts else 0,
            dense_layers=dense,
        )


def _ends(hidden: int, vocab: int, tie: bool) -> list[NameRule]:
    rules = [
        rename("model.embed_tokens.weight", "embedding.word_embeddings.weight", vocab),
        rename("model.norm.weight", "decoder.final_layernorm.weight", hidden),
    ]
    if not tie:
        rules.append(rename("lm_head.weight", "output_layer.weight", vocab))
    return rules


def _gated_mlp(dst: str, src: str, hidden: int, ffn: int) -> list[NameRule]:
    """HF gate/up/down projections from Megatron's gated linear_fc1 and linear_fc2."""
    return [
        *split_gated_fc1(f"{src}.linear_fc1.weight", f"{dst}.gate_proj.weight",
                         f"{dst}.up_proj.weight", ffn),
        rename(f"{dst}.down_proj.weight", f"{src}.linear_fc2.weight", hidden),
    ]  # fmt: skip


def llama_name_map(d: LlamaDims) -> NameMap:
    """Megatron GPT (fused QKV with its input layernorm, gated fc1 with its layernorm) to
    HF Llama / Qwen2 / Qwen3 names (q/k norms); Qwen3-MoE's routed experts when
    `d.experts` (router `mlp.router`, per-expert fc1/fc2, pre-MLP layernorm)."""
    rules = _ends(d.hidden, d.vocab, d.tie_embeddings)
    for i in range(d.layers):
        hf, mg = f"model.layers.{i}", f"decoder.layers.{i}"
        qkv = f"{mg}.self_attention.linear_qkv"
        attn = f"{hf}.self_attn"
        rules += [
            rename(f"{hf}.input_layernorm.weight", f"{qkv}.layer_norm_weight", d.hidden),
            *split_fused_qkv(f"{qkv}.weight", f"{attn}.q_proj.weight", f"{attn}.k_proj.weight",
                             f"{attn}.v_proj.weight", d.heads, d.kv_heads, d.head_dim),
            rename(f"{attn}.o_proj.weight", f"{mg}.self_attention.linear_proj.weight", d.hidden),
        ]  # fmt: skip
        if d.qk_norm:
            rules += [
                rename(f"{attn}.q_norm.weight", f"{mg}.self_attention.q_layernorm.weight",
                       d.head_dim),
                rename(f"{attn}.k_norm.weight", f"{mg}.self_attention.k_layernorm.weight",
                       d.head_dim),
            ]  # fmt: skip
        if d.experts and i not in d.dense_layers:
            rules += [
                rename(f"{hf}.post_attention_layernorm.weight", f"{mg}.pre_mlp_layernorm.weight",
                       d.hidden),
                rename(f"{hf}.mlp.gate.weight", f"{mg}.mlp.router.weight", d.experts),
                *_routed_experts(hf, mg, d.experts, d.hidden, d.expert_ffn),
            ]  # fmt: skip
        else:
            rules += [
                rename(f"{hf}.post_attention_layernorm.weight",
                       f"{mg}.mlp.linear_fc1.layer_norm_weight", d.hidden),
                *_gated_mlp(f"{hf}.mlp", f"{mg}.mlp", d.hidden, d.ffn),
            ]  # fmt: skip
        if d.qkv_bias:
            rules += split_fused_qkv(f"{qkv}.bias", f"{attn}.q_proj.bias", f"{attn}.k_proj.bias",
                                     f"{attn}.v_proj.bias", d.heads, d.kv_heads, d.head_dim)  # fmt: skip
    return NameMap(tuple(rules))


@dataclass(frozen=True, slots=True)
class DeepseekV3Dims:
    """Sizes of a DeepSeek-V3 / Kimi-K2-style model (MLA attention, routed + shared experts)."""

    layers: int
    first_dense: int
    hidden: int
    heads: int
    q_lora: int | None
    kv_lora: int
    rope: int
    nope: int
    v_head: int
    ffn: int
    experts: int
    expert_ffn: int
    shared_experts: int
    vocab: int
    tie_embeddings: bool = False
    mtp_layers: int = 0  # MTP (next-token prediction) layers after the decoder's last

    @classmethod
    def from_hf_config(cls, cfg: Any) -> DeepseekV3Dims:
        return cls(
            layers=cfg.num_hidden_layers,
            first_dense=cfg.first_k_dense_replace,
            hidden=cfg.hidden_size,
            heads=cfg.num_attention_heads,
            q_lora=cfg.q_lora_rank,
            kv_lora=cfg.kv_lora_rank,
            rope=cfg.qk_rope_head_dim,
            nope=cfg.qk_nope_head_dim,
            v_head=cfg.v_head_dim,
            ffn=cfg.intermediate_size,
            experts=cfg.n_routed_experts,
            expert_ffn=cfg.moe_intermediate_size,
            shared_experts=cfg.n_shared_experts or 0,
            vocab=cfg.vocab_size,
            tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            mtp_layers=int(getattr(cfg, "num_nextn_predict_layers", 0) or 0),
        )


def deepseek_v3_name_map(d: DeepseekV3Dims) -> NameMap:
    """Megatron MLA + MoE (per-expert `weight{E}`) to HF DeepSeek-V3 / Kimi-K2 names, experts
    as `mlp.experts.{e}.{gate,up,down}_proj.weight`."""
    rules = _ends(d.hidden, d.vocab, d.tie_embeddings)
    for i in range(d.layers):
        rules += _deepseek_v3_layer(f"model.layers.{i}", f"decoder.layers.{i}", i, d)
    return NameMap(tuple(rules))


def deepseek_mtp_name_map(d: DeepseekV3Dims) -> NameMap:
    """Megatron-Core's MTP block to the HF names of DeepSeek-V3 / Kimi-K2 MTP layers.

    Megatron holds MTP layer i as `mtp.layers.{i}`: `enorm`, `hnorm`, `eh_proj` (its input
    the normed embedding then the normed hidden state, as HF's), `final_layernorm` (HF's
    `shared_head.norm`) and a decoder layer `transformer_layer` named like the decoder's.
    It has no head of its own: HF's `shared_head.head` reads the model's output layer."""
    head = "embedding.word_embeddings.weight" if d.tie_embeddings else "output_layer.weight"
    rules: list[NameRule] = []
    for i in range(d.mtp_layers):
        k = d.layers + i
        hf, mg = f"model.layers.{k}", f"mtp.layers.{i}"
        rules += [
            rename(f"{hf}.enorm.weight", f"{mg}.enorm.weight", d.hidden),
            rename(f"{hf}.hnorm.weight", f"{mg}.hnorm.weight", d.hidden),
            rename(f"{hf}.eh_proj.weight", f"{mg}.eh_proj.weight", d.hidden),
            rename(f"{hf}.shared_head.norm.weight", f"{mg}.final_layernorm.weight", d.hidden),
            rename(f"{hf}.shared_head.head.weight", head, d.vocab),
            *_deepseek_v3_layer(hf, f"{mg}.transformer_layer", k, d),
        ]
    return NameMap(tuple(rules))


def _deepseek_v3_layer(hf: str, mg: str, i: int, d: DeepseekV3Dims) -> list[NameRule]:
    """Decoder layer i (dense below `first_dense`) from Megatron's layer at `mg`."""
    attn, sa = f"{hf}.self_attn", f"{mg}.self_attention"
    qk = d.heads * (d.nope + d.rope)
    rules = [
        rename(f"{hf}.input_layernorm.weight", f"{mg}.input_layernorm.weight", d.hidden),
        rename(f"{attn}.kv_a_proj_with_mqa.weight", f"{sa}.linear_kv_down_proj.weight",
               d.kv_lora + d.rope),
        rename(f"{attn}.kv_a_layernorm.weight", f"{sa}.linear_kv_up_proj.layer_norm_weight",
               d.kv_lora),
        rename(f"{attn}.kv_b_proj.weight", f"{sa}.linear_kv_up_proj.weight",
               d.heads * (d.nope + d.v_head)),
        rename(f"{attn}.o_proj.weight", f"{sa}.linear_proj.weight", d.hidden),
    ]  # fmt: skip
    if d.q_lora:
        rules += [
            rename(f"{attn}.q_a_proj.weight", f"{sa}.linear_q_down_proj.weight", d.q_lora),
            rename(f"{attn}.q_a_layernorm.weight", f"{sa}.linear_q_up_proj.layer_norm_weight",
                   d.q_lora),
            rename(f"{attn}.q_b_proj.weight", f"{sa}.linear_q_up_proj.weight", qk),
        ]  # fmt: skip
    else:
        rules.append(rename(f"{attn}.q_proj.weight", f"{sa}.linear_q_proj.weight", qk))
    if i < d.first_dense:
        return [
            *rules,
            rename(f"{hf}.post_attention_layernorm.weight",
                   f"{mg}.mlp.linear_fc1.layer_norm_weight", d.hidden),
            *_gated_mlp(f"{hf}.mlp", f"{mg}.mlp", d.hidden, d.ffn),
        ]  # fmt: skip
    rules += [
        rename(f"{hf}.post_attention_layernorm.weight", f"{mg}.pre_mlp_layernorm.weight",
               d.hidden),
        rename(f"{hf}.mlp.gate.weight", f"{mg}.mlp.router.weight", d.experts),
        rename(f"{hf}.mlp.gate.e_score_correction_bias", f"{mg}.mlp.router.expert_bias",
               d.experts),
    ]  # fmt: skip
    if d.shared_experts:
        rules += _gated_mlp(f"{hf}.mlp.shared_experts", f"{mg}.mlp.shared_experts",
                            d.hidden, d.expert_ffn * d.shared_experts)  # fmt: skip
    return rules + _routed_experts(hf, mg, d.experts, d.hidden, d.expert_ffn)


def _routed_experts(hf: str, mg: str, experts: int, hidden: int, ffn: int) -> list[NameRule]:
    """Megatron per-expert fc1/fc2 (`weight{E}`, global E) to HF per-expert projections."""
    rules: list[NameRule] = []
    for e in range(experts):
        ex = f"{hf}.mlp.experts.{e}"
        rules += [
            *split_gated_fc1(f"{mg}.mlp.experts.linear_fc1.weight{e}", f"{ex}.gate_proj.weight",
                             f"{ex}.up_proj.weight", ffn),
            rename(f"{ex}.down_proj.weight", f"{mg}.mlp.experts.linear_fc2.weight{e}", hidden),
        ]  # fmt: skip
    return rules


def name_map_for(cfg: Any) -> NameMap:
    """The map for a transformers config by its model_type."""
    kind = cfg.model_type
    if kind in ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral"):
        return llama_name_map(LlamaDims.from_hf_config(cfg))
    if kind in ("deepseek_v3", "kimi_k2"):
        return deepseek_v3_name_map(DeepseekV3Dims.from_hf_config(cfg))
    raise ValueError(f"no Megatron -> HF name map for model_type {kind!r}")
