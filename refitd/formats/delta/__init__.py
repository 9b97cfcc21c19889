"""Delta refits' codec: only the elements that changed since a base version, exact to the bit.

streams: the byte format of a delta of one stream of elements, or of several (a container),
encoded and applied; frames: one frame of it (finding the changes, writing and applying the
frame bytes); segments: a wire segment's parts as such streams, landed in a destination
region. Imported one way: segments -> streams -> frames.
"""

from refitd.formats.delta.segments import (
    apply_segment_delta,
    encode_segment_delta,
    region_streams,
    segment_streams,
)
from refitd.formats.delta.streams import (
    BITMAP,
    DENSE,
    INDEX,
    UNCHANGED,
    ByteSink,
    DeltaError,
    DeltaStats,
    Scratch,
    apply_parts,
    apply_stream,
    bits_view,
    encode_parts,
    encode_stream,
    load_kernels,
    sampled_changes,
    worth_delta,
)

__all__ = [
    "BITMAP",
    "DENSE",
    "INDEX",
    "UNCHANGED",
    "ByteSink",
    "DeltaError",
    "DeltaStats",
    "Scratch",
    "apply_parts",
    "apply_segment_delta",
    "apply_stream",
    "bits_view",
    "encode_parts",
    "encode_segment_delta",
    "encode_stream",
    "load_kernels",
    "region_streams",
    "sampled_changes",
    "segment_streams",
    "worth_delta",
]
