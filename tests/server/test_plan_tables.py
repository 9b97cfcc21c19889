"""The controller's per-model SpecTables follow registrations; `refitd bench load` runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from refitd._proto import refitd_pb2 as pb
from refitd._proto import refitd_pb2_grpc as pbg
from refitd.plan.program import encode_program
from refitd.server.controller import Controller

from .conftest import Cluster, make_cluster, register

pytestmark = pytest.mark.slow


def _kept(c: Controller, model: str) -> tuple[set, set]:
    """(source, destination) specs of the model's kept tables, rebuilt if stale."""
    reg = c.registry
    with reg.lock:
        m = reg.model(model)
        workers = [reg.workers[w] for p in m.pools.values() for w in p.ranks.values()]
        src, dst = m.tables.snapshot(
            lambda: (
                [t for w in workers if w.role == "source" for t in w.specs],
                [t for w in workers if w.role == "destination" for t in w.specs],
            )
        )
        m.tables.release()
        return set(src.specs), set(dst.specs)


def _registered(c: Controller, model: str) -> tuple[set, set]:
    with c.registry.lock:
        ws = [w for w in c.registry.workers.values() if w.model == model]
        return (
            {t for w in ws if w.role == "source" for t in w.specs},
            {t for w in ws if w.role == "destination" for t in w.specs},
        )


def test_tables_follow_registrations(controller: Controller, cluster: Cluster) -> None:
    tables = controller.registry.model(cluster.model).tables
    assert not tables.stale and _kept(controller, cluster.model) == _registered(
        controller, cluster.model
    )
    assert all(r.state == pb.REFIT_STATE_COMMITTED for r in cluster.refit(1))
    plan = controller.refits.memberships.cached(cluster.model).plan
    assert plan.built_programs == len(plan.slots) == 3  # built as they were loaded

    # a rank registering the same layout again (a restart: new memory, new epoch) keeps
    # the tables and the plan; only its slot gets its program again
    epoch = controller.registry.model(cluster.model).epoch
    built, sent = controller.refits.plans.built, controller.refits.plans.programs_sent
    resp = register(
        cluster.stub, cluster.model, "trainer", pb.ROLE_SOURCE, 0, 2, cluster.host, "cpu:0"
    )
    cluster.trainers[0] = resp.worker_id
    assert not tables.stale and controller.registry.model(cluster.model).epoch > epoch
    assert all(r.state == pb.REFIT_STATE_COMMITTED for r in cluster.refit(2))
    assert controller.refits.memberships.cached(cluster.model).plan is plan
    assert controller.refits.plans.built == built
    assert controller.refits.plans.programs_sent == sent + 1

    # a replaced rank that moved cannot be removed from the columns: the tables are rebuilt
    resp = register(
        cluster.stub, cluster.model, "trainer", pb.ROLE_SOURCE, 0, 2, cluster.host, "cpu:1"
    )
    cluster.trainers[0] = resp.worker_id
    assert tables.stale
    assert all(r.state == pb.REFIT_STATE_COMMITTED for r in cluster.refit(3))
    assert not tables.stale and tables.rebuilds == 1
    assert _kept(controller, cluster.model) == _registered(controller, cluster.model)
    assert controller.refits.memberships.cached(cluster.model).plan.digest != plan.digest
    assert controller.refits.plans.built == built + 1

    # a new rank of a new pool is appended
    register(cluster.stub, cluster.model, "extra", pb.ROLE_DESTINATION, 0, 1, cluster.host, "cpu:0")
    assert not tables.stale
    assert _kept(controller, cluster.model) == _registered(controller, cluster.model)
    # a rank that left keeps its rows until the next snapshot, which rebuilds without it
    rebuilds = tables.rebuilds
    cluster.stub.UnregisterWorker(
        pb.UnregisterWorkerRequest(worker_id=_extra_id(controller, cluster.model)), timeout=10
    )
    assert _kept(controller, cluster.model) == _registered(controller, cluster.model)
    assert tables.rebuilds == rebuilds + 1


def test_a_rank_back_with_its_layout_after_leaving_keeps_the_tables(
    controller: Controller, cluster: Cluster
) -> None:
    """A rank that left (unregistered, as when its lease ran out) and registers the same
    layout again finds its rows in place: no rebuild (a second at 786k tensors), the same
    plan."""
    assert all(r.state == pb.REFIT_STATE_COMMITTED for r in cluster.refit(1))
    tables = controller.registry.model(cluster.model).tables
    plan = controller.refits.memberships.cached(cluster.model).plan
    rebuilds, built = tables.rebuilds, controller.refits.plans.built
    cluster.stub.UnregisterWorker(
        pb.UnregisterWorkerRequest(worker_id=cluster.trainers[1]), timeout=10
    )
    resp = register(
        cluster.stub, cluster.model, "trainer", pb.ROLE_SOURCE, 1, 2, cluster.host, "cpu:1"
    )
    cluster.trainers[1] = resp.worker_id
    assert not tables.stale
    assert all(r.state == pb.REFIT_STATE_COMMITTED for r in cluster.refit(2))
    assert tables.rebuilds == rebuilds and controller.refits.plans.built == built
    assert controller.refits.memberships.cached(cluster.model).plan is plan
    assert _kept(controller, cluster.model) == _registered(controller, cluster.model)


def _loads(cl: Cluster) -> dict[int, list[tuple[int, bytes]]]:
    """Per slot, the (index, memory) handles of the last program its agent was sent."""
    return {
        c.load.slot: [(h.index, h.memory) for h in c.load.handles]
        for c in cl.agent.commands
        if c.WhichOneof("command") == "load"
    }


def test_a_reconnect_sends_no_program(
    controller: Controller, cluster: Cluster, stub: pbg.RefitStub
) -> None:
    """Another model's refit rebuilds the communicator for its own slots, so this model's
    next refit connects again: its transfer processes keep their programs across the new
    communicator epoch, so no program and no memory handle goes out again (at 1,024 ranks
    sending them all takes seconds)."""
    assert all(r.state == pb.REFIT_STATE_COMMITTED for r in cluster.refit(1))
    first = _loads(cluster)
    assert len(first) == 3 and all(first.values())
    other = make_cluster(controller, stub)
    try:
        assert all(r.state == pb.REFIT_STATE_COMMITTED for r in other.refit(1))
    finally:
        other.stop()
    commander = controller.refits.commander
    built, sent = commander.handles.built, controller.refits.plans.programs_sent
    cluster.agent.commands.clear()
    assert all(r.state == pb.REFIT_STATE_COMMITTED for r in cluster.refit(2))
    verbs = [c.WhichOneof("command") for c in cluster.agent.commands]
    assert "connect" in verbs and "load" not in verbs
    assert controller.refits.plans.programs_sent == sent
    assert commander.handles.built == built


def _extra_id(c: Controller, model: str) -> str:
    with c.registry.lock:
        return c.registry.model(model).pools["extra"].ranks[0]


@pytest.mark.timeout(120)
def test_bench_load_tiny() -> None:
    """Metadata workers through gRPC, real refits of the small model, one JSON line."""
    proc = subprocess.run(
        [
            sys.executable, "-m", "refitd.cli.main", "bench", "load",
            "--workers", "32", "--refits", "10", "--warmup", "1", "--preset", "llama3-8b",
            "--trainer-layout", "tp=2,pp=2", "--inference-layout", "tp=2",
        ],
        capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["meta_workers"] == 32 and doc["meta_slots"] == 32
    assert doc["refits_recorded"] == 10
    assert doc["meta_table_rebuilds"] == 0  # planned from the tables kept at registration
    assert doc["control_start_p99_ms"] > 0 and doc["rss_loop_end_mb"] > 0
    # the controller planned the metadata model ahead, before the loop (plan_ahead)
    assert doc["meta_plan_ahead_wait_s"] > 0 and doc["rss_planned_mb"] > doc["rss_idle_mb"]
    # the plan from a planning process: the same programs as one built in the bench's process
    assert doc["meta_plan_process_same_programs"] is True
    assert doc["meta_plan_s"] > 0 and doc["meta_all_programs_s"] > 0
    assert doc["meta_heartbeats"] > 0 and doc["meta_heartbeats_refused"] == 0
    assert doc["meta_heartbeat_rtt_max_planning_process_s"] >= 0
    assert doc["meta_heartbeat_rtt_max_planning_in_process_s"] >= 0


def test_program_index_released_once_every_program_is_encoded() -> None:
    """A controller plan drops its program index after the last slot's payload (it holds
    every encoded program); a later program() rebuilds the same programs."""
    from refitd.bench.presets import Parallel, build_specs, preset
    from refitd.server.planning import PlanOptions, make_plan

    m = preset("llama3-8b")
    src = build_specs(m, Parallel.parse("tp=2,pp=2", 4), "m", "trainer", 0)
    dst = build_specs(m, Parallel.parse("tp=2", 2), "m", "infer", 4)
    cp = make_plan("m", 1, src, dst, PlanOptions(bucket_bytes=64 << 20))
    encoded = {}
    for k, slot in enumerate(cp.slots):
        encoded[slot] = cp.load_payload(slot).program
        assert (cp.plan._index is None) == (k == len(cp.slots) - 1)  # built once, kept
    assert len(cp.slots) > 1
    assert {s: encode_program(cp.plan.program(s)) for s in cp.slots} == encoded


def test_a_worker_added_while_a_plan_reads_the_tables_joins_without_a_rebuild() -> None:
    """A pool registering while the model's plan is built (ahead) for the pools before it
    is appended at the next snapshot once no build reads the tables; if a build still
    does, that snapshot rebuilds them instead (the tables a build reads never change)."""
    from refitd.bench.presets import Parallel, build_specs, preset
    from refitd.plan.table import SpecTable
    from refitd.server.model_tables import ModelTables

    m = preset("llama3-8b")
    src = build_specs(m, Parallel.parse("tp=2", 2), "m", "trainer", 0)
    dst = build_specs(m, Parallel.parse("tp=2", 2), "m", "infer", 2)
    late = build_specs(m, Parallel.parse("tp=2", 2), "m", "late", 4)

    def worker(specs: list, rank: int) -> SpecTable:
        return SpecTable.of_worker([s for s in specs if s.rank == rank])

    def current() -> tuple[list, list]:
        return src, dst + late

    for still_reading in (False, True):
        tables = ModelTables()
        for r in range(2):
            tables.add("source", worker(src, r))
            tables.add("destination", worker(dst, r))
        _, d_tab = tables.snapshot(current)  # a build starts
        n_dst = len(d_tab)
        for r in range(2):
            tables.add("destination", worker(late, r))
        assert len(d_tab) == n_dst  # the build's tables did not grow
        if not still_reading:
            tables.release()
        s2, d2 = tables.snapshot(current)
        assert set(d2.specs) == set(dst + late) and set(s2.specs) == set(src)
        assert tables.rebuilds == (1 if still_reading else 0)
        assert (d2 is d_tab) == (not still_reading)
