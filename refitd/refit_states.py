"""The names of a refit's states, as the status document, the refit history and
`TrainerClient.refit` give them ("requested", "sources_ready", ..., "committed", "failed",
"superseded"): the proto enum `RefitState` with its prefix dropped, named once here for the
controller and the worker library alike."""

from __future__ import annotations

import types
from collections.abc import Mapping

from refitd._proto import refitd_pb2 as pb

_PREFIX = "REFIT_STATE_"
UNSPECIFIED = "unspecified"

STATE_NAMES: Mapping[int, str] = types.MappingProxyType(
    {
        v.number: v.name.removeprefix(_PREFIX).lower()
        for v in pb.RefitState.DESCRIPTOR.values
        if v.number != pb.REFIT_STATE_UNSPECIFIED
    }
)


def state_name(state: int) -> str:
    """The name of `state`; "unspecified" for 0 or a state this version does not know."""
    return STATE_NAMES.get(state, UNSPECIFIED)
