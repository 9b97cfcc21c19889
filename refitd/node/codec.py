"""The node agent's boundary with the controller's protos, both ways, in one place.

`decode` turns a controller command (pb.AgentCommand) into the typed command one slot's
transfer process runs (refitd.slot_protocol), checking it on the way: a malformed command is
refused with a `CommandError` naming the field. `target_slots` says which slots it is for.
`report_proto` turns a typed report into the pb.AgentReport the agent sends.
`command_proto` is the inverse of `decode` for a command of one slot (tests, tools).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from refitd._proto import refitd_pb2 as pb
from refitd.slot_protocol import (
    DEFAULTS,
    WIRE_VERBS,
    Abort,
    Applied,
    Apply,
    Connect,
    Connected,
    DeltaPlan,
    DeltaResult,
    Execute,
    Executed,
    Failed,
    Load,
    Report,
    SlotCommand,
    SlotOptions,
    Verb,
    verb_of,
)


class CommandError(ValueError):
    """A controller command that cannot be run as sent (which field, what is wrong)."""


@dataclass(frozen=True, slots=True)
class SlotContext:
    """What a slot command takes from the agent rather than the controller: the slot, the
    agent's data-plane address, and the slot options (defaults of timeouts and sizes)."""

    slot: int
    data_plane_address: str = ""
    data_plane_interface: str = ""
    options: SlotOptions = DEFAULTS


# ---------------------------------------------------------------------- proto -> command
def verb_of_proto(cmd: pb.AgentCommand) -> Verb:
    """The slot protocol's entry of a controller command."""
    which = cmd.WhichOneof("command")
    verb = WIRE_VERBS.get(which or "")
    if verb is None:
        raise CommandError(f"command {cmd.command_id}: field command is {which!r}")
    return verb


def decode(cmd: pb.AgentCommand, ctx: SlotContext) -> SlotCommand[Any]:
    """The typed command slot `ctx.slot` runs for a controller command."""
    verb = verb_of_proto(cmd)
    return _CONVERSIONS[verb.command].decode(getattr(cmd, verb.wire), ctx)


def target_slots(cmd: pb.AgentCommand, held: Collection[int]) -> list[int]:
    """The slots a controller command is for: of a connect, those of the communicator this
    agent holds (`held`); of an abort, all it holds; of the others, every slot named
    (held here or not)."""
    verb = verb_of_proto(cmd)
    return _CONVERSIONS[verb.command].targets(getattr(cmd, verb.wire), held)


def refit_id_of(cmd: pb.AgentCommand) -> int:
    """The refit id a slot's reports of this command carry (a refit's; else 0)."""
    verb = WIRE_VERBS.get(cmd.WhichOneof("command") or "")
    return getattr(cmd, verb.wire).refit_id if verb is not None and verb.refit else 0


def _require(ok: bool, command: str, field: str, why: str) -> None:
    if not ok:
        raise CommandError(f"{command}: field {field} {why}")


def _timeout(value: float, default: float, command: str) -> float:
    _require(value >= 0, command, "timeout_s", f"must be >= 0, got {value}")
    return value or default


def _connect(c: pb.ConnectCommand, ctx: SlotContext) -> Connect:
    what = f"ConnectCommand of epoch {c.epoch}"
    _require(c.world_size >= 1, what, "world_size", f"must be >= 1, got {c.world_size}")
    _require(ctx.slot in c.comm_rank, what, "comm_rank", f"has no rank for slot {ctx.slot}")
    ranks = dict(c.comm_rank)
    bad = {s: r for s, r in ranks.items() if not 0 <= r < c.world_size}
    _require(not bad, what, "comm_rank", f"has ranks outside [0, {c.world_size}): {bad}")
    _require(0 <= c.store_port < 65536, what, "store_port", f"is not a port: {c.store_port}")
    return Connect(
        epoch=c.epoch,
        store_host=c.store_host,
        store_port=c.store_port,
        rank=ranks[ctx.slot],
        world_size=c.world_size,
        transport=c.transport or "gloo",
        timeout_s=_timeout(c.timeout_s, ctx.options.connect_timeout_s, what),
        slot_ranks=ranks,
        store_token=c.store_token,
        data_plane_address=ctx.data_plane_address,
        data_plane_interface=ctx.data_plane_interface,
        rdma_protocol=ctx.options.rdma_protocol,
        rdma_devices=ctx.options.rdma_devices,
        rdma_landing_bytes=ctx.options.rdma_landing_bytes,
    )


def _load(c: pb.LoadProgramCommand, ctx: SlotContext) -> Load:
    what = f"LoadProgramCommand of plan {c.digest!r}"
    _require(bool(c.digest), what, "digest", "is empty")
    _require(bool(c.program), what, "program", "is empty")
    handles = {h.index: h.memory for h in c.handles}
    if len(handles) != len(c.handles):  # linear: a load can carry 100,000 handles
        seen: set[int] = set()
        dup = sorted({h.index for h in c.handles if h.index in seen or seen.add(h.index)})
        _require(False, what, "handles", f"names tensor indices more than once: {dup[:8]}")
    return Load(
        digest=c.digest,
        program=c.program,
        handles=handles,
        staging_bytes=ctx.options.staging_bytes,
        staged=tuple(h.index for h in c.handles if h.staged),
        model=c.model,
        snapshot=tuple(h.index for h in c.handles if h.snapshot),
        snapshot_bytes=ctx.options.snapshot_bytes,
    )


def _execute(c: pb.ExecuteCommand, ctx: SlotContext) -> Execute:
    what = f"ExecuteCommand of refit {c.refit_id}"
    _require(bool(c.digest), what, "digest", "is empty")
    mine = [d for d in c.delta if d.slot == ctx.slot]
    _require(len(mine) <= 1, what, "delta", f"has {len(mine)} entries for slot {ctx.slot}")
    delta = None
    if mine:
        d = mine[0]
        _require(
            d.max_density >= 0.0,
            what,
            "delta.max_density",
            f"must be >= 0, got {d.max_density}",
        )
        delta = DeltaPlan(
            send=tuple(d.send),
            recv=tuple(d.recv),
            allowed=tuple(d.allowed),
            promote=d.promote,
            max_density=d.max_density,
        )
    return Execute(
        digest=c.digest,
        version=c.version,
        refit_id=c.refit_id,
        timeout_s=_timeout(c.timeout_s, ctx.options.transfer_timeout_s, what),
        verify=c.verify,
        delta=delta,
        lane=c.lane,
        weight=c.share_weight,
        piece=c.share_piece,
    )


def _apply(c: pb.ApplyCommand, ctx: SlotContext) -> Apply:
    what = f"ApplyCommand of refit {c.refit_id}"
    _require(bool(c.digest), what, "digest", "is empty")
    timeout_s = _timeout(c.timeout_s, ctx.options.transfer_timeout_s, what)
    return Apply(digest=c.digest, refit_id=c.refit_id, timeout_s=timeout_s)


# ---------------------------------------------------------------------- command -> proto
def _connect_proto(cmd: Connect, slot: int) -> pb.ConnectCommand:
    return pb.ConnectCommand(
        epoch=cmd.epoch,
        store_host=cmd.store_host,
        store_port=cmd.store_port,
        world_size=cmd.world_size,
        comm_rank=cmd.slot_ranks or {slot: cmd.rank},
        transport=cmd.transport,
        timeout_s=cmd.timeout_s,
        store_token=cmd.store_token,
    )


def _load_proto(cmd: Load, slot: int) -> pb.LoadProgramCommand:
    staged, snap = set(cmd.staged), set(cmd.snapshot)
    return pb.LoadProgramCommand(
        model=cmd.model,
        digest=cmd.digest,
        slot=slot,
        program=cmd.program,
        handles=[
            pb.TensorHandle(index=i, memory=m, staged=i in staged, snapshot=i in snap)
            for i, m in cmd.handles.items()
        ],
    )


def _execute_proto(cmd: Execute, slot: int) -> pb.ExecuteCommand:
    d = cmd.delta
    return pb.ExecuteCommand(
        digest=cmd.digest,
        slot=slot,
        slots=[slot],
        version=cmd.version,
        refit_id=cmd.refit_id,
        timeout_s=cmd.timeout_s,
        verify=cmd.verify,
        lane=cmd.lane,
        share_weight=cmd.weight,
        share_piece=cmd.piece,
        delta=[]
        if d is None
        else [
            pb.DeltaCommand(
                slot=slot,
                send=d.send,
                recv=d.recv,
                allowed=d.allowed,
                promote=d.promote,
                max_density=d.max_density,
            )
        ],
    )


def _apply_proto(cmd: Apply, slot: int) -> pb.ApplyCommand:
    return pb.ApplyCommand(
        digest=cmd.digest, slots=[slot], refit_id=cmd.refit_id, timeout_s=cmd.timeout_s
    )


def command_proto(cmd: SlotCommand[Any], slot: int, command_id: int = 0) -> pb.AgentCommand:
    """The controller command of one slot that `decode` turns into `cmd`."""
    verb = verb_of(cmd)
    if not verb.wire:
        raise CommandError(f"{type(cmd).__name__} is not a controller command")
    out = pb.AgentCommand(command_id=command_id)
    getattr(out, verb.wire).CopyFrom(_CONVERSIONS[verb.command].encode(cmd, slot))
    return out


@dataclass(frozen=True, slots=True)
class _Conversion:
    """One controller command's field both ways, and the slots it names."""

    decode: Callable[[Any, SlotContext], SlotCommand[Any]]
    encode: Callable[[Any, int], Any]
    targets: Callable[[Any, Collection[int]], list[int]]


# the slot protocol's commands the controller sends (its table's `wire` verbs)
_CONVERSIONS: dict[type, _Conversion] = {
    Connect: _Conversion(
        _connect, _connect_proto, lambda c, held: [s for s in c.comm_rank if s in held]
    ),
    Load: _Conversion(_load, _load_proto, lambda c, held: [c.slot]),
    Execute: _Conversion(_execute, _execute_proto, lambda c, held: list(c.slots) or [c.slot]),
    Apply: _Conversion(_apply, _apply_proto, lambda c, held: list(c.slots)),
    Abort: _Conversion(
        lambda c, ctx: Abort(refit_id=c.refit_id),
        lambda cmd, slot: pb.AbortCommand(refit_id=cmd.refit_id),
        lambda c, held: list(held),
    ),
}


# ---------------------------------------------------------------------- report -> proto
def report_proto(
    agent_id: str, slot: int, command_id: int, refit_id: int, report: Report, seconds: float
) -> pb.AgentReport:
    """One slot's report of one command; `seconds`: how long the agent saw it take (a
    refit's and an apply's reports carry their own)."""
    out = pb.AgentReport(
        agent_id=agent_id,
        slot=slot,
        command_id=command_id,
        kind=pb.ReportKind.Value(f"REPORT_KIND_{report.reported_as.upper()}"),  # type: ignore[union-attr]
        refit_id=refit_id,
        seconds=seconds,
    )
    if isinstance(report, Failed):
        out.message = report.error
    elif isinstance(report, Applied):
        out.bytes_local, out.seconds = report.bytes, report.seconds
    elif isinstance(report, Executed):
        _executed_fields(out, report)
    elif isinstance(report, Connected):
        out.loaded_plans.extend(report.loaded)
    return out


def _executed_fields(out: pb.AgentReport, executed: Executed) -> None:
    r = executed.report
    sums = r.checksums or {}
    if executed.snapshot is not None:
        out.snapshot_bytes = executed.snapshot.bytes
        out.snapshot_fallback = executed.snapshot.fallback
    out.bytes_sent, out.bytes_received, out.bytes_local = r.sent_bytes, r.recv_bytes, r.local_bytes
    out.seconds = r.seconds
    if r.first_landed_at:  # intervals, not times: the controller's clock may differ
        now = time.monotonic()
        out.first_landed_ago_s = max(0.0, now - r.first_landed_at)
        out.last_landed_ago_s = max(0.0, now - r.last_landed_at)
        out.first_landed_bytes = r.first_landed_bytes
    out.checksums.extend(
        pb.MessageChecksum(message_id=int(mid), sent=side == "send", checksum=h)
        for side in ("send", "recv")
        for mid, h in sums.get(side, {}).items()
    )
    if executed.delta is not None:
        out.delta.CopyFrom(delta_proto(executed.delta))


def delta_proto(d: DeltaResult) -> pb.DeltaOutcome:
    """The delta path's result of one execute, for the controller's record and ledger."""
    return pb.DeltaOutcome(
        base_version=d.base_version,
        pending_version=d.pending_version,
        base_bytes=d.base_bytes,
        encode_s=d.encode_s,
        apply_s=d.apply_s,
        sent=[
            pb.DeltaMessageStat(
                message_id=int(mid),
                delta=bool(m["kind"]),
                changed=int(m["changed"]),
                elements=int(m["elements"]),
                nbytes=int(m["nbytes"]),
                dense_nbytes=int(m["dense_nbytes"]),
            )
            for mid, m in d.sent.items()
        ],
    )
