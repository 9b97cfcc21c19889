"""The plan digest: the key of the plan cache."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from refitd.plan.config import PlanConfig
from refitd.plan.layout import TensorSpec
from refitd.plan.table import SpecTable


def fingerprint(model: str, src: SpecTable, dst: SpecTable, config: PlanConfig) -> str:
    """Digest of everything that shapes a plan: the layout identity (names, layouts, dtypes,
    slots, ranks, config). Not the membership epoch nor memory handles: a restart that keeps
    every layout gets the same digest, so its plan is reused."""
    h = hashlib.sha256(repr((model, config)).encode())  # SHA-NI: twice blake2b's speed
    for side in (src, dst):
        h.update(b"|side|")
        side.digest_into(h)
    return h.hexdigest()[:32]


def plan_digest(
    model: str,
    sources: Sequence[TensorSpec] | SpecTable,
    destinations: Sequence[TensorSpec] | SpecTable,
    config: PlanConfig,
) -> str:
    """The key of the plan cache: changes with any layout, name, slot or config change, not
    with memory handles or the membership epoch."""
    return fingerprint(model, _table(sources), _table(destinations), config)


def _table(specs: Sequence[TensorSpec] | SpecTable) -> SpecTable:
    return specs if isinstance(specs, SpecTable) else SpecTable.from_specs(specs)
