"""A tiny inference engine that holds a model the way vLLM / SGLang TP ranks do, and runs
it from those tensors.

`EngineModel` keeps one dict of engine tensors per TP rank (fused qkv_proj, gate_up_proj,
stacked FusedMoE w13/w2 where each engine's FusedMoE holds them, padded vocabulary, MLA
fused_qkv_a_proj); its forward splits them back into the transformers model's parameters
with the engines' own semantics, written here independently of clients.engine_layouts (q
heads then k then v per rank, KV head r // (tp / kv) on rank r, gate rows then up rows,
vocabulary cut evenly after padding to 64, experts contiguous per EP rank), and calls the
transformers model on them. Replicated copies must agree and padding rows must still hold
their fill value, or it raises.
"""

from __future__ import annotations

from typing import Any

import torch

from clients.engine_layouts import EngineLayout, engine_placements
from refitd.formats.mxfp8 import mxfp8_dequantize, mxfp8_quantize
from refitd.plan.wire import mxfp8_scale_shape

PAD_FILL = 7.0  # what the engine's padding rows hold; a refit must never write them
# where each engine's FusedMoE holds w13_weight / w2_weight under `mlp.`: vLLM 0.33 in
# its `routed_experts` submodule, SGLang 0.5.23 on FusedMoE itself
EXPERTS_HELD = {"vllm": "experts.routed_experts.", "sglang": "experts."}


def _pad64(n: int) -> int:
    return -(-n // 64) * 64


class EngineModel:
    """`tp` ranks of one engine pool; experts over `ep` ranks (ffn over tp / ep).

    Parameters whose name ends with one of `mxfp8` are MXFP8 persistent buffers (uint8
    data in `ranks`, E8M0 scales in `scales`), dequantized by the forward."""

    def __init__(
        self,
        hf: torch.nn.Module,
        tp: int,
        ep: int,
        engine: str,
        shapes: Any,
        mxfp8: tuple[str, ...] = (),
    ) -> None:
        self.hf, self.cfg, self.tp, self.ep, self.engine = hf, hf.config, tp, ep, engine
        self.mxfp8 = mxfp8
        # shapes: rank -> {param name: shape} of what the engine allocates
        self.ranks: list[dict[str, torch.Tensor]] = []
        self.scales: list[dict[str, torch.Tensor]] = []
        for r in range(tp):
            held, scales = {}, {}
            for n, shape in shapes(r).items():
                if n.endswith(mxfp8) and mxfp8:
                    held[n] = torch.zeros(shape, dtype=torch.uint8)
                    scales[n] = torch.zeros(mxfp8_scale_shape(shape), dtype=torch.uint8)
                else:
                    held[n] = torch.full(shape, PAD_FILL, dtype=torch.bfloat16)
            self.ranks.append(held)
            self.scales.append(scales)
        self._read: list[dict[str, torch.Tensor]] = self.ranks

    # ------------------------------------------------------------------ assembly
    def _same(self, name: str) -> torch.Tensor:
        """A replicated tensor: every rank must hold the same bytes."""
        first = self._read[0][name]
        for r, t in enumerate(self._read):
            if not torch.equal(t[name], first):
                raise AssertionError(f"replica of {name} on rank {r} differs from rank 0")
        return first

    def _cat(self, name: str, dim: int) -> torch.Tensor:
        return torch.cat([t[name] for t in self._read], dim=dim)

    def _vocab(self, name: str) -> torch.Tensor:
        full = self._cat(name, 0)
        vocab = self.cfg.vocab_size
        assert full.shape[0] == _pad64(vocab), (name, full.shape)
        if not bool((full[vocab:] == PAD_FILL).all()):
            raise AssertionError(f"padding rows of {name} were written")
        return full[:vocab]

    def _qkv(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg, tp = self.cfg, self.tp
        hd, kv = cfg.head_dim, cfg.num_key_value_heads
        q_rows = cfg.num_attention_heads // tp * hd
        kv_rows = max(1, kv // tp) * hd
        qs = [t[name][:q_rows] for t in self._read]
        ks = [t[name][q_rows : q_rows + kv_rows] for t in self._read]
        vs = [t[name][q_rows + kv_rows :] for t in self._read]
        rep = max(1, tp // kv)
        for r in range(tp):  # replicated KV heads: every holder agrees with the first
            first = r - r % rep
            if not (torch.equal(ks[r], ks[first]) and torch.equal(vs[r], vs[first])):
                raise AssertionError(f"KV replica of {name} on rank {r} differs from {first}")
        return torch.cat(qs), torch.cat(ks[::rep]), torch.cat(vs[::rep])

    def _gate_up(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        halves = [t[name].chunk(2, dim=0) for t in self._read]
        return torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves])

    def _experts(self, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
        """HF fused experts [E, 2I, H] / [E, H, I] from per-rank w13 / w2."""
        mt = self.tp // self.ep
        held = f"{prefix}.{EXPERTS_HELD[self.engine]}"
        gate_up, down = [], []
        for e in range(self.ep):
            group = self._read[e * mt : (e + 1) * mt]
            w13 = [t[f"{held}w13_weight"].chunk(2, dim=1) for t in group]
            gate = torch.cat([g for g, _ in w13], dim=1)
            up = torch.cat([u for _, u in w13], dim=1)
            gate_up.append(torch.cat([gate, up], dim=1))
            down.append(torch.cat([t[f"{held}w2_weight"] for t in group], dim=2))
        return torch.cat(gate_up), torch.cat(down)

    def hf_state(self) -> dict[str, torch.Tensor]:
        """The transformers model's parameters, read out of the engine tensors."""
        self._read = [
            {
                n: mxfp8_dequantize(t, self.scales[r][n]) if n in self.scales[r] else t
                for n, t in held.items()
            }
            for r, held in enumerate(self.ranks)
        ]
        cfg = self.cfg
        sd: dict[str, torch.Tensor] = {
            "model.embed_tokens.weight": self._vocab("model.embed_tokens.weight"),
            "model.norm.weight": self._same("model.norm.weight"),
        }
        sd["lm_head.weight"] = (
            sd["model.embed_tokens.weight"]
            if cfg.tie_word_embeddings
            else self._vocab("lm_head.weight")
        )
        mla = cfg.model_type == "deepseek_v3"
        for i in range(cfg.num_hidden_layers):
            h = f"model.layers.{i}"
            a = f"{h}.self_attn"
            for n in ("input_layernorm", "post_attention_layernorm"):
                sd[f"{h}.{n}.weight"] = self._same(f"{h}.{n}.weight")
            sd[f"{a}.o_proj.weight"] = self._cat(f"{a}.o_proj.weight", 1)
            if mla:
                self._mla(a, sd)
            else:
                q, k, v = self._qkv(f"{a}.qkv_proj.weight")
                sd[f"{a}.q_proj.weight"], sd[f"{a}.k_proj.weight"] = q, k
                sd[f"{a}.v_proj.weight"] = v
                if cfg.model_type.startswith("qwen3"):
                    for n in ("q_norm", "k_norm"):
                        sd[f"{a}.{n}.weight"] = self._same(f"{a}.{n}.weight")
            m = f"{h}.mlp"
            if f"{m}.gate_up_proj.weight" in self._read[0]:
                self._mlp(m, sd)
                continue
            sd[f"{m}.gate.weight"] = self._same(f"{m}.gate.weight")
            if mla:
                bias = f"{m}.gate.e_score_correction_bias"
                sd[bias] = self._same(bias)
                self._mlp(f"{m}.shared_experts", sd)
            sd[f"{m}.experts.gate_up_proj"], sd[f"{m}.experts.down_proj"] = self._experts(m)
        return sd

    def _mlp(self, m: str, sd: dict[str, torch.Tensor]) -> None:
        gate, up = self._gate_up(f"{m}.gate_up_proj.weight")
        sd[f"{m}.gate_proj.weight"], sd[f"{m}.up_proj.weight"] = gate, up
        sd[f"{m}.down_proj.weight"] = self._cat(f"{m}.down_proj.weight", 1)

    def _mla(self, a: str, sd: dict[str, torch.Tensor]) -> None:
        cfg = self.cfg
        fused = "fused_qkv_a_proj" if self.engine == "vllm" else "fused_qkv_a_proj_with_mqa"
        qkv_a = self._same(f"{a}.{fused}.weight")
        sd[f"{a}.q_a_proj.weight"] = qkv_a[: cfg.q_lora_rank]
        sd[f"{a}.kv_a_proj_with_mqa.weight"] = qkv_a[cfg.q_lora_rank :]
        for n in ("q_a_layernorm", "kv_a_layernorm"):
            sd[f"{a}.{n}.weight"] = self._same(f"{a}.{n}.weight")
        sd[f"{a}.q_b_proj.weight"] = self._cat(f"{a}.q_b_proj.weight", 0)
        sd[f"{a}.kv_b_proj.weight"] = self._cat(f"{a}.kv_b_proj.weight", 0)

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def logits(self, batch: torch.Tensor) -> torch.Tensor:
        """The model's logits computed from the engine tensors."""
        state = self.hf_state()
        buffers = dict(self.hf.named_buffers())
        out = torch.func.functional_call(self.hf, {**buffers, **state}, (batch,), strict=True)
        return out.logits


def mxfp8_reference(hf: torch.nn.Module, suffixes: tuple[str, ...]) -> None:
    """Round the HF weights ending with `suffixes` through MXFP8 in place (the format's
    reference codec; blocks of 32 along each row, as the engine shards hold them)."""
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith(suffixes):
                p.copy_(mxfp8_dequantize(*mxfp8_quantize(p), dtype=p.dtype))


def loaded_buffers(
    eng: EngineModel, rank: int, hf: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """What the engines' weight loaders put in rank `rank`'s tensors from a transformers
    model's state dict `hf` (fused experts [E, 2I, H] / [E, H, I]), written here as vLLM's
    and SGLang's loaders do it: QKVParallelLinear narrows q at rank * q_rows and k / v at
    (rank // replicas) * kv_rows; MergedColumnParallelLinear puts the rank's gate rows,
    then its up rows; RowParallelLinear narrows dim 1; the vocabulary is padded to 64 and
    cut evenly (rows past the real vocabulary hold PAD_FILL: a refit never writes them);
    FusedMoE holds experts [ep_rank * E / ep, ...) with the ffn narrowed by the MoE TP
    rank. An MTP draft's shared head is a padded, split vocabulary like lm_head."""
    cfg, tp = eng.cfg, eng.tp
    mt = tp // eng.ep

    def part(t: torch.Tensor, dim: int, parts: int, r: int) -> torch.Tensor:
        n = t.shape[dim] // parts
        return t.narrow(dim, r * n, n)

    def gate_up(gate: torch.Tensor, up: torch.Tensor, parts: int, r: int) -> torch.Tensor:
        return torch.cat([part(gate, 0, parts, r), part(up, 0, parts, r)])

    out: dict[str, torch.Tensor] = {}
    for name, held in eng.ranks[rank].items():
        pre = name.rsplit(".", 2)[0] + "."  # the module path of `name`'s parent
        if name.endswith(("embed_tokens.weight", "lm_head.weight", "shared_head.head.weight")):
            want = torch.full_like(held, PAD_FILL)
            per = _pad64(cfg.vocab_size) // tp
            real = hf[name][rank * per : (rank + 1) * per]
            want[: real.shape[0]] = real
        elif name.endswith(".qkv_proj.weight"):
            kv = cfg.num_key_value_heads
            k_part = rank // max(1, tp // kv)
            kv_parts = min(tp, kv)
            want = torch.cat([
                part(hf[pre + "q_proj.weight"], 0, tp, rank),
                part(hf[pre + "k_proj.weight"], 0, kv_parts, k_part),
                part(hf[pre + "v_proj.weight"], 0, kv_parts, k_part),
            ])  # fmt: skip
        elif name.endswith(".gate_up_proj.weight"):
            want = gate_up(hf[pre + "gate_proj.weight"], hf[pre + "up_proj.weight"], tp, rank)
        elif name.endswith((".o_proj.weight", ".down_proj.weight")):
            want = part(hf[name], 1, tp, rank)
        elif name.endswith((".q_b_proj.weight", ".kv_b_proj.weight")):
            want = part(hf[name], 0, tp, rank)
        elif name.endswith(("fused_qkv_a_proj.weight", "fused_qkv_a_proj_with_mqa.weight")):
            want = torch.cat([hf[pre + "q_a_proj.weight"], hf[pre + "kv_a_proj_with_mqa.weight"]])
        elif name.endswith((".w13_weight", ".w2_weight")):
            local = held.shape[0]
            experts = range(rank // mt * local, (rank // mt + 1) * local)
            pre = name[: name.index(".mlp.") + 5] + "experts."  # the HF fused experts
            if name.endswith(".w13_weight"):
                gu = hf[pre + "gate_up_proj"]
                ffn = gu.shape[1] // 2
                pairs = [(gu[e, :ffn], gu[e, ffn:]) for e in experts]
                want = torch.stack([gate_up(g, u, mt, rank % mt) for g, u in pairs])
            else:
                dn = hf[pre + "down_proj"]
                want = torch.stack([part(dn[e], 1, mt, rank % mt) for e in experts])
        else:  # replicated: norms, routers, router bias
            want = hf[name]
        out[name] = want
    return out


def fill_from(src: dict[str, torch.Tensor], eng: EngineModel, lays: list[EngineLayout]) -> None:
    """Write every engine registration from its boxes in the trainer's global tensors; each
    box must name a trainer tensor of the registration's global shape."""
    for r, lay in enumerate(lays):
        for key, p in engine_placements(eng.ranks[r], lay).items():
            assert p.canonical in src, (r, key, p.canonical)
            assert tuple(p.global_shape) == tuple(src[p.canonical].shape), (r, key)
            for b in p.boxes:
                glob = tuple(slice(o, o + n) for o, n in zip(b.offset, b.shape, strict=True))
                loc = tuple(slice(o, o + n) for o, n in zip(b.local_offset, b.shape, strict=True))
                p.tensor[loc] = src[p.canonical][glob]
