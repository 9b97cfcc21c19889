"""Tiny Llama, Qwen3 (tied embeddings), Qwen3-MoE and DeepSeek-V3 models built from
transformers configs (random init, no download), and their weights in Megatron-Core naming,
converted here with plain torch (independently of the name maps under test). The Qwen
models have a vocabulary of 250, which inference engines pad to 256."""

from __future__ import annotations

import traceback
from typing import Any

import torch

LLAMA = "hf-llama"
DSV3 = "hf-dsv3"
QWEN3 = "hf-qwen3"
QWEN3_MOE = "hf-qwen3-moe"
MOE_KINDS = (DSV3, QWEN3_MOE)


def config(kind: str) -> Any:
    from transformers import DeepseekV3Config, LlamaConfig, Qwen3Config, Qwen3MoeConfig

    if kind == QWEN3:
        return Qwen3Config(
            vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            tie_word_embeddings=True,
        )  # fmt: skip
    if kind == QWEN3_MOE:
        return Qwen3MoeConfig(
            vocab_size=250, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
            tie_word_embeddings=False,
        )  # fmt: skip
    if kind == LLAMA:
        return LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            tie_word_embeddings=False,
        )  # fmt: skip
    return DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, first_k_dense_replace=1, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1, q_lora_rank=32,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False,
    )  # fmt: skip


def model(kind: str, seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(config(kind)).to(torch.bfloat16).eval()
    if kind == DSV3:  # random router bias, so a wrong expert_bias mapping shows in logits
        with torch.no_grad():
            for layer in m.model.layers[1:]:
                layer.mlp.gate.e_score_correction_bias.normal_()
    return m


def megatron_weights(kind: str, hf: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The HF model's weights as a Megatron-Core GPT holds them (global tensors)."""
    cfg = hf.config
    sd = {n: t.detach().clone() for n, t in hf.state_dict().items()}
    out = {
        "embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": sd["model.norm.weight"],
    }
    if not cfg.tie_word_embeddings:  # tied: Megatron shares the embedding, no output layer
        out["output_layer.weight"] = sd["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        hf_, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        a, sa = hf_ + "self_attn.", mg + "self_attention."
        out[sa + "linear_proj.weight"] = sd[a + "o_proj.weight"]
        if kind != DSV3:
            kv, hd = cfg.num_key_value_heads, cfg.head_dim
            h = cfg.hidden_size
            q = sd[a + "q_proj.weight"].view(kv, -1, h)
            k = sd[a + "k_proj.weight"].view(kv, hd, h)
            v = sd[a + "v_proj.weight"].view(kv, hd, h)
            out[sa + "linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, h)
            out[sa + "linear_qkv.layer_norm_weight"] = sd[hf_ + "input_layernorm.weight"]
            if kind in (QWEN3, QWEN3_MOE):
                out[sa + "q_layernorm.weight"] = sd[a + "q_norm.weight"]
                out[sa + "k_layernorm.weight"] = sd[a + "k_norm.weight"]
        else:
            out[mg + "input_layernorm.weight"] = sd[hf_ + "input_layernorm.weight"]
            out[sa + "linear_q_down_proj.weight"] = sd[a + "q_a_proj.weight"]
            out[sa + "linear_q_up_proj.layer_norm_weight"] = sd[a + "q_a_layernorm.weight"]
            out[sa + "linear_q_up_proj.weight"] = sd[a + "q_b_proj.weight"]
            out[sa + "linear_kv_down_proj.weight"] = sd[a + "kv_a_proj_with_mqa.weight"]
            out[sa + "linear_kv_up_proj.layer_norm_weight"] = sd[a + "kv_a_layernorm.weight"]
            out[sa + "linear_kv_up_proj.weight"] = sd[a + "kv_b_proj.weight"]
        m = hf_ + "mlp."
        if kind in (LLAMA, QWEN3) or (kind == DSV3 and i < cfg.first_k_dense_replace):
            out[mg + "mlp.linear_fc1.layer_norm_weight"] = sd[
                hf_ + "post_attention_layernorm.weight"
            ]
            out[mg + "mlp.linear_fc1.weight"] = torch.cat(
                [sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]]
            )
            out[mg + "mlp.linear_fc2.weight"] = sd[m + "down_proj.weight"]
            continue
        out[mg + "pre_mlp_layernorm.weight"] = sd[hf_ + "post_attention_layernorm.weight"]
        out[mg + "mlp.router.weight"] = sd[m + "gate.weight"]
        if kind == DSV3:
            out[mg + "mlp.router.expert_bias"] = sd[m + "gate.e_score_correction_bias"]
            s = m + "shared_experts."
            out[mg + "mlp.shared_experts.linear_fc1.weight"] = torch.cat(
                [sd[s + "gate_proj.weight"], sd[s + "up_proj.weight"]]
            )
            out[mg + "mlp.shared_experts.linear_fc2.weight"] = sd[s + "down_proj.weight"]
        for e in range(num_experts(kind)):
            out[mg + f"mlp.experts.linear_fc1.weight{e}"] = sd[m + "experts.gate_up_proj"][e]
            out[mg + f"mlp.experts.linear_fc2.weight{e}"] = sd[m + "experts.down_proj"][e]
    return {n: t.contiguous().clone() for n, t in out.items()}


def num_experts(kind: str) -> int:
    """Routed experts of a kind (0: a dense model)."""
    cfg = config(kind)
    return int(getattr(cfg, "n_routed_experts", None) or getattr(cfg, "num_experts", 0) or 0)


def trainer_rank(
    rank: int,
    controller: str,
    seed: int,
    results: Any,
    barrier: Any,
    kinds: tuple[str, ...] = (LLAMA, DSV3),
    prefix: str = "",
) -> None:
    """Megatron rank (tp=2 x pp=2; experts ep=2 over the TP ranks) of each model kind; the
    model registers as `prefix + kind`."""
    from clients.megatron_adapter import ParallelState, register_megatron
    from clients.megatron_adapter.toy import build_rank_module
    from refitd.client import TrainerClient

    trainers = []
    try:
        tp, pp = rank % 2, rank // 2
        for kind in kinds:
            ref = model(kind, seed)
            moe = kind in MOE_KINDS
            state = ParallelState(
                tp_rank=tp, tp_size=2, pp_rank=pp, pp_size=2,
                ep_rank=tp if moe else 0, ep_size=2 if moe else 1,
            )  # fmt: skip
            experts = num_experts(kind)
            module = build_rank_module(
                megatron_weights(kind, ref), ref.config.num_hidden_layers, state, experts
            )
            t = TrainerClient(
                controller, prefix + kind, rank=rank, pool_size=4, device=f"cpu:{rank}"
            )
            trainers.append(t)
            register_megatron(t, module, state)
        barrier.wait(120)  # every rank registered before any asks for a refit
        for kind, t in zip(kinds, trainers, strict=True):
            results.put((rank, kind, t.refit(1, wait="committed", timeout=90).state))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        for t in trainers:
            t.close()


def fsdp_trainer_rank(
    rank: int, port: int, controller: str, seed: int, kinds: tuple[str, ...], batch: Any,
    results: Any,
) -> None:  # fmt: skip
    """FSDP2 rank of 2 (Gloo) of each model kind: every decoder layer and the root
    `fully_shard`-ed, registered under the transformers model's own names as
    `fsdp-{kind}`; after refit v1 rank 0 reports the sharded model's logits of `batch`."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from clients.dtensor_adapter import register_dtensor_module
    from refitd.client import TrainerClient

    trainers = []
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
        )
        mesh = init_device_mesh("cpu", (2,))
        models = {}
        for kind in kinds:
            m = model(kind, seed)
            for layer in m.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(m, mesh=mesh)
            t = TrainerClient(controller, f"fsdp-{kind}", rank=rank, pool_size=2,
                              device=f"cpu:{rank}")  # fmt: skip
            trainers.append(t)
            register_dtensor_module(t, m)
            models[kind] = m
        dist.barrier()  # every rank registered before any asks for a refit
        for kind, t in zip(kinds, trainers, strict=True):
            results.put((rank, kind, t.refit(1, wait="committed", timeout=90).state))
        with torch.no_grad():
            for kind, m in models.items():
                logits = m(batch).logits
                if rank == 0:
                    results.put((rank, f"logits-{kind}", logits))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        for t in trainers:
            t.close()
        if dist.is_initialized():
            dist.destroy_process_group()
