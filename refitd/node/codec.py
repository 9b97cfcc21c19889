"""The node agent's boundary with the controller's protos, both ways, in one place.

`slot_command` turns a controller command (pb.AgentCommand) into the typed command one slot's
transfer process runs (refitd.slot_protocol), checking it on the way: a malformed command is
refused with a `CommandError` naming the field. `outcome_of` turns a transfer process's typed
reply into the `Outcome` the agent reports, and `report_proto` that into a pb.AgentReport.
`command_proto` is the inverse of `slot_command` for a command of one slot (tests, tools).
"""

from __future__ import annotations

from dataclasses import dataclass

from refitd._proto import refitd_pb2 as pb
from refitd.slot_protocol import (
    Applied,
    Apply,
    Connect,
    DeltaPlan,
    DeltaResult,
    Execute,
    Executed,
    Load,
    Loaded,
)

SlotCommand = Connect | Load | Execute | Apply


class CommandError(ValueError):
    """A controller command that cannot be run as sent (which field, what is wrong)."""


@dataclass(frozen=True, slots=True)
class SlotContext:
    """What a slot command takes from the agent rather than the controller: the slot, the
    agent's data-plane address, and the defaults of timeouts and buffer sizes."""

    slot: int
    data_plane_address: str = ""
    data_plane_interface: str = ""
    connect_timeout_s: float = 60.0
    transfer_timeout_s: float = 300.0
    staging_bytes: int = 256 << 20
    snapshot_bytes: int = 2 << 30


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a slot command produced, reported to the controller."""

    kind: int
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0
    seconds: float = 0.0
    message: str = ""
    checksums: tuple[pb.MessageChecksum, ...] = ()
    delta: pb.DeltaOutcome | None = None
    snapshot_bytes: int = 0
    snapshot_fallback: str = ""


# ---------------------------------------------------------------------- proto -> command
def slot_command(cmd: pb.AgentCommand, ctx: SlotContext) -> SlotCommand:
    """The typed command slot `ctx.slot` runs for a controller command (not abort)."""
    which = cmd.WhichOneof("command")
    if which == "connect":
        return _connect(cmd.connect, ctx)
    if which == "load":
        return _load(cmd.load, ctx)
    if which == "execute":
        return _execute(cmd.execute, ctx)
    if which == "apply":
        return _apply(cmd.apply, ctx)
    raise CommandError(f"command {cmd.command_id}: field command is {which!r}, not a slot command")


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
        timeout_s=_timeout(c.timeout_s, ctx.connect_timeout_s, what),
        slot_ranks=ranks,
        store_token=c.store_token,
        data_plane_address=ctx.data_plane_address,
        data_plane_interface=ctx.data_plane_interface,
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
        staging_bytes=ctx.staging_bytes,
        staged=tuple(h.index for h in c.handles if h.staged),
        model=c.model,
        snapshot=tuple(h.index for h in c.handles if h.snapshot),
        snapshot_bytes=ctx.snapshot_bytes,
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
        timeout_s=_timeout(c.timeout_s, ctx.transfer_timeout_s, what),
        verify=c.verify,
        delta=delta,
    )


def _apply(c: pb.ApplyCommand, ctx: SlotContext) -> Apply:
    what = f"ApplyCommand of refit {c.refit_id}"
    _require(bool(c.digest), what, "digest", "is empty")
    _timeout(c.timeout_s, ctx.transfer_timeout_s, what)
    return Apply(digest=c.digest, refit_id=c.refit_id)


def apply_timeout(c: pb.ApplyCommand, ctx: SlotContext) -> float:
    """How long the agent waits for an apply (the command's own, else the default)."""
    return c.timeout_s or ctx.transfer_timeout_s


# ---------------------------------------------------------------------- command -> proto
def command_proto(cmd: SlotCommand, ctx: SlotContext, command_id: int = 0) -> pb.AgentCommand:
    """The controller command of one slot that `slot_command` turns into `cmd`."""
    out = pb.AgentCommand(command_id=command_id)
    if isinstance(cmd, Connect):
        out.connect.CopyFrom(
            pb.ConnectCommand(
                epoch=cmd.epoch,
                store_host=cmd.store_host,
                store_port=cmd.store_port,
                world_size=cmd.world_size,
                comm_rank=cmd.slot_ranks or {ctx.slot: cmd.rank},
                transport=cmd.transport,
                timeout_s=cmd.timeout_s,
                store_token=cmd.store_token,
            )
        )
    elif isinstance(cmd, Load):
        staged, snap = set(cmd.staged), set(cmd.snapshot)
        out.load.CopyFrom(
            pb.LoadProgramCommand(
                model=cmd.model,
                digest=cmd.digest,
                slot=ctx.slot,
                program=cmd.program,
                handles=[
                    pb.TensorHandle(index=i, memory=m, staged=i in staged, snapshot=i in snap)
                    for i, m in cmd.handles.items()
                ],
            )
        )
    elif isinstance(cmd, Execute):
        d = cmd.delta
        out.execute.CopyFrom(
            pb.ExecuteCommand(
                digest=cmd.digest,
                slot=ctx.slot,
                slots=[ctx.slot],
                version=cmd.version,
                refit_id=cmd.refit_id,
                timeout_s=cmd.timeout_s,
                verify=cmd.verify,
                delta=[]
                if d is None
                else [
                    pb.DeltaCommand(
                        slot=ctx.slot,
                        send=d.send,
                        recv=d.recv,
                        allowed=d.allowed,
                        promote=d.promote,
                        max_density=d.max_density,
                    )
                ],
            )
        )
    else:
        out.apply.CopyFrom(
            pb.ApplyCommand(digest=cmd.digest, slots=[ctx.slot], refit_id=cmd.refit_id)
        )
    return out


# ---------------------------------------------------------------------- reply -> proto
def outcome_of(reply: Loaded | Applied | Executed | None, kind: int, seconds: float) -> Outcome:
    """The report of a slot command's reply (None: connected)."""
    if isinstance(reply, Applied):
        return Outcome(kind, bytes_local=reply.bytes, seconds=reply.seconds)
    if not isinstance(reply, Executed):
        return Outcome(kind, seconds=seconds)
    r = reply.report
    sums = r.checksums or {}
    snap = reply.snapshot
    return Outcome(
        kind,
        snapshot_bytes=0 if snap is None else snap.bytes,
        snapshot_fallback="" if snap is None else snap.fallback,
        bytes_sent=r.sent_bytes,
        bytes_received=r.recv_bytes,
        bytes_local=r.local_bytes,
        seconds=r.seconds,
        checksums=tuple(
            pb.MessageChecksum(message_id=int(mid), sent=side == "send", checksum=h)
            for side in ("send", "recv")
            for mid, h in sums.get(side, {}).items()
        ),
        delta=None if reply.delta is None else delta_proto(reply.delta),
    )


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


def report_proto(
    agent_id: str, slot: int, command_id: int, refit_id: int, outcome: Outcome
) -> pb.AgentReport:
    """One slot's report of one command."""
    return pb.AgentReport(
        agent_id=agent_id,
        slot=slot,
        command_id=command_id,
        kind=outcome.kind,
        refit_id=refit_id,
        bytes_sent=outcome.bytes_sent,
        bytes_received=outcome.bytes_received,
        bytes_local=outcome.bytes_local,
        seconds=outcome.seconds,
        message=outcome.message,
        checksums=outcome.checksums,
        delta=outcome.delta,
        snapshot_bytes=outcome.snapshot_bytes,
        snapshot_fallback=outcome.snapshot_fallback,
    )
