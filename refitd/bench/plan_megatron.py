"""Megatron-Core's resharding planner as a same-run reference for `refitd bench plan`.

Megatron-Core (megatron.core.resharding, pinned by the bench-megatron extra) plans a refit
centrally: each rank describes its parameters as ParameterMetadata, the lists are gathered,
and one rank walks every destination rank's parameters, picks a source holder for each
(select_src_metadata_balanced), slices it (_determine_source_ranks_for_dst_param: LCM
tiling over TP, or a whole copy from a DP member) and files a TransferOp pair into each
rank's ReshardPlan. The reference fills Megatron's own ParameterMetadata from the preset's
shapes and rank layouts (names resolved by Megatron's assign_resolved_name_inplace), then
times that walk over every destination rank with Megatron's own functions and types: the
per-rank plans of the whole cluster, from the gathered lists. Not timed: filling the
metadata (Megatron reads it off live parameters) and the collectives that gather the
metadata and hand out the plans. Only refitd.bench imports Megatron-Core, and lazily.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from refitd.bench.presets import BF16, Parallel, Preset, rank_tensors


def load() -> tuple[Any, str | None]:
    """(megatron.core.resharding's planner and utils modules, None), or (None, why not)."""
    try:
        with warnings.catch_warnings():  # its import warns about absent GPU libraries
            warnings.simplefilter("ignore")
            planner = importlib.import_module("megatron.core.resharding.planner")
            utils = importlib.import_module("megatron.core.resharding.utils")
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] == "megatron":
            return None, "not installed"
        return None, f"import failed: {e}"
    except Exception as e:  # an installed version at odds with this torch: say so, time nothing
        return None, f"import failed: {type(e).__name__}: {e}"
    return (planner, utils), None


@dataclass(frozen=True, slots=True)
class Groups:
    """Global ranks of one rank's process groups, as Megatron's ProcessGroupCollection
    holds them: dense tp, dp and pp, expert tp and ep."""

    tp: list[int]
    dp: list[int]
    pp: list[int]
    etp: list[int]
    ep: list[int]


def rank_groups(par: Parallel, rank: int, base: int) -> Groups:
    """Rank `rank`'s groups in Megatron's default order (dense tp fastest, then dp; experts
    etp fastest, then ep, then expert dp; pp outermost), global ranks offset by `base`."""
    per_stage = par.world // par.pp
    stage, local = divmod(rank, per_stage)
    first = base + stage * per_stage
    tp_rank, dp_rank = local % par.tp, local // par.tp
    etp_rank = local % par.etp
    ep_rank = (local // par.etp) % par.ep
    edp_first = first + (local // (par.etp * par.ep)) * par.etp * par.ep
    return Groups(
        tp=[first + dp_rank * par.tp + t for t in range(par.tp)],
        dp=[first + d * par.tp + tp_rank for d in range(par.dp)],
        pp=[base + s * per_stage + local for s in range(par.pp)],
        etp=[edp_first + ep_rank * par.etp + t for t in range(par.etp)],
        ep=[edp_first + e * par.etp + etp_rank for e in range(par.ep)],
    )


def side_metadata(utils: Any, p: Preset, par: Parallel, base: int) -> dict[int, list]:
    """Every rank's ParameterMetadata list (global rank -> list), filled as Megatron's
    extract_param_metadata fills it from a live parameter: TP attributes on sharded
    weights (expert weights over the expert-TP group), EP on expert weights when ep > 1,
    local shapes, and names resolved to global layers and experts by Megatron itself."""
    import torch

    dtypes = {BF16: torch.bfloat16, "float32": torch.float32}
    out: dict[int, list] = {}
    for rank in range(par.world):
        g = rank_groups(par, rank, base)
        prefix = {
            f"decoder.layers.{i}": f"decoder.layers.{layer}"
            for i, layer in enumerate(par.stage_layers(p.layers, rank // (par.world // par.pp)))
        }
        metas = []
        for t, name, canonical, _, size in rank_tensors(p, par, rank):
            kind, dim, stride = t.shard
            expert = kind == "etp"
            shape = list(t.shape)
            if kind != "rep":
                shape[dim] //= size
            is_ep = expert and par.ep > 1
            tp_group = (g.etp if is_ep else g.tp) if kind != "rep" else None
            dtype = dtypes[t.dtype]
            meta = utils.ParameterMetadata(
                name=name,
                shape=tuple(shape),
                dtype=dtype,
                element_size=dtype.itemsize,
                is_tp=kind != "rep",
                partition_dim=max(dim, 0),
                partition_stride=stride,
                is_ep=is_ep,
                num_experts=p.num_experts or None,
                owner_rank=base + rank,
                tensor_parallel_group_ranks=tp_group,
                expert_parallel_group_ranks=g.ep if is_ep else None,
                data_parallel_group_ranks=g.dp,
                pipeline_parallel_group_ranks=g.pp,
            )
            utils.assign_resolved_name_inplace(meta, layer_module_prefix_map=prefix)
            if meta.resolved_name != canonical:
                raise RuntimeError(
                    f"Megatron resolves {name!r} on rank {base + rank} to "
                    f"{meta.resolved_name!r}, the preset names it {canonical!r}"
                )
            metas.append(meta)
        out[base + rank] = metas
    return out


def plan_all(modules: tuple[Any, Any], src: dict[int, list], dst: dict[int, list]) -> dict:
    """The central plan build of megatron.core.resharding.planner over gathered metadata:
    the metadata indexed by resolved name, then for every destination rank and parameter a
    source chosen and sliced by Megatron's functions, each slice a receive on the
    destination's ReshardPlan and a send on the source's (global rank -> ReshardPlan)."""
    planner, utils = modules
    by_name: dict[str, list] = {}
    for metas in src.values():
        for m in metas:
            by_name.setdefault(m.resolved_name, []).append(m)
    dst_by_rank = {r: {m.resolved_name: m for m in metas} for r, metas in dst.items()}
    plans = {r: utils.ReshardPlan([], []) for r in sorted({*src, *dst})}
    task = 0
    for rank, params in dst_by_rank.items():
        for resolved, d in params.items():
            holders = by_name.get(resolved)
            if not holders:
                raise RuntimeError(f"{resolved!r} of rank {rank} is held by no source rank")
            s = utils.select_src_metadata_balanced(holders, d, rank)
            pieces = planner._determine_source_ranks_for_dst_param(resolved, s, d, rank)
            for peer, src_slice, dst_slice in pieces:
                plans[rank].recv_ops.append(
                    utils.TransferOp(d.name, peer, False, dst_slice, src_slice, task)
                )
                plans[peer].send_ops.append(
                    utils.TransferOp(s.name, rank, True, src_slice, dst_slice, task)
                )
                task += 1
    return plans


def reference(
    p: Preset,
    src_par: Parallel,
    dst_par: Parallel,
    dst_base: int,
    best: Callable[[Callable[[], object]], tuple[float, list[float], object]],
) -> dict:
    """The JSON fields of the reference: megatron_s (best run of `best`), every run, the
    plan's transfer count; or `megatron` saying why there is no figure."""
    modules, why = load()
    if modules is None:
        return {"megatron": why}
    utils = modules[1]
    src = side_metadata(utils, p, src_par, 0)
    dst = side_metadata(utils, p, dst_par, dst_base)
    try:
        seconds, runs, plans = best(lambda: plan_all(modules, src, dst))
    except (RuntimeError, NotImplementedError, ValueError) as e:
        return {"megatron": f"failed: {e}"}
    return {
        "megatron": importlib.metadata.version("megatron-core"),
        "megatron_s": round(seconds, 4),
        "megatron_s_runs": [round(t, 4) for t in runs],
        "megatron_transfers": sum(len(x.recv_ops) for x in plans.values()),  # type: ignore[attr-defined]
    }
