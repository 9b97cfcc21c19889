"""A trainer's weights as vLLM's `WeightSource` declares them, turned into refitd
registrations: `ParamMeta` owners, mesh shape and `Shard` / `Replicate` placements become
boxes of the global tensor (torch.chunk's uneven split, outer mesh axis first), so each rank
registers only its own piece and nothing is gathered.

The tensors registered are those the source yields (`iter_local`, else `iter_full`); their
storage moves into shared memory in place. A plain module parameter is yielded as itself
every round, so later optimizer steps are what the next refit reads. A source that yields
other tensors each round (a DTensor's `to_local()` view, a converted or gathered tensor) is
copied into the registered buffers by `SourceBuffers.refresh()` before each refit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.base import Shard as VllmShard

from refitd.client import Placed
from refitd.plan.errors import PlanError
from refitd.plan.layouts import Replicate, Shard, dtensor_layout


@dataclass
class SourceBuffers:
    """This rank's registered tensors of a WeightSource, by parameter name."""

    source: WeightSource
    rank: int
    placed: dict[str, Placed]
    local: bool  # read through iter_local (pieces) rather than iter_full (whole tensors)

    @classmethod
    def of(cls, source: WeightSource, rank: int) -> SourceBuffers:
        """Read one pass of the source and lay out each tensor this rank owns."""
        local = source.implements_iter_local()
        if not local and not source.implements_iter_full():
            raise TypeError(
                f"{type(source).__name__} implements neither iter_local() nor iter_full()"
            )
        metas = {m.name: m for m in source.metadata}
        placed: dict[str, Placed] = {}
        for name, tensor in _iterate(source, local):
            meta = metas.get(name)
            if meta is None:
                raise ValueError(
                    f"trainer rank {rank}: the source yields {name!r}, not in its metadata"
                )
            placed[name] = _placed(meta, tensor, rank, local)
        missing = [n for n in source.owned_names(rank) if n not in placed]
        if missing:
            raise ValueError(f"trainer rank {rank}: the source did not yield {missing[:5]}")
        if not placed:
            raise ValueError(f"trainer rank {rank} owns no parameter of the source")
        return cls(source, rank, placed, local)

    def refresh(self) -> int:
        """Copy what the source yields now into the registered buffers where it is another
        tensor (the same storage needs nothing); returns the tensors copied."""
        copied = 0
        with torch.no_grad():
            for name, tensor in _iterate(self.source, self.local):
                buf = self.placed[name].tensor
                if tensor.data_ptr() == buf.data_ptr() and tensor.stride() == buf.stride():
                    continue
                if tuple(tensor.shape) != tuple(buf.shape) or tensor.dtype != buf.dtype:
                    raise ValueError(
                        f"trainer rank {self.rank}: {name!r} is now {tuple(tensor.shape)} "
                        f"{tensor.dtype}, registered as {tuple(buf.shape)} {buf.dtype}"
                    )
                buf.copy_(tensor)
                copied += 1
        return copied


def _iterate(source: WeightSource, local: bool):  # -> Iterator[tuple[str, torch.Tensor]]
    return source.iter_local() if local else source.iter_full()


def _placed(meta: ParamMeta, tensor: torch.Tensor, rank: int, local: bool) -> Placed:
    """The tensor's boxes in the global parameter, from its metadata (a whole replica when
    the source yields full tensors or declares no sharded placement)."""
    where = f"tensor {meta.name!r} (trainer rank {rank})"
    if tensor.dtype != meta.dtype:
        raise PlanError(f"{where}: yielded as {tensor.dtype}, declared {meta.dtype}")
    shape = tuple(meta.shape)
    if not local or meta.owners is None or meta.placements is None:
        if tuple(tensor.shape) != shape:
            raise PlanError(f"{where}: yielded {tuple(tensor.shape)}, declared whole {shape}")
        return Placed(tensor, shape, canonical=meta.name)
    mesh = tuple(meta.mesh_shape or (len(meta.owners),))
    coord = tuple(int(c) for c in np.unravel_index(meta.owners.index(rank), mesh))
    placements = [
        Shard(p.dim) if isinstance(p, VllmShard) else Replicate() for p in meta.placements
    ]
    layout = dtensor_layout(shape, mesh, coord, placements, where)
    if tuple(tensor.shape) != layout.local_shape:
        raise PlanError(
            f"{where}: yielded {tuple(tensor.shape)}, its placements {meta.placements} on "
            f"mesh {mesh} at {coord} describe {layout.local_shape}"
        )
    return Placed(tensor, shape, layout.boxes, canonical=meta.name)
