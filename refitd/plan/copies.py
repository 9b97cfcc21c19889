"""Columnar copy tables shared by the planner's stages."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class CopyTable:
    """Copies as columns. feed: the copy (cid) whose destination region a relay reads, -1
    for a copy from a source tensor; cid: the copy's index before bucket splitting. ndim,
    wire (code) and esize (source element bytes) are int8: a table of a million copies is
    gathered, in message order, as a whole."""

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

    def take(self, idx: np.ndarray) -> CopyTable:
        # np.take along axis 0: fancy indexing of [N, d] rows is several times slower
        return CopyTable(*(np.take(getattr(self, f), idx, axis=0) for f in self.__slots__))


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
        rows = self.rows if idx is None else self.rows[idx]
        out = np.take(getattr(self.table, name), rows, axis=0)
        if self.step is not None and self.len0 is not None and name in _CUT:
            if name == "shape":
                out[:, 0] = self.len0 if idx is None else self.len0[idx]
            else:
                out[:, 0] += self.step if idx is None else self.step[idx]
        return out

    def subset(self, idx: np.ndarray) -> Pieces:
        """Pieces `idx` of these (rows and cuts gathered once, for several columns)."""
        if self.step is None or self.len0 is None:
            return Pieces(self.table, self.rows[idx])
        return Pieces(self.table, self.rows[idx], self.step[idx], self.len0[idx])

    def take(self) -> CopyTable:
        """Every column of the pieces, as a table of their own."""
        return CopyTable(*(self.column(f) for f in CopyTable.__slots__))

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
        len0 = np.concatenate([table.shape[p.rows, 0] if p.len0 is None else p.len0 for p in parts])
        return Pieces(table, rows, step, len0)
