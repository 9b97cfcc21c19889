"""Read a Megatron-Core module the way Megatron annotates it and turn it into registrations.

Megatron marks each parameter with `tensor_model_parallel`, `partition_dim`,
`partition_stride` (and sometimes `partition_sizes`); expert parameters carry
`allreduce = False` and are split over expert-TP instead of TP. Layer modules carry
`layer_number`, 1-based and global (the pipeline offset already added), and per-expert
weights are named `...experts.linear_fc1.weight{K}` (grouped GEMM) or
`...experts.local_experts.{K}.linear_fc1.weight` (sequential MLP) with K local to the
EP rank. This module reads all of that, derives global shapes, boxes and canonical names
(global layer index, global expert index, one expert naming), and hands the result to
`TrainerClient.register` as `Placed` tensors: the boxes come from refitd.plan.layouts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from refitd.client import MegatronCoords, Placed
from refitd.client.tensors import megatron_placement
from refitd.client.worker import Registration, WorkerClient
from refitd.plan.errors import PlanError
from refitd.plan.layouts import check_layout

_LAYER = re.compile(r"^(?P<prefix>(?:.*\.)?layers)\.(?P<index>\d+)\.(?P<rest>.+)$")
_GROUPED_EXPERT = re.compile(r"^(?P<head>.*\.experts\..*\.(?:weight|bias))(?P<k>\d+)$")
_SEQUENTIAL_EXPERT = re.compile(
    r"^(?P<head>.*\.experts)\.local_experts\.(?P<k>\d+)\.(?P<tail>.*\.(?:weight|bias))$"
)


@dataclass(frozen=True, slots=True)
class ParallelState:
    """This rank's coordinates in Megatron's process groups (megatron.core.parallel_state
    is not a dependency: pass the ranks and sizes you get from it)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1

    def __post_init__(self) -> None:
        for group in ("tp", "pp", "ep", "etp"):
            rank, size = getattr(self, f"{group}_rank"), getattr(self, f"{group}_size")
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"{group}_rank {rank} outside a {group} group of size {size}")


def megatron_tensors(module: torch.nn.Module, state: ParallelState) -> dict[str, Placed]:
    """Parameters and persistent buffers of a Megatron module as Placed tensors.

    Keys are the module's local names; each Placed carries the global shape, the boxes of
    this rank's shard and the canonical name shared with every other layout.
    """
    tensors = _named_tensors(module)
    if not tensors:
        raise ValueError("the module has no parameters or persistent buffers to register")
    layer_numbers = _layer_numbers(module, state)
    local_experts = _local_expert_counts(tensors)
    out: dict[str, Placed] = {}
    for name, t in tensors.items():
        where = f"tensor {name!r} (tp {state.tp_rank}, pp {state.pp_rank}, ep {state.ep_rank})"
        canonical = canonical_megatron_name(name, layer_numbers, local_experts, state, where)
        out[name] = _placed(t, canonical, state, where)
    return out


def register_megatron(
    client: WorkerClient, module: torch.nn.Module, state: ParallelState
) -> Registration:
    """Register a Megatron module's shards with a TrainerClient (or InferenceClient)."""
    return client.register(megatron_tensors(module, state))


def _named_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters, then persistent buffers (non-persistent ones never leave the rank)."""
    out: dict[str, torch.Tensor] = dict(module.named_parameters())
    skip = {
        f"{prefix}.{n}" if prefix else n
        for prefix, mod in module.named_modules()
        for n in getattr(mod, "_non_persistent_buffers_set", ())
    }
    out.update({n: b for n, b in module.named_buffers() if n not in skip})
    return out


def _layer_numbers(module: torch.nn.Module, state: ParallelState) -> dict[str, int]:
    """Global 0-based layer index by layer-module path (`decoder.layers.3` -> 7)."""
    out: dict[str, int] = {}
    owner: dict[tuple[str, int], str] = {}
    for path, mod in module.named_modules():
        m = re.match(r"^(?:.*\.)?layers\.\d+$", path)
        if not m:
            continue
        number = getattr(mod, "layer_number", None)
        if number is None:
            if state.pp_size > 1:
                raise PlanError(
                    f"layer module {path!r} has no layer_number attribute: under pipeline "
                    f"parallelism (pp_size {state.pp_size}) the global layer index cannot be "
                    "derived from the local one"
                )
            number = int(path.rsplit(".", 1)[1]) + 1
        if int(number) < 1:
            raise PlanError(f"layer module {path!r}: layer_number {number} must be >= 1")
        key = (path.rsplit(".", 1)[0], int(number))
        if key in owner:
            raise PlanError(
                f"layer modules {owner[key]!r} and {path!r} both claim layer_number {number}"
            )
        owner[key] = path
        out[path] = int(number) - 1
    return out


def _local_expert_counts(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """Local experts per experts module (`decoder.layers.1.mlp.experts` -> 4)."""
    seen: dict[str, set[int]] = {}
    for name in tensors:
        m = _GROUPED_EXPERT.match(name)
        if m:
            seen.setdefault(_experts_module(m["head"]), set()).add(int(m["k"]))
            continue
        m = _SEQUENTIAL_EXPERT.match(name)
        if m:
            seen.setdefault(m["head"], set()).add(int(m["k"]))
    out = {}
    for mod, ks in seen.items():
        if ks != set(range(len(ks))):
            raise PlanError(f"{mod}: local expert indices {sorted(ks)} are not 0..{len(ks) - 1}")
        out[mod] = len(ks)
    return out


def _experts_module(head: str) -> str:
    return head[: head.index(".experts.") + len(".experts")]


def canonical_megatron_name(
    name: str,
    layer_numbers: dict[str, int],
    local_experts: dict[str, int],
    state: ParallelState,
    where: str = "",
) -> str:
    """Global layer index, global expert index, and experts always as `...weight{E}`."""
    m = _SEQUENTIAL_EXPERT.match(name)
    if m:
        k = int(m["k"]) + state.ep_rank * local_experts[m["head"]]
        name = f"{m['head']}.{m['tail']}{k}"
    else:
        m = _GROUPED_EXPERT.match(name)
        if m:
            k = int(m["k"]) + state.ep_rank * local_experts[_experts_module(m["head"])]
            name = f"{m['head']}{k}"
    m = _LAYER.match(name)
    if m:
        path = f"{m['prefix']}.{m['index']}"
        if path not in layer_numbers:
            raise PlanError(f"{where}: no layer module at {path!r}")
        name = f"{m['prefix']}.{layer_numbers[path]}.{m['rest']}"
    return name


def _placed(t: torch.Tensor, canonical: str, state: ParallelState, where: str) -> Placed:
    coords = MegatronCoords(
        tp_rank=state.tp_rank,
        tp_size=state.tp_size,
        etp_rank=state.etp_rank,
        etp_size=state.etp_size,
    )
    gshape, layout = megatron_placement(t, coords, where)
    check_layout(gshape, layout, where)
    # The parameter itself: registration moves its storage in place, so the module keeps
    # training on the registered memory.
    return Placed(t, gshape, layout.boxes, canonical=canonical)
