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
