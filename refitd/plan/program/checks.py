"""Consistency of a slot program's columns: what a decoded or hand-written program must
satisfy before an executor runs it (tensor indices known, copies' regions inside their
tensors, message ranges tiling the copies, wire bytes per message). Every failure is a
ProgramError naming the slot and the field.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from refitd.plan.links import PATHS
from refitd.plan.program.columns import (
    DTYPES,
    FLAG_BITS,
    STORAGES,
    ProgramError,
    SlotProgram,
    TensorColumns,
)
from refitd.plan.wire import BUILTIN_WIRES, DTYPE_SIZES, WireRegistry

_ESIZE = np.array([DTYPE_SIZES[d] for d in DTYPES], np.int64)
Fail = Callable[[str, str], ProgramError]  # (field, what) -> the error to raise


def check_program(
    p: SlotProgram,
    fail: Fail | None = None,
    wires: WireRegistry = BUILTIN_WIRES,
) -> None:
    """Consistency of a program's columns (decoding runs it; see the module docstring);
    wire codes index `wires` (the registry of the plan that made the program)."""
    fail = fail or failure(p.slot)
    t, c = p.table, p.copies
    _check_tensors(t, fail)
    _check_ranges(p, fail)
    D = c.shape.shape[1]
    if c.ndim.size and int(c.ndim.max()) > D:
        raise fail("copies.ndim", f"a copy has {int(c.ndim.max())} dims, the program {D}")
    for name, n in (
        ("wire", len(wires.formats)),
        ("src_dtype", len(DTYPES)),
        ("dst_dtype", len(DTYPES)),
    ):
        col = getattr(c, name)
        if col.size and int(col.max()) >= n:
            raise fail(f"copies.{name}", f"unknown code {int(col.max())}")
    if c.flags.size and int(c.flags.max()) >= FLAG_BITS:
        raise fail("copies.flags", f"unknown bits {int(c.flags.max())}")
    if (c.src_off < 0).any() or (c.dst_off < 0).any() or (c.shape < 0).any():
        raise fail("copies.shape", "negative offset or shape")
    send_hi = int(p.send.end[-1]) if len(p.send) else 0
    local = np.arange(p.local_start, len(c))
    # the ends held on this slot: sources it sends or copies, destinations it receives or
    # copies into; they must be in the table, and each region inside its tensor
    own = {"src": np.r_[np.arange(send_hi), local], "dst": np.arange(send_hi, len(c))}
    for end, rows in own.items():
        idx = getattr(c, end)[rows]
        rr = np.minimum(np.searchsorted(t.index, idx), max(t.index.size - 1, 0))
        if idx.size and (not t.index.size or (t.index[rr] != idx).any()):
            bad = int(idx[t.index[rr] != idx][0]) if t.index.size else int(idx[0])
            raise fail(f"copies.{end}", f"tensor {bad} is not in the program's tensor table")
        if (t.ndim[rr] != c.ndim[rows]).any():
            raise fail("copies.ndim", f"a copy's rank differs from its {end} tensor's")
        if (t.dtype[rr] != getattr(c, f"{end}_dtype")[rows]).any():
            raise fail(f"copies.{end}_dtype", f"differs from its {end} tensor's dtype")
        off = getattr(c, f"{end}_off")[rows]
        over = (off + c.shape[rows] > t.local_shape[rr]).any(axis=1)
        if over.any():
            i = int(np.flatnonzero(over)[0])
            raise fail(
                f"copies.{end}_off",
                f"copy {int(rows[i])} reaches outside tensor {int(idx[i])} "
                f"(offset {off[i].tolist()}, shape {c.shape[rows[i]].tolist()}, "
                f"local shape {t.local_shape[rr[i]].tolist()})",
            )
    _check_nbytes(p, fail, wires)


def failure(slot: int | None) -> Fail:
    """The ProgramError maker of a program for `slot`, naming the slot and the field."""

    def fail(field: str, what: str) -> ProgramError:
        who = "?" if slot is None else slot
        return ProgramError(f"slot program for slot {who}: field {field!r}: {what}")

    return fail


def _check_tensors(t: TensorColumns, fail: Fail) -> None:
    if t.index.size > 1 and (np.diff(t.index) <= 0).any():
        raise fail("tensors.index", "not strictly increasing")
    if t.index.size and int(t.index.min()) < 0:
        raise fail("tensors.index", "negative tensor index")
    for name, n in (("dtype", len(DTYPES)), ("storage", len(STORAGES)), ("pool", len(t.pools))):
        col = getattr(t, name)
        if col.size and (int(col.min()) < 0 or int(col.max()) >= n):
            raise fail(f"tensors.{name}", f"code out of range [0, {n})")
    D = t.local_shape.shape[1]
    if t.ndim.size and int(t.ndim.max()) > D:
        raise fail("tensors.ndim", f"more dims than the program's {D}")
    if (t.local_shape < 0).any():
        raise fail("tensors.local_shape", "negative size")


def _check_ranges(p: SlotProgram, fail: Fail) -> None:
    """Message copy ranges tile the copies in order; ends, rounds and order are sane."""
    pos = 0
    for side, m in (("send", p.send), ("recv", p.recv)):
        if len(m) and not (
            int(m.start[0]) == pos
            and (m.start[1:] == m.end[:-1]).all()
            and (m.end >= m.start).all()
        ):
            raise fail(f"{side}.start", "message copy ranges do not tile the copies in order")
        pos = int(m.end[-1]) if len(m) else pos
        if len(m) and int(m.path.max()) >= len(PATHS):
            raise fail(f"{side}.path", f"unknown path code {int(m.path.max())}")
        mine = m.src_slot if side == "send" else m.dst_slot
        if (mine != p.slot).any():
            raise fail(f"{side}.{'src' if side == 'send' else 'dst'}_slot", "not this slot")
        if len(m) > 1:
            key_ok = (np.diff(m.round) > 0) | ((np.diff(m.round) == 0) & (np.diff(m.id) > 0))
            if not key_ok.all():
                raise fail(f"{side}.id", "messages not ordered by (round, id)")
    if p.local_start != pos or pos > len(p.copies):
        raise fail("local_start", f"{p.local_start}, copies of messages end at {pos}")


def _check_nbytes(p: SlotProgram, fail: Fail, wires: WireRegistry) -> None:
    """Each message's wire bytes are its copies' segments."""
    c = p.copies
    esize = _ESIZE[c.src_dtype.astype(np.int64)]
    nb = wires.segment_nbytes(c.wire, c.shape, c.ndim.astype(np.int64), esize)
    csum = np.r_[0, np.cumsum(nb)]
    for side, m in (("send", p.send), ("recv", p.recv)):
        want = csum[m.end] - csum[m.start]
        if (want != m.nbytes).any():
            k = int(np.flatnonzero(want != m.nbytes)[0])
            raise fail(
                f"{side}.nbytes",
                f"message {int(m.id[k])}: copies need {int(want[k])} wire bytes, "
                f"the program says {int(m.nbytes[k])}",
            )
