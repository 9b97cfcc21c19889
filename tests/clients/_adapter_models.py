"""Global weights of a tiny Megatron-named GPT (dense and MoE layers), for adapter tests."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from refitd.client import InferenceClient


@dataclass(frozen=True)
class TinyGpt:
    layers: int = 4
    hidden: int = 32
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    ffn: int = 64
    vocab: int = 128
    experts: int = 4
    expert_ffn: int = 16
    first_moe_layer: int = 2

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        h, bf = self.hidden, torch.bfloat16
        out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
            "embedding.word_embeddings.weight": ((self.vocab, h), bf),
            "decoder.final_layernorm.weight": ((h,), bf),
            "output_layer.weight": ((self.vocab, h), bf),
        }
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        for i in range(self.layers):
            p = f"decoder.layers.{i}."
            out[p + "self_attention.linear_qkv.layer_norm_weight"] = ((h,), bf)
            out[p + "self_attention.linear_qkv.weight"] = ((qkv, h), bf)
            out[p + "self_attention.linear_proj.weight"] = ((h, self.heads * self.head_dim), bf)
            if i < self.first_moe_layer:
                out[p + "mlp.linear_fc1.layer_norm_weight"] = ((h,), bf)
                out[p + "mlp.linear_fc1.weight"] = ((2 * self.ffn, h), bf)
                out[p + "mlp.linear_fc2.weight"] = ((h, self.ffn), bf)
                continue
            out[p + "pre_mlp_layernorm.weight"] = ((h,), bf)
            out[p + "mlp.router.weight"] = ((self.experts, h), bf)
            out[p + "mlp.router.expert_bias"] = ((self.experts,), torch.float32)
            out[p + "mlp.shared_experts.linear_fc1.weight"] = ((2 * self.expert_ffn, h), bf)
            out[p + "mlp.shared_experts.linear_fc2.weight"] = ((h, self.expert_ffn), bf)
            for e in range(self.experts):
                out[p + f"mlp.experts.linear_fc1.weight{e}"] = ((2 * self.expert_ffn, h), bf)
                out[p + f"mlp.experts.linear_fc2.weight{e}"] = ((h, self.expert_ffn), bf)
        return out

    def weights(self, seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return {
            n: torch.randn(shape, generator=g).to(dtype)
            for n, (shape, dtype) in self.shapes().items()
        }


def subscribed(client: InferenceClient, timeout_s: float = 30.0) -> InferenceClient:
    """Follow the pool's events and return once the subscription is live (HELLO seen): a
    refit needs every inference worker subscribed so it can pause."""
    hello = threading.Event()
    client.on_update(lambda event: hello.set() if event.kind == "hello" else None)
    if not hello.wait(timeout_s):
        raise TimeoutError(f"no HELLO from the controller within {timeout_s} s")
    return client
