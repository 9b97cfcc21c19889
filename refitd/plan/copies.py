"""Columnar copy tables shared by the planner's stages."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class CopyTable:
    """Copies as columns. feed: the copy (cid) whose destination region a relay reads, -1
    for a copy from a source tensor; cid: the copy's index before bucket splitting. ndim,
    wire (code) and esize (source element bytes) are int8: a table of a million copies is
    gathered, in message order, as a whole. period: 0, or the table is identical pools
    stamped (stamp.py) and the columns of REPEATED hold only the first `period` rows, row
    r reading row r % period (every pool's copies have the first pool's locations and
    shapes; its own tensors in src, dst and feed)."""

    src: np.ndarray
    dst: np.ndarray
    src_loc: np.ndarray
    dst_loc: np.ndarray
    shape: np.ndarray
    ndim: np.ndarray
    wire: np.ndarray
    esize: np.ndarray
    feed: np.ndarray
    cid: np.ndarray
    period: int = 0

    def at(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Rows `rows` of column `name`."""
        return self.columns((name,), rows)[name]

    def columns(self, names: tuple[str, ...], rows: np.ndarray) -> dict[str, np.ndarray]:
        """Rows `rows` of the columns `names`: the stored rows of REPEATED found once."""
        stored = rows % self.period if self.period and REPEATED_SET & set(names) else rows
        # np.take along axis 0: fancy indexing of [N, d] rows is several times slower
        return {
            n: np.take(getattr(self, n), stored if n in REPEATED_SET else rows, axis=0)
            for n in names
        }

    def take(self, idx: np.ndarray) -> CopyTable:
        return CopyTable(*(self.at(f, idx) for f in COLUMNS))

    def first(self, n: int) -> CopyTable:
        """The first n rows (views)."""
        return CopyTable(*(getattr(self, f)[:n] for f in COLUMNS))

    def whole(self) -> CopyTable:
        """The table with every column holding every row."""
        return self if not self.period else self.take(np.arange(self.src.size))

    def per_copy(self, values: np.ndarray) -> np.ndarray:
        """A column computed from the REPEATED columns (one value per stored row) for
        every row."""
        if not self.period:
            return values
        out = np.empty((self.src.size // self.period, *values.shape), values.dtype)
        out[:] = values  # a broadcast copy: np.tile is several times slower
        return out.reshape(-1, *values.shape[1:])


COLUMNS = tuple(f for f in CopyTable.__slots__ if f != "period")
REPEATED = ("src_loc", "dst_loc", "shape", "ndim", "wire", "esize")
REPEATED_SET = frozenset(REPEATED)
_CUT = ("src_loc", "dst_loc", "shape")  # the columns a cut along dim 0 changes


@dataclass(slots=True)
class Pieces:
    """Copies as rows of a copy table, some cut along dim 0: piece i is row rows[i] with
    its offsets moved step[i] rows on and len0[i] rows long (step None: none cut).
    Columns are gathered where they are used (programs), not as a whole table in message
    order when the plan is built: that table would be the plan's largest allocation."""

    table: CopyTable
    rows: np.ndarray
    step: np.ndarray | None = None
    len0: np.ndarray | None = None

    def column(self, name: str, idx: np.ndarray | None = None) -> np.ndarray:
        """Column `name` of the pieces (or of pieces `idx`), cuts applied."""
        if idx is not None and name not in _CUT:
            return self.table.at(name, self.rows[idx])
        return (self if idx is None else self.subset(idx)).columns((name,))[name]

    def columns(self, names: tuple[str, ...]) -> dict[str, np.ndarray]:
        """Columns `names` of the pieces, cuts applied (stored rows of REPEATED found once)."""
        out = self.table.columns(names, self.rows)
        if self.step is not None and self.len0 is not None:
            for name in set(_CUT) & set(out):
                if name == "shape":
                    out[name][:, 0] = self.len0
                else:
                    out[name][:, 0] += self.step
        return out

    def subset(self, idx: np.ndarray | slice) -> Pieces:
        """Pieces `idx` of these (rows and cuts gathered once, for several columns; views
        where `idx` is a slice)."""
        if self.step is None or self.len0 is None:
            return Pieces(self.table, self.rows[idx])
        return Pieces(self.table, self.rows[idx], self.step[idx], self.len0[idx])

    def take(self) -> CopyTable:
        """Every column of the pieces, as a table of their own."""
        return CopyTable(*(self.column(f) for f in COLUMNS))

    @staticmethod
    def concat(parts: list[Pieces]) -> Pieces:
        """The pieces of `parts` (rows of one table) in order."""
        table = parts[0].table
        rows = np.concatenate([p.rows for p in parts])
        if all(p.step is None for p in parts):
            return Pieces(table, rows)
        step = np.concatenate(
            [np.zeros(p.rows.size, np.int64) if p.step is None else p.step for p in parts]
        )
        len0 = np.concatenate(
            [table.at("shape", p.rows)[:, 0] if p.len0 is None else p.len0 for p in parts]
        )
        return Pieces(table, rows, step, len0)
