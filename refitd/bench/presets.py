"""Preset models and Megatron rank layouts for `refitd bench plan` (and tests).

Tensors use Megatron-Core names (`decoder.layers.{i}....`), BF16 except the router's FP32
expert_bias. Ranks follow Megatron's default order: dense tp fastest, then dp, then pp;
experts etp fastest, then ep, then expert-dp, then pp. PP splits layers evenly, the first
stages taking one more when it does not divide.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from refitd.plan.errors import PlanError
from refitd.plan.layout import TensorSpec
from refitd.plan.layouts import Layout, check_layout, megatron_layout

BF16 = "bfloat16"
FP32 = "float32"
REP = ("rep", -1, 1)  # replicated over TP


@dataclass(frozen=True, slots=True)
class TensorDef:
    """One tensor of a layer (or of the model): name suffix, global shape, dtype, and how
    it is sharded: ("rep"), ("tp", dim, stride) or ("etp", dim, stride) for experts."""

    name: str
    shape: tuple[int, ...]
    dtype: str = BF16
    shard: tuple[str, int, int] = REP


@dataclass(frozen=True, slots=True)
class Preset:
    name: str
    layers: int
    num_experts: int
    head: tuple[TensorDef, ...]  # first stage
    tail: tuple[TensorDef, ...]  # last stage
    dense_layer: tuple[TensorDef, ...]
    moe_layer: tuple[TensorDef, ...]
    expert: tuple[TensorDef, ...]  # per expert; name gets the expert index appended
    first_dense: int  # layers [0, first_dense) use dense_layer when the model has experts
    total_bytes: int

    def layer_defs(self, i: int) -> tuple[TensorDef, ...]:
        return self.dense_layer if not self.num_experts or i < self.first_dense else self.moe_layer

    def nbytes(self) -> int:
        """Bytes of the whole model (every tensor once)."""
        size = {BF16: 2, FP32: 4}
        total = sum(_numel(t.shape) * size[t.dtype] for t in (*self.head, *self.tail))
        for i in range(self.layers):
            total += sum(_numel(t.shape) * size[t.dtype] for t in self.layer_defs(i))
            if self.num_experts and i >= self.first_dense:
                total += self.num_experts * sum(
                    _numel(t.shape) * size[t.dtype] for t in self.expert
                )
        return total


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _gpt_attention(h: int, heads: int, kv: int, hd: int) -> tuple[TensorDef, ...]:
    return (
        TensorDef("self_attention.linear_qkv.layer_norm_weight", (h,)),
        TensorDef(
            "self_attention.linear_qkv.weight", ((heads + 2 * kv) * hd, h), shard=("tp", 0, 1)
        ),
        TensorDef("self_attention.linear_proj.weight", (h, heads * hd), shard=("tp", 1, 1)),
    )


def _dense_mlp(h: int, ffn: int) -> tuple[TensorDef, ...]:
    return (
        TensorDef("mlp.linear_fc1.layer_norm_weight", (h,)),
        TensorDef("mlp.linear_fc1.weight", (2 * ffn, h), shard=("tp", 0, 2)),
        TensorDef("mlp.linear_fc2.weight", (h, ffn), shard=("tp", 1, 1)),
    )


def _ends(h: int, vocab: int) -> tuple[tuple[TensorDef, ...], tuple[TensorDef, ...]]:
    head = (TensorDef("embedding.word_embeddings.weight", (vocab, h), shard=("tp", 0, 1)),)
    tail = (
        TensorDef("decoder.final_layernorm.weight", (h,)),
        TensorDef("output_layer.weight", (vocab, h), shard=("tp", 0, 1)),
    )
    return head, tail


def _llama(
    name: str, layers: int, h: int, heads: int, kv: int, ffn: int, vocab: int, total: int
) -> Preset:
    head, tail = _ends(h, vocab)
    dense = (*_gpt_attention(h, heads, kv, 128), *_dense_mlp(h, ffn))
    return Preset(name, layers, 0, head, tail, dense, (), (), layers, total)


def _kimi() -> Preset:
    h, heads, q_lora, kv_lora, rope, nope, v = 7168, 64, 1536, 512, 64, 128, 128
    experts, eff = 384, 2048
    head, tail = _ends(h, 163840)
    mla = (
        TensorDef("input_layernorm.weight", (h,)),
        TensorDef("self_attention.linear_q_down_proj.weight", (q_lora, h)),
        TensorDef("self_attention.linear_kv_down_proj.weight", (kv_lora + rope, h)),
        TensorDef("self_attention.linear_q_up_proj.layer_norm_weight", (q_lora,)),
        TensorDef(
            "self_attention.linear_q_up_proj.weight",
            (heads * (nope + rope), q_lora),
            shard=("tp", 0, 1),
        ),
        TensorDef("self_attention.linear_kv_up_proj.layer_norm_weight", (kv_lora,)),
        TensorDef(
            "self_attention.linear_kv_up_proj.weight",
            (heads * (nope + v), kv_lora),
            shard=("tp", 0, 1),
        ),
        TensorDef("self_attention.linear_proj.weight", (h, heads * v), shard=("tp", 1, 1)),
    )
    moe = (
        *mla,
        TensorDef("pre_mlp_layernorm.weight", (h,)),
        TensorDef("mlp.router.weight", (experts, h)),
        TensorDef("mlp.router.expert_bias", (experts,), FP32),
        TensorDef("mlp.shared_experts.linear_fc1.weight", (2 * eff, h), shard=("tp", 0, 2)),
        TensorDef("mlp.shared_experts.linear_fc2.weight", (h, eff), shard=("tp", 1, 1)),
    )
    expert = (
        TensorDef("mlp.experts.linear_fc1.weight", (2 * eff, h), shard=("etp", 0, 2)),
        TensorDef("mlp.experts.linear_fc2.weight", (h, eff), shard=("etp", 1, 1)),
    )
    dense = (*mla, *_dense_mlp(h, 18432))
    return Preset("kimi-k2", 61, experts, head, tail, dense, moe, expert, 1, 2_052_816_510_976)


def preset(name: str) -> Preset:
    """A preset by name: llama3-8b, llama3-70b, kimi-k2."""
    if name == "llama3-8b":
        return _llama(name, 32, 4096, 32, 8, 14336, 128256, 16_060_522_496)
    if name == "llama3-70b":
        return _llama(name, 80, 8192, 64, 8, 28672, 128256, 141_107_412_992)
    if name == "kimi-k2":
        return _kimi()
    raise PlanError(f"unknown preset {name!r}; known: llama3-8b, llama3-70b, kimi-k2")


PRESETS = ("llama3-8b", "llama3-70b", "kimi-k2")


@dataclass(frozen=True, slots=True)
class Parallel:
    """Megatron parallel sizes of one side; dp and expert-dp derive from the world size."""

    world: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1

    @classmethod
    def parse(cls, text: str, world: int) -> Parallel:
        """From 'tp=8,pp=8,ep=32'."""
        kw: dict[str, int] = {}
        for item in filter(None, text.split(",")):
            k, _, v = item.partition("=")
            if k.strip() not in ("tp", "pp", "ep", "etp"):
                raise PlanError(f"unknown layout key {k!r} in {text!r}; known tp, pp, ep, etp")
            kw[k.strip()] = int(v)
        p = cls(world, **kw)
        if world % (p.tp * p.pp) or world % (p.etp * p.ep * p.pp):
            raise PlanError(f"world {world} not divisible by layout {text!r}")
        return p

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @property
    def edp(self) -> int:
        return self.world // (self.etp * self.ep * self.pp)

    def stage_layers(self, layers: int, stage: int) -> range:
        base, extra = divmod(layers, self.pp)
        start = stage * base + min(stage, extra)
        return range(start, start + base + (1 if stage < extra else 0))


def build_specs(
    p: Preset,
    par: Parallel,
    model: str,
    pool: str,
    slot_base: int,
    ranks: Iterable[int] | None = None,
) -> list[TensorSpec]:
    """Every registered tensor of every rank of one side (rank r on slot slot_base + r), or
    of `ranks` only."""
    layouts: dict[tuple, Layout] = {}
    out: list[TensorSpec] = []
    for rank in range(par.world) if ranks is None else ranks:
        out.extend(_rank_specs(p, par, model, pool, rank, slot_base + rank, layouts))
    return out


def _layout(t: TensorDef, tp_rank: int, tp: int, cache: dict[tuple, Layout]) -> Layout:
    kind, dim, stride = t.shard
    key = (t.shape, t.shard, tp_rank, tp)
    lay = cache.get(key)
    if lay is None:
        label = f"preset tensor {t.name!r}"
        if kind == "rep":
            lay = megatron_layout(t.shape, label=label)
        else:
            lay = megatron_layout(
                t.shape,
                tp_rank=tp_rank,
                tp_size=tp,
                partition_dim=dim,
                partition_stride=stride,
                label=label,
            )
        check_layout(t.shape, lay, label)
        cache[key] = lay
    return lay


def _rank_specs(
    p: Preset,
    par: Parallel,
    model: str,
    pool: str,
    rank: int,
    slot: int,
    cache: dict[tuple, Layout],
) -> Iterator[TensorSpec]:
    for t, name, canonical, r, size in rank_tensors(p, par, rank):
        lay = _layout(t, r, size, cache)
        yield TensorSpec(
            model, pool, rank, slot, name, canonical, t.shape, t.dtype, lay.local_shape, lay.boxes
        )


def rank_tensors(
    p: Preset, par: Parallel, rank: int
) -> Iterator[tuple[TensorDef, str, str, int, int]]:
    """(tensor, local name, canonical name, shard rank, shard count) of every tensor rank
    `rank` holds: its stage's layers under local indices, its experts under local numbers;
    the shard rank and count are over TP, or over expert TP for experts."""
    tp_rank = rank % par.tp
    stage = rank // (par.tp * par.dp)
    etp_rank = rank % par.etp
    ep_rank = (rank // par.etp) % par.ep
    local_experts = p.num_experts // par.ep if p.num_experts else 0
    if stage == 0:
        for t in p.head:
            yield t, t.name, t.name, tp_rank, par.tp
    layers = par.stage_layers(p.layers, stage)
    for local, g in enumerate(layers):
        lp, gp = f"decoder.layers.{local}.", f"decoder.layers.{g}."
        for t in p.layer_defs(g):
            yield t, lp + t.name, gp + t.name, tp_rank, par.tp
        if p.num_experts and g >= p.first_dense:
            for k in range(local_experts):
                ge = ep_rank * local_experts + k
                for t in p.expert:
                    yield t, f"{lp}{t.name}{k}", f"{gp}{t.name}{ge}", etp_rank, par.etp
    if stage == par.pp - 1:
        for t in p.tail:
            yield t, t.name, t.name, tp_rank, par.tp
