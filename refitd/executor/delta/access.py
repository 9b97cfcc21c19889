"""The delta exchange's view of a slot program's copies (Message / Copy objects).

Rows number the copies of the program's send messages, then of its receive messages, in
message order; `messages` lists a side's messages as DeltaMessages over those rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from refitd.executor.delta.exchange import DeltaMessage
from refitd.executor.segments import ResolvedTensor, block, decode_segment, encode_segment
from refitd.plan.program import DTYPES
from refitd.plan.wire import segment_nbytes
from refitd.torch_dtypes import torch_dtype


class ProgramAccess:
    """Copy rows of a slot program over resolved tensors (CopyAccess of delta_exchange)."""

    def __init__(
        self,
        program: object,
        resolve: Callable[[int], ResolvedTensor],
        peer_rank: Callable[[int], int],
    ) -> None:
        self._resolve = resolve
        self._copies: list = []
        self._dtypes: list[str] = []
        self.sends: dict[int, DeltaMessage] = {}
        self.recvs: dict[int, DeltaMessage] = {}
        # rows are the program's copy rows: its sends' copies, then its receives' copies
        codes = program.copies.src_dtype.tolist()  # type: ignore[attr-defined]
        for side, msgs in (("send", program.sends), ("recv", program.recvs)):  # type: ignore[attr-defined]
            for m in msgs:
                rows = []
                for c in m.copies:
                    rows.append(len(self._copies))
                    self._copies.append(c)
                    self._dtypes.append(DTYPES[codes[len(self._dtypes)]])
                peer = peer_rank(m.dst_slot if side == "send" else m.src_slot)
                dm = DeltaMessage(int(m.id), peer, tuple(rows))
                (self.sends if side == "send" else self.recvs)[int(m.id)] = dm

    def messages(self, side: str, mids: Iterable[int]) -> list[DeltaMessage]:
        table = self.sends if side == "send" else self.recvs
        return [table[m] for m in sorted(mids) if m in table]

    def wire(self, row: int) -> str:
        return self._copies[row].wire

    def shape(self, row: int) -> tuple[int, ...]:
        return tuple(self._copies[row].shape)

    def src_dtype(self, row: int) -> str:
        return self._dtypes[row]

    def seg_nbytes(self, row: int) -> int:
        return segment_nbytes(self.wire(row), self.shape(row), self.src_dtype(row))

    def src_block(self, row: int) -> torch.Tensor:
        c = self._copies[row]
        return block(self._resolve(c.src_tensor).data, tuple(c.src_offset), self.shape(row))

    def dst(self, row: int) -> tuple[ResolvedTensor, tuple[int, ...]]:
        c = self._copies[row]
        return self._resolve(c.dst_tensor), tuple(c.dst_offset)

    def encode(self, row: int, out: torch.Tensor) -> None:
        encode_segment(self.wire(row), self.src_block(row), out)

    def decode(self, row: int, seg: torch.Tensor) -> None:
        t, off = self.dst(row)
        decode_segment(
            self.wire(row), seg, self.shape(row), torch_dtype(self.src_dtype(row)), t, off
        )
