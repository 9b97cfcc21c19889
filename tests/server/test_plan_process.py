"""Refit plans built by a forked planning process: the same plan and programs as one built
in the controller's process; a child that dies, overruns its time or meets a bad layout
fails that plan with an error naming it, and the next plan forks a fresh one."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from refitd.bench.presets import Parallel, build_specs, preset
from refitd.plan.program import encode_program
from refitd.plan.table import SpecTable
from refitd.server.errors import ControlError, ErrorKind
from refitd.server.plan_process import PlanningProcess
from refitd.server.planning import PlanOptions, make_digest, make_plan, planner_config

OPTIONS = PlanOptions(bucket_bytes=1 << 20, relay=True)


def _tables(dst_pools: int = 2) -> tuple[SpecTable, SpecTable]:
    """llama3-8b: trainer tp=4,pp=2 (8 ranks), `dst_pools` inference pools of tp=2."""
    model = preset("llama3-8b")
    src = build_specs(model, Parallel.parse("tp=4,pp=2", 8), "m", "trainer", 0)
    dst = []
    for i in range(dst_pools):
        dst += build_specs(model, Parallel.parse("tp=2", 2), "m", f"infer-{i}", 8 + 2 * i)
    return SpecTable.from_specs(src), SpecTable.from_specs(dst)


def test_forked_plan_equals_the_plan_built_here() -> None:
    src, dst = _tables()
    here = make_plan("m", 3, src, dst, OPTIONS)
    process = PlanningProcess(timeout_s=120)
    digest = make_digest("m", src, dst, OPTIONS)
    forked = make_plan("m", 3, src, dst, OPTIONS, digest=digest, process=process)
    assert process.started == 1 and process.died == 0 and process.last_pid > 0
    assert forked.digest == here.digest == digest
    assert forked.slots == here.slots and forked.stats == here.stats
    assert forked.built_programs == len(forked.slots)  # every program came back built
    # the workers on each slot, straight from the registrations
    on_slot: dict[int, set[tuple[str, int]]] = {}
    for t in src.specs + dst.specs:
        on_slot.setdefault(t.slot, set()).add((t.pool, t.rank))
    for slot in here.slots:
        assert forked.holders(slot) == tuple(sorted(on_slot[slot]))
        assert forked.program_bytes(slot) == here.program_bytes(slot)
        assert np.array_equal(forked.load_payload(slot).tensors, here.load_payload(slot).tensors)
        assert forked.holders(slot) == here.holders(slot)
        assert [t for _, t in forked.held(forked.load_payload(slot))] == [
            t for _, t in here.held(here.load_payload(slot))
        ]
    for rank in range(8):
        assert forked.readers("trainer", rank) == here.readers("trainer", rank)
        assert forked.readers("trainer", rank)  # every trainer rank is read by some slot
    assert forked.traffic() == here.traffic()
    # the planner's Plan, for its rare users, is the same plan built again here
    assert forked.plan.digest == digest and forked.plan.stats == here.stats


def test_forked_plan_keeps_the_tables_as_they_were() -> None:
    """Tables grown after the plan (a worker registered) leave the plan's inputs intact."""
    src, dst = _tables(1)
    forked = make_plan("m", 1, src, dst, OPTIONS, process=PlanningProcess(timeout_s=120))
    here = make_plan("m", 1, src, dst, OPTIONS)
    before = list(src.specs) + list(dst.specs)
    dst.extend(_tables(2)[1])  # more destination rows appended to the kept table
    for plan in (forked, here):  # plan index -> spec as planned, in both processes' plans
        assert len(plan.tensors) == len(before) and list(plan.tensors) == before
        assert plan.tensors[-1] is before[-1] and plan.tensors[len(src)] is dst.specs[0]
        assert plan.tensors[len(src) - 2 : len(src) + 2] == before[len(src) - 2 : len(src) + 2]
        with pytest.raises(IndexError):
            plan.tensors[len(before)]
    assert forked.plan.digest == forked.digest  # rebuilt from the first rows only


def test_a_killed_planning_process_is_counted_and_the_plan_is_built_here() -> None:
    """A child that dies (killed, out of memory) never fails the refit: the controller
    plans in its own process, the same plan, and the next plan forks a new child."""
    src, dst = _tables()
    process = PlanningProcess(timeout_s=120, on_start=lambda pid: os.kill(pid, signal.SIGKILL))
    plan = make_plan("m", 1, src, dst, OPTIONS, process=process)
    assert process.died == 1 and plan.digest == make_digest("m", src, dst, OPTIONS)
    assert plan.program_bytes(plan.slots[0]) == encode_program(plan.plan.program(plan.slots[0]))
    process.on_start = None
    plan = make_plan("m", 1, src, dst, OPTIONS, process=process)
    assert process.started == 2 and process.died == 1
    assert plan.digest == make_digest("m", src, dst, OPTIONS)


def test_a_killed_planning_process_is_reported_naming_its_pid_and_signal() -> None:
    src, dst = _tables()
    process = PlanningProcess(timeout_s=120, on_start=lambda pid: os.kill(pid, signal.SIGKILL))
    with pytest.raises(ControlError) as e:
        process.build("m", 1, src, dst, planner_config(OPTIONS), None)
    assert e.value.kind == ErrorKind.UNAVAILABLE
    assert f"planning process (pid {process.last_pid})" in e.value.message
    assert "signal 9 (SIGKILL)" in e.value.message and "'m'" in e.value.message


def test_a_planning_process_past_its_time_is_killed_and_the_plan_built_here() -> None:
    src, dst = _tables()
    stopped: list[int] = []

    def stop(pid: int) -> None:  # a child that makes no progress
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)

    process = PlanningProcess(timeout_s=0.2, on_start=stop)
    with pytest.raises(ControlError, match=r"did not finish within 0.2 s and was killed"):
        process.build("m", 1, src, dst, planner_config(OPTIONS), None)
    with pytest.raises(ProcessLookupError):  # killed and reaped
        os.kill(stopped[0], 0)
    plan = make_plan("m", 1, src, dst, OPTIONS, process=process)
    assert process.died == 2 and plan.digest == make_digest("m", src, dst, OPTIONS)


def test_a_bad_layout_fails_in_the_planning_process_naming_the_tensor() -> None:
    src, dst = _tables()
    # the destination asks for a tensor no source registers
    lost = SpecTable.from_specs([t for t in src.specs if "linear_qkv" not in t.canonical])
    with pytest.raises(ControlError) as e:
        make_plan("m", 1, lost, dst, OPTIONS, process=PlanningProcess(timeout_s=120))
    assert e.value.kind == ErrorKind.PRECONDITION
    assert e.value.message.startswith("plan of model 'm' epoch 1: ")
    assert "linear_qkv" in e.value.message


def test_no_planning_process_while_grpc_fork_handlers_are_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """With gRPC's fork handlers on, a fork would break gRPC: the coordinator plans in its
    own process instead."""
    from refitd.config import Settings
    from refitd.server.refit.coordinator import RefitCoordinator

    settings = Settings(data_dir=str(tmp_path))
    assert isinstance(RefitCoordinator._planner(settings), PlanningProcess)
    monkeypatch.setenv("GRPC_ENABLE_FORK_SUPPORT", "1")
    assert RefitCoordinator._planner(settings) is None
    monkeypatch.delenv("GRPC_ENABLE_FORK_SUPPORT")
    assert RefitCoordinator._planner(settings) is None
    monkeypatch.setenv("GRPC_ENABLE_FORK_SUPPORT", "false")
    assert RefitCoordinator._planner(Settings(data_dir=str(tmp_path), plan_process=False)) is None
