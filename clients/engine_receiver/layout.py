"""The engine layout of a rank's own parameters, checked to cover every one of them: a
parameter no layout covers would silently keep its old values after every refit."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from clients.engine_layouts import EngineLayout, EngineParallel, engine_layout_for


def covering_layout(
    hf_config: object,
    params: Mapping[str, torch.Tensor],
    parallel: EngineParallel,
    engine: str,
    source_naming: str,
) -> EngineLayout:
    """The `engine` layout of `hf_config` for this rank; raises ValueError naming the model
    family when refitd has none, or the parameters it does not cover."""
    family = getattr(hf_config, "model_type", None) or type(hf_config).__name__
    try:
        layout = engine_layout_for(hf_config, parallel, engine, source_naming=source_naming)
    except ValueError as exc:
        raise ValueError(
            f"refitd cannot lay out the {engine} parameters of model family {family!r} "
            f"(tp {parallel.tp_size}, rank {parallel.tp_rank}): {exc}"
        ) from exc
    covered = {t.name for t in layout.tensors}
    uncovered = [name for name in params if name not in covered]
    if uncovered:
        more = f" (and {len(uncovered) - 1} more: {uncovered[1:6]})" if len(uncovered) > 1 else ""
        raise ValueError(
            f"parameter {uncovered[0]!r} of model family {family!r} is not covered by "
            f"refitd's {engine} engine layout (tp {parallel.tp_size}, rank "
            f"{parallel.tp_rank}){more}: a refit would never write it"
        )
    return layout
