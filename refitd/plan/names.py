"""Canonical names and name maps.

A canonical name matches the same weight across layouts: global layer index under PP,
global expert index under EP. A NameMap turns a destination framework's canonical names
into slices of the source's canonical tensors (rename; split or concat along a dim, e.g.
Megatron's fused QKV into HF q/k/v, gated fc1 into gate/up), applied by the planner so
no tensor is ever gathered whole.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from refitd.plan.errors import PlanError
from refitd.plan.layout import Box

_LAYER = re.compile(r"(^|\.)layers\.(\d+)(?=\.)")
_EXPERT = re.compile(r"(\.experts\..*\.(?:weight|bias))(\d+)$")

TIED_OUTPUT = "output_layer.weight"
TIED_EMBEDDING = "embedding.word_embeddings.weight"


def global_layer_name(name: str, layer_offset: int) -> str:
    """Rewrite the first `layers.<i>.` of a local PP name to `layers.<i + offset>.`."""
    if not layer_offset:
        return name
    return _LAYER.sub(lambda m: f"{m.group(1)}layers.{int(m.group(2)) + layer_offset}", name, 1)


def global_expert_name(name: str, expert_offset: int) -> str:
    """Rewrite a per-expert `...experts....weightK`/`biasK` to global expert K + offset."""
    if not expert_offset:
        return name
    return _EXPERT.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + expert_offset}", name, 1)


def canonical_name(name: str, layer_offset: int = 0, expert_offset: int = 0) -> str:
    """The canonical name of a local tensor name under PP and EP."""
    return global_expert_name(global_layer_name(name, layer_offset), expert_offset)


@dataclass(frozen=True, slots=True)
class Part:
    """Rows [start, start + length) along the rule's dim of source canonical `source`."""

    source: str
    start: int
    length: int


@dataclass(frozen=True, slots=True)
class NameRule:
    """Destination canonical `dst` is the concatenation along `dim` of `parts`; every
    other dim equals the source's. One whole part with dim 0 is a plain rename.

    `padding` declares rows after the parts (along dim) that exist only at the destination,
    e.g. a vocabulary padded to a multiple of 64 by the inference engine: the planner never
    writes them and does not count them as holes.
    """

    dst: str
    dim: int
    parts: tuple[Part, ...]
    padding: int = 0

    @property
    def covered(self) -> int:
        """Rows of the destination along dim named by the rule: parts plus padding."""
        return sum(p.length for p in self.parts) + self.padding


@dataclass(frozen=True, slots=True)
class Link:
    """Destination rows [dst_start, +length) along dim come from source rows
    [src_start, +length); dim -1 means the whole tensor, unchanged."""

    dst: str
    src: str
    dim: int = -1
    dst_start: int = 0
    src_start: int = 0
    length: int = 0


@dataclass(frozen=True, slots=True)
class NameMap:
    """Rules by destination canonical name; names without a rule map to themselves."""

    rules: tuple[NameRule, ...]

    def index(self) -> dict[str, NameRule]:
        """The rules by destination name (a duplicate destination is an error)."""
        out: dict[str, NameRule] = {}
        for r in self.rules:
            if r.dst in out:
                raise PlanError(f"name map has two rules for destination {r.dst!r}")
            out[r.dst] = r
        return out

    @staticmethod
    def links(rule: NameRule) -> list[Link]:
        """The rule as links (one per part) in destination coordinates."""
        out = []
        at = 0
        for p in rule.parts:
            out.append(Link(rule.dst, p.source, rule.dim, at, p.start, p.length))
            at += p.length
        return out

    @classmethod
    def concat(cls, *maps: NameMap) -> NameMap:
        return cls(tuple(r for m in maps for r in m.rules))


def rename(dst: str, src: str, size0: int, padding: int = 0) -> NameRule:
    """dst is src under another name (size0 = the length of dim 0); `padding` rows follow
    at the destination only (declared padding, never written)."""
    return NameRule(dst, 0, (Part(src, 0, size0),), padding)


def split_gated_fc1(src: str, gate: str, up: str, ffn: int) -> list[NameRule]:
    """Megatron gated fc1 [2*ffn, ...] = [gate; up] into two destinations."""
    return [NameRule(gate, 0, (Part(src, 0, ffn),)), NameRule(up, 0, (Part(src, ffn, ffn),))]


def split_fused_qkv(
    src: str, q: str, k: str, v: str, num_heads: int, num_kv_heads: int, head_dim: int
) -> list[NameRule]:
    """Megatron fused QKV, grouped per KV head as [q heads of the group, k, v] along
    dim 0, into q/k/v destinations (each the concatenation over KV groups)."""
    if num_heads % num_kv_heads:
        raise PlanError(f"{src}: {num_heads} heads not divisible by {num_kv_heads} KV heads")
    qpg = num_heads // num_kv_heads
    group = (qpg + 2) * head_dim
    qs, ks, vs = [], [], []
    for g in range(num_kv_heads):
        base = g * group
        qs.append(Part(src, base, qpg * head_dim))
        ks.append(Part(src, base + qpg * head_dim, head_dim))
        vs.append(Part(src, base + (qpg + 1) * head_dim, head_dim))
    return [NameRule(q, 0, tuple(qs)), NameRule(k, 0, tuple(ks)), NameRule(v, 0, tuple(vs))]


def resolve_links(
    dst_names: Iterable[str],
    src_names: Sequence[str] | set[str] | dict[str, int],
    name_map: NameMap | None,
    tie_embeddings: bool,
) -> list[Link]:
    """One or more links per destination canonical name; an unknown name links to itself
    (the planner reports it missing)."""
    rules = name_map.index() if name_map is not None else {}
    out: list[Link] = []
    for d in dst_names:
        rule = rules.get(d)
        if rule is not None:
            out.extend(NameMap.links(rule))
        elif d in src_names:
            out.append(Link(d, d))
        elif (
            tie_embeddings
            and d.endswith(TIED_OUTPUT)
            and (tied := d[: -len(TIED_OUTPUT)] + TIED_EMBEDDING) in src_names
        ):
            out.append(Link(d, tied))
        else:
            out.append(Link(d, d))
    return out


def source_boxes(rules: Mapping[str, NameRule], canonical: str, box: Box) -> list[tuple[str, Box]]:
    """A box of destination canonical `canonical` as boxes of the source canonicals its
    rule reads (same local offsets): what a worker registers when the controller plans
    without the name map. Rows in the rule's declared padding map to nothing (never
    written); rows past the parts and the padding are an error naming the tensor."""
    rule = rules.get(canonical)
    if rule is None:
        return [(canonical, box)]
    d = rule.dim
    if not 0 <= d < len(box.offset):
        raise PlanError(f"name map rule of {canonical!r} splits dim {d}; box {box} has fewer")
    lo, hi = box.offset[d], box.offset[d] + box.shape[d]
    if hi > rule.covered:
        raise PlanError(
            f"box rows [{lo}, {hi}) of dim {d} of {canonical!r} lie past the name map's parts "
            f"and padding ({rule.covered} rows)"
        )
    out: list[tuple[str, Box]] = []
    at = 0
    for p in rule.parts:
        a, b = max(lo, at), min(hi, at + p.length)
        if a < b:
            off, shp, loc = list(box.offset), list(box.shape), list(box.local_offset)
            off[d], shp[d], loc[d] = p.start + a - at, b - a, box.local_offset[d] + a - lo
            out.append((p.source, Box(tuple(off), tuple(shp), tuple(loc))))
        at += p.length
    return out
