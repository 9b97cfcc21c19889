"""What one device slot executes for one refit: the contract between planner and executor.

The planner builds a whole-cluster plan once per (model, membership epoch, layouts); the
controller ships to each transfer process the SlotProgram of its slot, and the executor
replays it every refit. A SlotProgram is columns (NumPy arrays), sliced from the plan's own
columns: no per-copy Python object is made to build, ship or run it.

- copies (C rows): source / destination plan tensor index, offsets and shape (local
  coordinates of the registered tensors, see layout.Box; padded with 0 / 1 past `ndim`),
  wire format code (WIRES), source and destination dtype codes (DTYPES) and FLAG_* bits
  (what the two ends need to agree on chunking without the other end's tensors). Rows are
  the send messages' copies in message order, then the receive messages' copies, then the
  local copies (`local_start`..C).
- send / recv messages (M rows each): id, round, source and destination slot, the range
  [start, end) of their copies, and wire bytes. Ordered by (round, id).
- tensors (T rows, sorted by plan index): every tensor held on this slot (copies or not),
  with its rank, pool, dtype, storage, local shape. Tensors of other slots appear only as
  indices in copies. Names do not travel: an agent has them with the memory handles.

Message k of a slot is packed from its copies' source regions in order, each as a wire
segment (wire.segment_parts) starting SEGMENT_ALIGN-aligned, and unpacked in the same order
into the destination regions. Messages carry a round: in round r each slot sends at most one
message to any peer and the executor may overlap round r+1 with round r.

Relays (plans built with PlanConfig.relay): a copy whose src is a destination tensor
forwards a region this slot received earlier. Its message's round is greater than the
rounds that delivered that region: before packing it, the slot completes all its receives
of smaller rounds; local copies reading a destination tensor run after all receives.

Encoding (`encode_program`): magic, format version, a small JSON header (digest, slot,
pools and one entry per column: dtype, shape, offset, crc32), then the raw little-endian
column buffers. `decode_program` checks all of it (lengths, dtypes, checksums, index
ranges, regions inside their tensors) and raises ProgramError naming the slot and the field.

The package, imported one way: columns (the data) <- checks <- codec, objects; build (every
slot's program from a plan's columns, for refitd.plan.plan) <- codec, columns.
"""

from refitd.plan.program.checks import check_program
from refitd.plan.program.codec import PROGRAM_FORMAT_VERSION, decode_program, encode_program
from refitd.plan.program.columns import (
    DTYPES,
    FLAG_AMAX_WORD,
    FLAG_DST_PLAIN,
    FLAG_LANDS_DIRECT,
    FLAG_SRC_CONTIGUOUS,
    STORAGES,
    WIRES,
    Copy,
    CopyColumns,
    Message,
    MessageColumns,
    ProgramError,
    ProgramTensor,
    SlotProgram,
    TensorColumns,
    contiguous_blocks,
)
from refitd.plan.program.objects import message_nbytes, program_from_objects

__all__ = [
    "DTYPES",
    "FLAG_AMAX_WORD",
    "FLAG_DST_PLAIN",
    "FLAG_LANDS_DIRECT",
    "FLAG_SRC_CONTIGUOUS",
    "PROGRAM_FORMAT_VERSION",
    "STORAGES",
    "WIRES",
    "Copy",
    "CopyColumns",
    "Message",
    "MessageColumns",
    "ProgramError",
    "ProgramTensor",
    "SlotProgram",
    "TensorColumns",
    "check_program",
    "contiguous_blocks",
    "decode_program",
    "encode_program",
    "message_nbytes",
    "program_from_objects",
]
