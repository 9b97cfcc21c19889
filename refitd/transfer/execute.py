"""The execute command of a transfer process: one refit of a loaded plan.

The command loop runs it on its own thread (refitd.transfer.main). The snapshot (if the slot
takes one) is captured first and the trainer released; the delta path
(refitd.executor.delta.exchange) moves its messages next; the executor runs the rest. The
report is one `Executed`, preceded by the `SourcesReleased` event (`released`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from refitd.executor.errors import ExecutionError
from refitd.executor.run import Executor
from refitd.executor.shares import Share
from refitd.slot_protocol import DeltaPlan, DeltaResult, Execute, Executed

if TYPE_CHECKING:
    from refitd.transfer.slot import LoadedPlan, TransferSlot


def execute_refit(state: TransferSlot, cmd: Execute, released: Callable[[], None]) -> Executed:
    """One refit of the loaded plan `cmd.digest`; raises on failure."""
    entry = state.loaded.get(cmd.digest)
    if entry is not None:
        entry.filled = None  # the staging is being overwritten
    t0 = time.monotonic()
    snap = entry.snapshot if entry is not None else None
    on_released: Callable[[], None] | None = released
    released_s = 0.0
    if snap is not None and snap.active:
        # the trainer is released after a local copy (snapshot.py)
        entry.resolver.check(snap.checked)  # type: ignore[union-attr]
        snap.capture()
        released_s = time.monotonic() - t0
        released()
        on_released = None
    ex = state.executor(cmd.digest)
    skip: frozenset[int] = frozenset()
    delta = None
    sums: tuple[dict[int, int], dict[int, int]] = ({}, {})
    if cmd.delta is not None and entry is not None:  # reads the snapshot when there is one
        delta, sums = _delta_path(state, entry, ex, cmd.delta, cmd)
        skip = frozenset(cmd.delta.send) | frozenset(cmd.delta.recv)
    report = ex.run(
        cmd.timeout_s, on_released, state.aborting, verify=cmd.verify, skip=skip,
        attempt=cmd.refit_id, share=_share(state, cmd),
    )  # fmt: skip
    if entry is not None and not state.aborting.is_set():
        entry.filled = cmd.refit_id
    if delta is not None:
        report.sent_bytes += delta.wire_bytes
        report.recv_bytes += delta.recv_bytes
        if report.checksums is not None:
            report.checksums["send"].update(sums[0])
            report.checksums["recv"].update(sums[1])
    if snap is not None and snap.active:
        report.sources_released_s = released_s
        report.seconds = time.monotonic() - t0
    report.phases["command_s"] = time.monotonic() - t0
    return Executed(
        report,
        cmd.version,
        cmd.refit_id,
        delta=delta,
        snapshot=None if snap is None else snap.info(),
    )


def _share(state: TransferSlot, cmd: Execute) -> Share:
    """The refit's place on the links; its chunks go in pieces only through gates (every rank
    of the communicator has the same transport, so both ends of a chunk cut it alike)."""
    shares = state.shares_of_links()
    return Share(shares, cmd.lane, cmd.weight, cmd.piece if shares is not None else 0)


def _delta_path(
    state: TransferSlot, entry: LoadedPlan, ex: Executor, plan: DeltaPlan, cmd: Execute
) -> tuple[DeltaResult, tuple[dict[int, int], dict[int, int]]]:
    """This slot's messages of the delta path, before the executor runs the others: promote
    the base the controller reports committed, then exchange; returns what the controller
    records and the (send, recv) checksums of those messages (with verify)."""
    from refitd.executor.delta.access import ProgramAccess
    from refitd.executor.delta.exchange import DeltaBase, exchange_deltas

    if state.transport is None:
        raise ExecutionError("delta refit: no connected transport")
    if entry.delta is None or entry.delta[0] is None:
        ranks = state.slot_ranks
        resolver = ex.resolver  # sources from the snapshot when the slot takes one
        access = ProgramAccess(
            entry.program, resolver.resolve, lambda s: s if ranks is None else ranks[s]
        )
        entry.delta = (access, DeltaBase() if entry.delta is None else entry.delta[1])
    access, base = entry.delta
    promoted = base.promote(plan.promote, access) if plan.promote >= 0 else False
    t0 = time.monotonic()
    rep = exchange_deltas(
        state.transport,
        access.messages("send", list(plan.send)),
        access.messages("recv", list(plan.recv)),
        access,
        base,
        cmd.version,
        allowed=frozenset(plan.allowed),
        max_density=float(plan.max_density),
        deadline=t0 + float(cmd.timeout_s),
        wire_chunk=entry.config.wire_chunk,
        verify=cmd.verify,
    )
    return DeltaResult(
        promoted=promoted,
        base_version=base.version,
        pending_version=base.pending_version,
        base_bytes=base.nbytes,
        sent=rep.sent,
        received=rep.received,
        encode_s=rep.encode_s,
        apply_s=rep.apply_s,
        seconds=rep.seconds,
        wire_bytes=rep.wire_bytes,
        recv_bytes=sum(m["nbytes"] for m in rep.received.values()),
    ), (rep.send_sums, rep.recv_sums)
