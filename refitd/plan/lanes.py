"""Lanes: the tag spaces of refits of several models running at once on one communicator.

The controller gives each transfer running at a moment its own lane (the lowest free one);
every chunk's tag is moved into its lane's space, so two models' messages between the same
two ranks never match each other's receives. Lane 0 keeps the tags as they are. While
several models can refit at once, each gated chunk goes in pieces of LANE_PIECE bytes, every
piece a send of its own under the chunk's tag, so lanes take turns on a link at that grain.
"""

from __future__ import annotations

LANES = 16  # transfers at once on one communicator
_LANE_SHIFT = 27  # a lane flips the top bits of the 31-bit tag
LANE_PIECE = 1 << 20  # a turn on a link several models share (8 ms at 1 Gbit/s)


def lane_tag(tag: int, lane: int) -> int:
    """A chunk's tag in its lane's tag space."""
    if not 0 <= lane < LANES:
        raise ValueError(f"lane {lane} is outside 0..{LANES - 1}")
    return tag ^ (lane << _LANE_SHIFT)
