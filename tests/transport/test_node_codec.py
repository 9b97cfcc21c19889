"""The node agent's proto boundary: controller commands become typed slot commands and back,
malformed ones are refused naming the field, and typed reports become report protos; the
slot protocol's table covers every command once on every side."""

from __future__ import annotations

import pickle
from collections.abc import Callable

import pytest

from refitd._proto import refitd_pb2 as pb
from refitd.node.codec import (
    CommandError,
    SlotContext,
    command_proto,
    decode,
    report_proto,
    target_slots,
)
from refitd.slot_protocol import (
    VERBS,
    WIRE_VERBS,
    Applied,
    Apply,
    Connect,
    Connected,
    DeltaResult,
    ExecReport,
    Execute,
    Executed,
    Failed,
    Load,
    Loaded,
    SlotCommand,
    SlotOptions,
    SnapshotInfo,
    SourcesReleased,
)

CTX = SlotContext(
    slot=3, data_plane_address="10.0.0.7", options=SlotOptions(connect_timeout_s=11.0)
)


def _commands() -> list[pb.AgentCommand]:
    return [
        pb.AgentCommand(
            command_id=1,
            connect=pb.ConnectCommand(
                epoch=4,
                store_host="10.0.0.1",
                store_port=29500,
                world_size=2,
                comm_rank={3: 1, 8: 0},
                transport="gloo",
                timeout_s=20.0,
                store_token="tok",
            ),
        ),
        pb.AgentCommand(
            command_id=2,
            load=pb.LoadProgramCommand(
                model="m",
                digest="abc",
                slot=3,
                program=b"\x01\x02",
                handles=[
                    pb.TensorHandle(index=0, memory=b"h0"),
                    pb.TensorHandle(index=5, memory=b"h5", staged=True),
                    pb.TensorHandle(index=6, memory=b"h6", snapshot=True),
                ],
            ),
        ),
        pb.AgentCommand(
            command_id=3,
            execute=pb.ExecuteCommand(
                digest="abc",
                slot=3,
                slots=[3],
                version=7,
                refit_id=70,
                timeout_s=30.0,
                verify=True,
                lane=2,
                share_weight=3.0,
                share_piece=1 << 20,
                delta=[
                    pb.DeltaCommand(
                        slot=3, send=[1, 2], recv=[9], allowed=[2], promote=6, max_density=0.25
                    )
                ],
            ),
        ),
        pb.AgentCommand(
            command_id=4,
            apply=pb.ApplyCommand(digest="abc", slots=[3], refit_id=70, timeout_s=12.0),
        ),
        pb.AgentCommand(command_id=5, abort=pb.AbortCommand(refit_id=70)),
    ]


@pytest.mark.parametrize("cmd", _commands(), ids=lambda c: c.WhichOneof("command"))
def test_a_command_round_trips_through_the_typed_command(cmd: pb.AgentCommand) -> None:
    typed = decode(cmd, CTX)
    back = command_proto(typed, CTX.slot, cmd.command_id)
    assert back == cmd, (typed, back)
    # what goes down the pipe to the transfer process
    assert pickle.loads(pickle.dumps((1, typed))) == (1, typed)


def test_a_command_takes_this_slot_s_rank_delta_and_the_agent_s_defaults() -> None:
    connect, load, execute, apply, _ = (decode(c, CTX) for c in _commands())
    assert isinstance(connect, Connect)
    assert (connect.rank, connect.slot_ranks) == (1, {3: 1, 8: 0})
    assert connect.data_plane_address == "10.0.0.7"
    assert isinstance(load, Load)
    assert (load.staged, load.snapshot) == ((5,), (6,))
    assert (load.staging_bytes, load.snapshot_bytes) == (
        CTX.options.staging_bytes,
        CTX.options.snapshot_bytes,
    )
    assert isinstance(apply, Apply) and apply.timeout_s == 12.0
    assert isinstance(execute, Execute) and execute.delta is not None
    assert (execute.delta.send, execute.delta.recv, execute.delta.promote) == ((1, 2), (9,), 6)
    other = pb.AgentCommand()
    other.CopyFrom(_commands()[2])
    other.execute.delta[0].slot = 4  # another slot's delta: this slot runs all dense
    other.execute.timeout_s = 0.0  # unset: the agent's default
    typed = decode(other, CTX)
    assert isinstance(typed, Execute)
    assert typed.delta is None and typed.timeout_s == CTX.options.transfer_timeout_s


@pytest.mark.parametrize(
    "kind, field, edit",
    [
        ("connect", "comm_rank", lambda c: c.connect.comm_rank.pop(3)),
        ("connect", "comm_rank", lambda c: c.connect.comm_rank.__setitem__(8, 5)),
        ("connect", "world_size", lambda c: setattr(c.connect, "world_size", 0)),
        ("connect", "store_port", lambda c: setattr(c.connect, "store_port", 70000)),
        ("connect", "timeout_s", lambda c: setattr(c.connect, "timeout_s", -1.0)),
        ("load", "digest", lambda c: setattr(c.load, "digest", "")),
        ("load", "program", lambda c: setattr(c.load, "program", b"")),
        ("load", "handles", lambda c: c.load.handles.add(index=5, memory=b"again")),
        ("execute", "digest", lambda c: setattr(c.execute, "digest", "")),
        ("execute", "delta", lambda c: c.execute.delta.add(slot=3)),
        (
            "execute",
            "delta.max_density",
            lambda c: setattr(c.execute.delta[0], "max_density", -0.5),
        ),
        ("execute", "timeout_s", lambda c: setattr(c.execute, "timeout_s", -2.0)),
        ("apply", "digest", lambda c: setattr(c.apply, "digest", "")),
    ],
)
def test_a_malformed_command_is_refused_naming_the_field(
    kind: str, field: str, edit: Callable[[pb.AgentCommand], object]
) -> None:
    cmd = next(c for c in _commands() if c.WhichOneof("command") == kind)
    edit(cmd)
    with pytest.raises(CommandError, match=rf"field {field}\b"):
        decode(cmd, CTX)


def test_a_command_without_a_known_field_is_refused() -> None:
    with pytest.raises(CommandError, match="field command is None"):
        decode(pb.AgentCommand(command_id=9), CTX)


def test_each_command_names_its_slots() -> None:
    connect, load, execute, apply, abort = _commands()
    held = {3, 4}
    assert target_slots(connect, held) == [3]  # slot 8 of the communicator is elsewhere
    assert target_slots(load, held) == [3]
    execute.execute.slots.append(5)  # a slot not held here is named (and reported failed)
    assert target_slots(execute, held) == [3, 5]
    assert target_slots(apply, held) == [3]
    assert target_slots(abort, held) == [3, 4]


def test_the_table_covers_every_command_on_every_side() -> None:
    """Every typed command has one verb; the controller's commands are decoded and encoded
    by the codec; the transfer slot answers every verb with the method the table names."""
    from refitd.node.codec import _CONVERSIONS
    from refitd.transfer.slot import TransferSlot

    # (a slots dataclass is a new class: its first draft stays listed as a subclass too)
    commands = {c.__name__ for c in SlotCommand.__subclasses__()}
    assert {c.__name__ for c in VERBS} == commands
    assert set(_CONVERSIONS) == {v.command for v in VERBS.values() if v.wire}
    oneof = pb.AgentCommand.DESCRIPTOR.oneofs_by_name["command"]
    assert set(WIRE_VERBS) == {f.name for f in oneof.fields}
    assert all(callable(getattr(TransferSlot, v.handler, None)) for v in VERBS.values())


def test_typed_reports_become_the_report_proto() -> None:
    report = ExecReport(slot=3, seconds=0.5, local_bytes=10, sent_bytes=300, recv_bytes=200)
    report.checksums = {"send": {4: 11}, "recv": {5: 12}}
    delta = DeltaResult(
        promoted=True,
        base_version=6,
        pending_version=7,
        base_bytes=4096,
        sent={4: {"kind": 1, "changed": 3, "elements": 64, "nbytes": 40, "dense_nbytes": 128}},
        received={},
        encode_s=0.01,
        apply_s=0.02,
        seconds=0.05,
        wire_bytes=40,
        recv_bytes=0,
    )
    executed = Executed(report, 7, 70, delta=delta, snapshot=SnapshotInfo(1024, ""))
    got = report_proto("agent-1", 3, 33, 70, executed, 9.0)
    want = pb.AgentReport(
        agent_id="agent-1",
        slot=3,
        command_id=33,
        kind=pb.REPORT_KIND_DONE,
        refit_id=70,
        bytes_sent=300,
        bytes_received=200,
        bytes_local=10,
        seconds=0.5,
        checksums=[
            pb.MessageChecksum(message_id=4, sent=True, checksum=11),
            pb.MessageChecksum(message_id=5, sent=False, checksum=12),
        ],
        delta=pb.DeltaOutcome(
            base_version=6,
            pending_version=7,
            base_bytes=4096,
            encode_s=0.01,
            apply_s=0.02,
            sent=[
                pb.DeltaMessageStat(
                    message_id=4, delta=True, changed=3, elements=64, nbytes=40, dense_nbytes=128
                )
            ],
        ),
        snapshot_bytes=1024,
    )
    assert got == want
    applied = report_proto("a", 3, 34, 0, Applied(bytes=512, seconds=0.25), 9.0)
    assert (applied.kind, applied.bytes_local, applied.seconds) == (pb.REPORT_KIND_DONE, 512, 0.25)
    connected = report_proto("a", 3, 35, 0, Connected(("d1", "d2")), 1.5)
    assert (connected.kind, connected.seconds) == (pb.REPORT_KIND_CONNECTED, 1.5)
    assert list(connected.loaded_plans) == ["d1", "d2"]
    loaded = report_proto("a", 3, 36, 0, Loaded(SnapshotInfo(64, "")), 2.5)
    assert (loaded.kind, loaded.seconds, loaded.snapshot_bytes) == (pb.REPORT_KIND_LOADED, 2.5, 0)
    released = report_proto("a", 3, 33, 70, SourcesReleased(t=1.0), 0.0)
    assert (released.kind, released.refit_id) == (pb.REPORT_KIND_SOURCES_RELEASED, 70)
    failed = report_proto("a", 3, 37, 0, Failed("ExecutionError", "slot 3: boom"), 0.5)
    assert (failed.kind, failed.message, failed.seconds) == (
        pb.REPORT_KIND_FAILED,
        "slot 3: boom",
        0.5,
    )
