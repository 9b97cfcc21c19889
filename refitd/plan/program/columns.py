"""A slot program's data: columns (NumPy arrays), their code tables, and object views.

See refitd.plan.program for what a program is; this module holds its parts only: copy,
message and tensor columns, the SlotProgram that groups them, the code tables their small
integer columns index (WIRES, STORAGES, DTYPES) and the FLAG_* bits of a copy. Building
(build, objects), checking (checks) and encoding (codec) live beside it and import it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields

import numpy as np

from refitd.plan.links import COLLECTIVE, PATHS
from refitd.plan.wire import DTYPE_SIZES, RAW, STORAGE_FORMATS, WIRE_FORMATS

WIRES = WIRE_FORMATS  # wire code -> name (the built-in registry's order)
STORAGES = STORAGE_FORMATS  # storage code -> name
DTYPES = tuple(DTYPE_SIZES)  # dtype code -> name
FLAG_LANDS_DIRECT = 1  # raw wire into a plain destination of the source dtype, one run
FLAG_SRC_CONTIGUOUS = 2  # the source block is one run of its tensor
FLAG_DST_PLAIN = 4  # the destination keeps plain storage
FLAG_AMAX_WORD = 8  # raw wire into NVFP4 storage: a whole segment's chunk carries its amax
FLAG_BITS = 16  # every flag is below this


class ProgramError(ValueError):
    """A slot program that cannot be decoded or is inconsistent: names slot and field."""


@dataclass(frozen=True, slots=True)
class Copy:
    """One block copied from a source tensor region to a destination tensor region (an
    object view of one copy row, for tools and tests; the executor reads columns)."""

    src_tensor: int
    src_offset: tuple[int, ...]
    dst_tensor: int
    dst_offset: tuple[int, ...]
    shape: tuple[int, ...]
    wire: str = RAW


@dataclass(frozen=True, slots=True)
class Message:
    """Copies from one source slot to one destination slot, sent as one buffer (object
    view); path: how its bytes travel (refitd.plan.links)."""

    id: int
    round: int
    src_slot: int
    dst_slot: int
    copies: tuple[Copy, ...]
    nbytes: int
    path: str = COLLECTIVE


@dataclass(frozen=True, slots=True)
class ProgramTensor:
    """What a program knows of one tensor it touches. Names do not travel: an agent gets
    the names of its own tensors with their memory handles."""

    pool: str
    rank: int
    slot: int
    dtype: str
    storage: str
    local_shape: tuple[int, ...]


def _eq_arrays(a: object, b: object) -> bool:
    for f in fields(a):  # type: ignore[arg-type]
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            if not np.array_equal(x, y):
                return False
        elif x != y:
            return False
    return True


@dataclass(eq=False, slots=True)
class CopyColumns:
    src: np.ndarray  # [C] int64 plan tensor index
    dst: np.ndarray  # [C] int64
    src_off: np.ndarray  # [C, D] int64
    dst_off: np.ndarray  # [C, D] int64
    shape: np.ndarray  # [C, D] int64 (1 past ndim)
    ndim: np.ndarray  # [C] uint8
    wire: np.ndarray  # [C] uint8 code into WIRES
    src_dtype: np.ndarray  # [C] uint8 code into DTYPES
    dst_dtype: np.ndarray  # [C] uint8
    flags: np.ndarray  # [C] uint8 FLAG_* bits

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CopyColumns) and _eq_arrays(self, other)

    def __len__(self) -> int:
        return int(self.src.size)


@dataclass(eq=False, slots=True)
class MessageColumns:
    id: np.ndarray  # [M] int64
    round: np.ndarray
    src_slot: np.ndarray
    dst_slot: np.ndarray
    start: np.ndarray  # first copy row
    end: np.ndarray
    nbytes: np.ndarray
    path: np.ndarray  # [M] uint8 code into PATHS

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MessageColumns) and _eq_arrays(self, other)

    def __len__(self) -> int:
        return int(self.id.size)


@dataclass(eq=False, slots=True)
class TensorColumns:
    index: np.ndarray  # [T] int64, ascending
    slot: np.ndarray
    rank: np.ndarray
    pool: np.ndarray  # id into `pools`
    dtype: np.ndarray  # uint8 code into DTYPES
    storage: np.ndarray  # uint8 code into STORAGES
    ndim: np.ndarray  # uint8
    local_shape: np.ndarray  # [T, D] int64 (1 past ndim)
    pools: tuple[str, ...]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorColumns) and _eq_arrays(self, other)

    def row(self, index: int) -> int:
        """Row of a plan tensor index, -1 if absent."""
        r = int(np.searchsorted(self.index, index))
        return r if r < self.index.size and int(self.index[r]) == index else -1

    def rows(self, indices: np.ndarray) -> np.ndarray:
        """Rows of plan tensor indices that are all present."""
        return np.searchsorted(self.index, indices)

    def get(self, r: int) -> ProgramTensor:
        nd = int(self.ndim[r])
        return ProgramTensor(
            pool=self.pools[int(self.pool[r])],
            rank=int(self.rank[r]),
            slot=int(self.slot[r]),
            dtype=DTYPES[int(self.dtype[r])],
            storage=STORAGES[int(self.storage[r])],
            local_shape=tuple(self.local_shape[r, :nd].tolist()),
        )


class TensorView(Mapping[int, ProgramTensor]):
    """program.tensors: plan index -> ProgramTensor, made on access."""

    def __init__(self, cols: TensorColumns) -> None:
        self._cols = cols

    def __getitem__(self, index: int) -> ProgramTensor:
        r = self._cols.row(int(index))
        if r < 0:
            raise KeyError(index)
        return self._cols.get(r)

    def __contains__(self, index: object) -> bool:
        return isinstance(index, (int, np.integer)) and self._cols.row(int(index)) >= 0

    def __iter__(self) -> Iterator[int]:
        return iter(self._cols.index.tolist())

    def __len__(self) -> int:
        return int(self._cols.index.size)


@dataclass(eq=False)
class SlotProgram:
    """Everything one transfer process needs for one refit of one plan, as columns."""

    digest: str
    slot: int
    table: TensorColumns
    copies: CopyColumns
    send: MessageColumns
    recv: MessageColumns
    local_start: int
    # travelling dtype per integer column, set by the builder for the columns as built
    # (saves a maximum per column when encoding); whoever changes a column clears it
    wire_dtypes: dict[str, str] | None = field(default=None, repr=False)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, SlotProgram)
            and (self.digest, self.slot, self.local_start)
            == (other.digest, other.slot, other.local_start)
            and self.table == other.table
            and self.copies == other.copies
            and self.send == other.send
            and self.recv == other.recv
        )

    # -------------------------------------------------------------- object views (tools)
    @property
    def tensors(self) -> TensorView:
        return TensorView(self.table)

    def copy_objects(self, lo: int, hi: int) -> tuple[Copy, ...]:
        c = self.copies
        out = []
        for i in range(lo, hi):
            nd = int(c.ndim[i])
            out.append(
                Copy(
                    int(c.src[i]),
                    tuple(c.src_off[i, :nd].tolist()),
                    int(c.dst[i]),
                    tuple(c.dst_off[i, :nd].tolist()),
                    tuple(c.shape[i, :nd].tolist()),
                    WIRES[int(c.wire[i])],
                )
            )
        return tuple(out)

    def _messages(self, m: MessageColumns) -> tuple[Message, ...]:
        return tuple(
            Message(
                int(m.id[k]),
                int(m.round[k]),
                int(m.src_slot[k]),
                int(m.dst_slot[k]),
                self.copy_objects(int(m.start[k]), int(m.end[k])),
                int(m.nbytes[k]),
                PATHS[int(m.path[k])],
            )
            for k in range(len(m))
        )

    @property
    def sends(self) -> tuple[Message, ...]:
        return self._messages(self.send)

    @property
    def recvs(self) -> tuple[Message, ...]:
        return self._messages(self.recv)

    @property
    def local(self) -> tuple[Copy, ...]:
        return self.copy_objects(self.local_start, len(self.copies))


def contiguous_blocks(shape: np.ndarray, full: np.ndarray, ndim: np.ndarray) -> np.ndarray:
    """Per row: a block of `shape` in a row-major tensor of shape `full` is one run
    (after its leading dims of size 1, every dim is whole)."""
    one_run = np.ones(shape.shape[0], dtype=bool)
    past_first = np.zeros(shape.shape[0], dtype=bool)  # a live dim of size > 1 came before
    for k in range(shape.shape[1]):  # column by column: few dims, many rows
        live = ndim > k
        one_run &= ~(past_first & live & (shape[:, k] != full[:, k]))
        past_first |= live & (shape[:, k] != 1)
    return one_run


def copy_flags(
    wire: np.ndarray,
    src_dtype: np.ndarray,
    dst_dtype: np.ndarray,
    dst_plain: np.ndarray,
    dst_nvfp4: np.ndarray,
    shape: np.ndarray,
    src_full: np.ndarray,
    dst_full: np.ndarray,
    ndim: np.ndarray,
) -> np.ndarray:
    """FLAG_* bits of every copy (shapes padded with 1s past ndim)."""
    nd = ndim.astype(np.int64)
    lands = (wire == 0) & dst_plain & (dst_dtype == src_dtype)
    lands &= contiguous_blocks(shape, dst_full, nd)
    flags = np.where(lands, FLAG_LANDS_DIRECT, 0)
    flags |= np.where(contiguous_blocks(shape, src_full, nd), FLAG_SRC_CONTIGUOUS, 0)
    flags |= np.where(dst_plain, FLAG_DST_PLAIN, 0)
    flags |= np.where((wire == 0) & dst_nvfp4, FLAG_AMAX_WORD, 0)
    return flags.astype(np.uint8)
