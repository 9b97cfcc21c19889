"""What a vLLM or SGLang model runner allocates per rank, as boxes of HF canonical tensors.

Engines do not hold HF tensors. Per tensor-parallel rank they hold (vLLM's and SGLang's
model runners allocate the same shapes; their weight loaders fill them):
- `qkv_proj` (QKVParallelLinear): the rank's q heads, then its k heads, then its v heads.
  With TP above the KV head count each KV head is replicated on TP / num_kv_heads ranks
  (rank r holds KV head r // replicas);
- `gate_up_proj` (MergedColumnParallelLinear): the rank's gate rows, then its up rows;
  `o_proj` / `down_proj` (RowParallelLinear): the rank's columns;
- routed experts (FusedMoE): `w13_weight` [local experts, 2 * ffn / moe_tp, hidden] (gate
  rows then up rows) and `w2_weight` [local experts, hidden, ffn / moe_tp], experts split
  contiguously by EP (rank e of EP holds experts e*E/ep ...), the ffn split by the MoE TP
  (tp / ep). vLLM holds them in FusedMoE's `routed_experts` submodule
  (`mlp.experts.routed_experts.w13_weight`), SGLang on FusedMoE itself
  (`mlp.experts.w13_weight`); the router (`mlp.gate`) and shared experts
  (`mlp.shared_experts`) keep their HF names in both;
- `embed_tokens` / `lm_head` (VocabParallelEmbedding / ParallelLMHead): the vocabulary padded
  to a multiple of `padding` (64) and split evenly over TP; rows past the real vocabulary
  exist only in the engine (declared padding in the name map, never written);
- MLA: `fused_qkv_a_proj` (vLLM) / `fused_qkv_a_proj_with_mqa` (SGLang): q_a_proj rows then
  kv_a_proj_with_mqa rows, replicated; q_b_proj / kv_b_proj split by heads.

The pieces name the HF checkpoint tensors (per expert `mlp.experts.{e}.{gate,up,down}_proj
.weight`), and the layout's name map reads them from the trainer's own names
(`source_naming`, one of SOURCE_NAMINGS):
- "megatron": a Megatron-Core trainer; the map is the Megatron -> HF map (clients.hf_names);
- "hf": a trainer holding a transformers model (FSDP2, DDP, plain): its parameter names are
  the pieces' names, except that transformers fuses routed experts into 3-D
  `mlp.experts.gate_up_proj` [E, 2 * ffn, hidden] and `mlp.experts.down_proj`
  [E, hidden, ffn], which expert pieces then read as slices (`Piece.index`);
- "hf-checkpoint": HF checkpoint names, per-expert experts as well (what transformers
  modules before version 5 hold, and clients.hf_names.hf_checkpoint_tensors).
In every naming the embedding and output rules declare the padded rows, so the engine's
padded global shape reads the trainer's unpadded tensor. Pure Python: the torch side is
clients.engine_layouts.register.
"""

from __future__ import annotations

from dataclasses import dataclass

from clients.hf_names.maps import (
    DeepseekV3Dims,
    LlamaDims,
    deepseek_v3_name_map,
    llama_name_map,
)
from refitd.plan.errors import PlanError
from refitd.plan.names import NameMap, NameRule, rename

ENGINES = ("vllm", "sglang")
SOURCE_NAMINGS = ("megatron", "hf", "hf-checkpoint")
VOCAB_PADDING = 64  # vLLM's and SGLang's DEFAULT_VOCAB_PADDING_SIZE


@dataclass(frozen=True, slots=True)
class EngineParallel:
    """One engine rank: its TP coordinates and the expert parallel size (experts are
    split over `ep_size` ranks of the TP group, the expert ffn over tp_size / ep_size)."""

    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise PlanError(f"engine tp_rank {self.tp_rank} outside 0..{self.tp_size - 1}")
        if self.ep_size < 1 or self.tp_size % self.ep_size:
            raise PlanError(f"engine ep_size {self.ep_size} does not divide tp {self.tp_size}")

    @property
    def moe_tp(self) -> int:
        return self.tp_size // self.ep_size

    @property
    def ep_rank(self) -> int:
        return self.tp_rank // self.moe_tp

    @property
    def moe_tp_rank(self) -> int:
        return self.tp_rank % self.moe_tp


@dataclass(frozen=True, slots=True)
class Piece:
    """Rows [start, start + length) along `dim` of canonical `canonical` (global shape
    `global_shape`), held at `local` along dim in the engine tensor; other dims whole.
    With `index`, the canonical is stacked (transformers' fused experts): the piece lies in
    its slice [index] along dim 0, and dim counts the slice's dims."""

    canonical: str
    global_shape: tuple[int, ...]
    dim: int
    start: int
    length: int
    local: int
    index: int | None = None


@dataclass(frozen=True, slots=True)
class EngineTensor:
    """One engine parameter (or, with `index`, one expert's slice `param[index]` of a
    stacked expert parameter) of `local_shape`, made of pieces of canonical tensors."""

    name: str
    local_shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    index: int | None = None

    @property
    def key(self) -> str:
        """The registration name: the parameter name, `[e]` for an expert slice."""
        return self.name if self.index is None else f"{self.name}[{self.index}]"


@dataclass(frozen=True, slots=True)
class EngineLayout:
    """A rank's engine tensors and the name map that reads them from the trainer's
    canonicals (named as `source_naming` says)."""

    tensors: tuple[EngineTensor, ...]
    name_map: NameMap
    source_naming: str = "megatron"

    def by_key(self) -> dict[str, EngineTensor]:
        return {t.key: t for t in self.tensors}


def padded_vocab(vocab: int, padding: int = VOCAB_PADDING) -> int:
    """The vocabulary rounded up to a multiple of `padding` (vLLM's pad_vocab_size)."""
    return -(-vocab // padding) * padding


def _whole(name: str, shape: tuple[int, ...], canonical: str | None = None) -> EngineTensor:
    """A replicated tensor: the whole canonical tensor (same name by default)."""
    return EngineTensor(name, shape, (Piece(canonical or name, shape, 0, 0, shape[0], 0),))


def _split(
    name: str, gshape: tuple[int, ...], dim: int, parts: int, rank: int, canonical: str = ""
) -> EngineTensor:
    """Column/row parallel: rank's even share of dim."""
    if gshape[dim] % parts:
        raise PlanError(f"{name}: dim {dim} of {gshape} does not split over {parts} ranks")
    n = gshape[dim] // parts
    local = tuple(n if d == dim else s for d, s in enumerate(gshape))
    return EngineTensor(name, local, (Piece(canonical or name, gshape, dim, rank * n, n, 0),))


def _fused(
    name: str, trailing: tuple[int, ...], specs: list[tuple[str, int, int, int]]
) -> EngineTensor:
    """Fused rows: (canonical, canonical rows, start, length) laid end to end along dim 0."""
    pieces, at = [], 0
    for canonical, rows, start, length in specs:
        pieces.append(Piece(canonical, (rows, *trailing), 0, start, length, at))
        at += length
    return EngineTensor(name, (at, *trailing), tuple(pieces))


def qkv_proj(prefix: str, d: LlamaDims, p: EngineParallel, bias: bool = False) -> EngineTensor:
    """QKVParallelLinear of one rank: its q heads, then its KV heads' k, then v."""
    t, kv = p.tp_size, d.kv_heads
    if d.heads % t:
        raise PlanError(f"{prefix}: {d.heads} attention heads do not split over TP {t}")
    if (t >= kv and t % kv) or (t < kv and kv % t):
        raise PlanError(f"{prefix}: {kv} KV heads and TP {t}: neither divides the other")
    q_rows = d.heads // t * d.head_dim
    kv_per_rank = max(1, kv // t)
    kv_rows = kv_per_rank * d.head_dim
    kv_index = p.tp_rank // max(1, t // kv)  # the KV head group this rank holds
    suffix = "bias" if bias else "weight"
    trailing = () if bias else (d.hidden,)
    return _fused(
        f"{prefix}.qkv_proj.{suffix}",
        trailing,
        [
            (f"{prefix}.q_proj.{suffix}", d.heads * d.head_dim, p.tp_rank * q_rows, q_rows),
            (f"{prefix}.k_proj.{suffix}", kv * d.head_dim, kv_index * kv_rows, kv_rows),
            (f"{prefix}.v_proj.{suffix}", kv * d.head_dim, kv_index * kv_rows, kv_rows),
        ],
    )


def gate_up_proj(prefix: str, hidden: int, ffn: int, parts: int, rank: int) -> EngineTensor:
    """MergedColumnParallelLinear [gate; up]: the rank's gate rows, then its up rows."""
    if ffn % parts:
        raise PlanError(f"{prefix}: ffn {ffn} does not split over {parts} ranks")
    n = ffn // parts
    return _fused(
        f"{prefix}.gate_up_proj.weight",
        (hidden,),
        [
            (f"{prefix}.gate_proj.weight", ffn, rank * n, n),
            (f"{prefix}.up_proj.weight", ffn, rank * n, n),
        ],
    )


def _mlp(prefix: str, hidden: int, ffn: int, p: EngineParallel) -> list[EngineTensor]:
    return [
        gate_up_proj(prefix, hidden, ffn, p.tp_size, p.tp_rank),
        _split(f"{prefix}.down_proj.weight", (hidden, ffn), 1, p.tp_size, p.tp_rank),
    ]


def routed_experts_module(engine: str) -> str:
    """Where FusedMoE holds `w13_weight` / `w2_weight` under a MoE block: vLLM in its
    `routed_experts` submodule, SGLang on FusedMoE itself."""
    return {"vllm": "experts.routed_experts", "sglang": "experts"}[_engine(engine)]


def routed_experts(
    prefix: str,
    experts: int,
    hidden: int,
    ffn: int,
    p: EngineParallel,
    fused: bool = False,
    engine: str = "vllm",
) -> list[EngineTensor]:
    """FusedMoE `w13_weight` / `w2_weight` of `engine`, one EngineTensor per local expert
    slice. fused: the pieces read transformers' stacked `experts.gate_up_proj` /
    `down_proj`."""
    if experts % p.ep_size:
        raise PlanError(f"{prefix}: {experts} experts do not split over EP {p.ep_size}")
    local = experts // p.ep_size
    held = f"{prefix}.{routed_experts_module(engine)}"
    out: list[EngineTensor] = []
    for k in range(local):
        e = p.ep_rank * local + k
        hf = f"{prefix}.experts.{e}"
        w13 = gate_up_proj(hf, hidden, ffn, p.moe_tp, p.moe_tp_rank)
        w2 = _split(f"{hf}.down_proj.weight", (hidden, ffn), 1, p.moe_tp, p.moe_tp_rank)
        if fused:
            w13 = _stacked(w13, f"{prefix}.experts", experts, e)
            w2 = _stacked(w2, f"{prefix}.experts", experts, e)
        out.append(EngineTensor(f"{held}.w13_weight", w13.local_shape, w13.pieces, k))
        out.append(EngineTensor(f"{held}.w2_weight", w2.local_shape, w2.pieces, k))
    return out


def _stacked(t: EngineTensor, base: str, experts: int, e: int) -> EngineTensor:
    """Expert e's pieces as slices of transformers' fused experts under `base`: gate rows
    then up rows of `gate_up_proj` [E, 2 * ffn, hidden], `down_proj` [E, hidden, ffn]."""
    pieces = []
    for pc in t.pieces:
        ffn = pc.global_shape[0]
        if pc.canonical.endswith(".down_proj.weight"):
            name, shape, start = f"{base}.down_proj", (experts, *pc.global_shape), pc.start
        else:
            up = pc.canonical.endswith(".up_proj.weight")
            name, shape = f"{base}.gate_up_proj", (experts, 2 * ffn, pc.global_shape[1])
            start = pc.start + (ffn if up else 0)
        pieces.append(Piece(name, shape, pc.dim, start, pc.length, pc.local, e))
    return EngineTensor(t.name, t.local_shape, tuple(pieces))


def _vocab(
    name: str, source: str, vocab: int, hidden: int, p: EngineParallel, padding: int
) -> tuple[EngineTensor, NameRule]:
    padded = padded_vocab(vocab, padding)
    t = _split(name, (padded, hidden), 0, p.tp_size, p.tp_rank)
    return t, rename(name, source, vocab, padding=padded - vocab)


def _ends(
    base: NameMap,
    vocab: int,
    hidden: int,
    tie: bool,
    p: EngineParallel,
    padding: int,
    naming: str,
) -> tuple[list[EngineTensor], NameMap]:
    """Embedding, final norm and (untied) output layer; the map's embedding and output
    rules replaced by their padded versions (from the trainer's names of the two)."""
    if naming == "megatron":
        embed_src, head_src = "embedding.word_embeddings.weight", "output_layer.weight"
    else:
        embed_src, head_src = "model.embed_tokens.weight", "lm_head.weight"
    embed, r_embed = _vocab("model.embed_tokens.weight", embed_src, vocab, hidden, p, padding)
    tensors = [embed, _whole("model.norm.weight", (hidden,))]
    rules = {r.dst: r for r in base.rules}
    rules[r_embed.dst] = r_embed
    if not tie:
        head, r_head = _vocab("lm_head.weight", head_src, vocab, hidden, p, padding)
        tensors.append(head)
        rules[r_head.dst] = r_head
    return tensors, NameMap(tuple(rules.values()))


def llama_engine_layout(
    d: LlamaDims,
    p: EngineParallel,
    engine: str = "vllm",
    padding: int = VOCAB_PADDING,
    source_naming: str = "megatron",
) -> EngineLayout:
    """Llama / Qwen2 / Qwen3 / Qwen3-MoE as a vLLM or SGLang rank holds it (the two name
    these tensors alike). Tied embeddings: the engine's lm_head is embed_tokens itself."""
    _engine(engine)
    base = llama_name_map(d) if _naming(source_naming) == "megatron" else NameMap(())
    tensors, name_map = _ends(base, d.vocab, d.hidden, d.tie_embeddings, p, padding, source_naming)
    fused = source_naming == "hf"
    for i in range(d.layers):
        hf = f"model.layers.{i}"
        attn = f"{hf}.self_attn"
        tensors += [
            _whole(f"{hf}.input_layernorm.weight", (d.hidden,)),
            _whole(f"{hf}.post_attention_layernorm.weight", (d.hidden,)),
            qkv_proj(attn, d, p),
            _split(f"{attn}.o_proj.weight", (d.hidden, d.heads * d.head_dim), 1, p.tp_size,
                   p.tp_rank),
        ]  # fmt: skip
        if d.qkv_bias:
            tensors.append(qkv_proj(attn, d, p, bias=True))
        if d.qk_norm:
            tensors += [
                _whole(f"{attn}.q_norm.weight", (d.head_dim,)),
                _whole(f"{attn}.k_norm.weight", (d.head_dim,)),
            ]
        if d.experts and i not in d.dense_layers:
            tensors.append(_whole(f"{hf}.mlp.gate.weight", (d.experts, d.hidden)))
            tensors += routed_experts(
                f"{hf}.mlp", d.experts, d.hidden, d.expert_ffn, p, fused, engine
            )
        else:
            tensors += _mlp(f"{hf}.mlp", d.hidden, d.ffn, p)
    return EngineLayout(tuple(tensors), name_map, source_naming)


def fused_qkv_a_name(engine: str) -> str:
    """MLA's fused latent projection: vLLM `fused_qkv_a_proj`, SGLang
    `fused_qkv_a_proj_with_mqa`."""
    return {"vllm": "fused_qkv_a_proj", "sglang": "fused_qkv_a_proj_with_mqa"}[_engine(engine)]


def deepseek_v3_layer(
    i: int, d: DeepseekV3Dims, p: EngineParallel, engine: str, fused: bool
) -> list[EngineTensor]:
    """Decoder layer i of DeepSeek-V3 / Kimi-K2 as a vLLM or SGLang rank holds it: MLA, then
    a dense MLP below `first_dense`, routed + shared experts above (fused: the expert
    pieces read transformers' stacked experts)."""
    qk = d.nope + d.rope
    kv_a = d.kv_lora + d.rope
    hf = f"model.layers.{i}"
    attn = f"{hf}.self_attn"
    tensors = [
        _whole(f"{hf}.input_layernorm.weight", (d.hidden,)),
        _whole(f"{hf}.post_attention_layernorm.weight", (d.hidden,)),
        _whole(f"{attn}.kv_a_layernorm.weight", (d.kv_lora,)),
        _split(f"{attn}.kv_b_proj.weight", (d.heads * (d.nope + d.v_head), d.kv_lora), 0,
               p.tp_size, p.tp_rank),
        _split(f"{attn}.o_proj.weight", (d.hidden, d.heads * d.v_head), 1, p.tp_size,
               p.tp_rank),
    ]  # fmt: skip
    if d.q_lora:
        tensors += [
            _fused(f"{attn}.{fused_qkv_a_name(engine)}.weight", (d.hidden,), [
                (f"{attn}.q_a_proj.weight", d.q_lora, 0, d.q_lora),
                (f"{attn}.kv_a_proj_with_mqa.weight", kv_a, 0, kv_a),
            ]),
            _whole(f"{attn}.q_a_layernorm.weight", (d.q_lora,)),
            _split(f"{attn}.q_b_proj.weight", (d.heads * qk, d.q_lora), 0, p.tp_size,
                   p.tp_rank),
        ]  # fmt: skip
    else:
        tensors += [
            _whole(f"{attn}.kv_a_proj_with_mqa.weight", (kv_a, d.hidden)),
            _split(f"{attn}.q_proj.weight", (d.heads * qk, d.hidden), 0, p.tp_size,
                   p.tp_rank),
        ]  # fmt: skip
    if i < d.first_dense:
        return [*tensors, *_mlp(f"{hf}.mlp", d.hidden, d.ffn, p)]
    tensors += [
        _whole(f"{hf}.mlp.gate.weight", (d.experts, d.hidden)),
        _whole(f"{hf}.mlp.gate.e_score_correction_bias", (d.experts,)),
    ]
    if d.shared_experts:
        tensors += _mlp(f"{hf}.mlp.shared_experts", d.hidden,
                        d.expert_ffn * d.shared_experts, p)  # fmt: skip
    tensors += routed_experts(f"{hf}.mlp", d.experts, d.hidden, d.expert_ffn, p, fused, engine)
    return tensors


def deepseek_v3_engine_layout(
    d: DeepseekV3Dims,
    p: EngineParallel,
    engine: str = "vllm",
    padding: int = VOCAB_PADDING,
    source_naming: str = "megatron",
) -> EngineLayout:
    """DeepSeek-V3 / Kimi-K2 (MLA, routed + shared experts) as a vLLM or SGLang rank holds
    it. SGLang derives its absorbed `w_kc`/`w_vc` from kv_b_proj after a load: call the
    model's post-load hook in the engine's resume hook after a refit."""
    _engine(engine)
    base = deepseek_v3_name_map(d) if _naming(source_naming) == "megatron" else NameMap(())
    tensors, name_map = _ends(base, d.vocab, d.hidden, d.tie_embeddings, p, padding, source_naming)
    fused = source_naming == "hf"
    for i in range(d.layers):
        tensors += deepseek_v3_layer(i, d, p, engine, fused)
    return EngineLayout(tuple(tensors), name_map, source_naming)


def engine_layout_for(
    cfg: object,
    p: EngineParallel,
    engine: str = "vllm",
    padding: int = VOCAB_PADDING,
    source_naming: str = "megatron",
) -> EngineLayout:
    """The layout for a transformers config by its model_type, reading a trainer whose
    tensors are named as `source_naming` says ("megatron", "hf", "hf-checkpoint")."""
    kind = getattr(cfg, "model_type", "")
    if kind in ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral"):
        dims = LlamaDims.from_hf_config(cfg)
        return llama_engine_layout(dims, p, engine, padding, source_naming)
    if kind in ("deepseek_v3", "kimi_k2"):
        mla = DeepseekV3Dims.from_hf_config(cfg)
        return deepseek_v3_engine_layout(mla, p, engine, padding, source_naming)
    raise ValueError(f"no engine layout for model_type {kind!r}")


def _engine(engine: str) -> str:
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r}: expected one of {ENGINES}")
    return engine


def _naming(source_naming: str) -> str:
    if source_naming not in SOURCE_NAMINGS:
        raise ValueError(
            f"source_naming {source_naming!r}: expected one of {SOURCE_NAMINGS} (the names "
            "the trainer registers: Megatron-Core's, or a transformers model's)"
        )
    return source_naming
