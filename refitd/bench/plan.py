"""`refitd bench plan`: build a preset model's layouts and time the whole-cluster plan.

Prints one JSON line. plan_s: build_plan from the TensorSpec lists to a finished Plan;
table_build_s: turning the lists into SpecTables (a controller can do this as workers
register); plan_from_table_s: build_plan_from_table; spec_scan_s: same-run reference, one
Python pass over every spec. The timed calls run inside a GcPause owned by the bench, as
the controller runs its plan builds (--no-gc-pause: with the collector on). megatron_s:
Megatron-Core's central plan build for every destination rank in the same run, under the
same pause (refitd/bench/plan_megatron.py), and ratio_to_megatron = plan_s / megatron_s;
without Megatron-Core installed, `megatron` says so and no figure is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import json
import resource
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from refitd.bench.presets import Parallel, Preset
    from refitd.plan.plan import Plan


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama3-8b", help="llama3-8b, llama3-70b or kimi-k2")
    p.add_argument("--src", default="tp=8", help="source layout, e.g. tp=8,pp=8,ep=32")
    p.add_argument("--src-world", type=int, default=8)
    p.add_argument("--dst", default="tp=4", help="destination layout, e.g. tp=8,ep=32")
    p.add_argument("--dst-world", type=int, default=4)
    p.add_argument("--collocated", action="store_true", help="destinations share source slots")
    p.add_argument(
        "--relay",
        action="store_true",
        help="let destination replicas forward blocks (PlanConfig.relay)",
    )
    p.add_argument("--bucket-mib", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3, help="plan builds timed; the best is reported")
    p.add_argument(
        "--programs",
        action="store_true",
        help="also build and encode every slot's program (programs_s, program_bytes_*, "
        "decode_s_max, replan_s)",
    )
    p.add_argument(
        "--no-megatron",
        action="store_true",
        help="skip the Megatron-Core reference (megatron_s) even when it is installed",
    )
    p.add_argument(
        "--no-gc-pause",
        action="store_true",
        help="time with the cyclic garbage collector on (default: paused, as the controller does)",
    )


def run(args: argparse.Namespace) -> int:
    from refitd.bench.presets import Parallel, build_specs, preset
    from refitd.plan.gc_pause import GcPause
    from refitd.plan.planner import PlanConfig, build_plan, build_plan_from_table
    from refitd.plan.program import encode_program
    from refitd.plan.table import SpecTable
    from refitd.server.heap import keep_plan_heap

    keep_plan_heap()  # as the controller does at start
    model = preset(args.model)
    src_par = Parallel.parse(args.src, args.src_world)
    dst_par = Parallel.parse(args.dst, args.dst_world)
    if args.collocated and args.dst_world > args.src_world:
        print("--collocated needs dst-world <= src-world", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    sources = build_specs(model, src_par, args.model, "trainer", 0)
    dst_base = 0 if args.collocated else args.src_world
    destinations = build_specs(model, dst_par, args.model, "inference", dst_base)
    build_s = time.perf_counter() - t0
    config = PlanConfig(bucket_bytes=args.bucket_mib << 20, relay=args.relay)
    repeat = max(args.repeat, 1)
    pause = contextlib.nullcontext() if args.no_gc_pause else GcPause()

    def best(f: Callable[[], object]) -> tuple[float, list[float], object]:
        return _best(f, repeat, pause)

    # same-run reference: one Python pass reading one field of every TensorSpec, the
    # floor of any planner that starts from the lists
    scan_s, _, _ = best(lambda: sum(s.slot for s in sources) + sum(s.slot for s in destinations))
    table_s, _, tables = best(
        lambda: (SpecTable.from_specs(sources), SpecTable.from_specs(destinations))
    )
    src_t, dst_t = tables  # type: ignore[misc]
    from_table_s, _, _ = best(lambda: build_plan_from_table(args.model, 0, src_t, dst_t, config))
    plan_s, times, plan = best(lambda: build_plan(args.model, 0, sources, destinations, config))
    t0 = time.perf_counter()
    with pause:
        program = plan.program(plan.slots()[0])  # type: ignore[attr-defined]
    program_s = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = {
        "bench": "plan",
        "model": args.model,
        "src": f"{args.src} world={args.src_world}",
        "dst": f"{args.dst} world={args.dst_world}",
        "collocated": args.collocated,
        "relay": args.relay,
        "gc_paused": not args.no_gc_pause,
        "tensors": len(sources) + len(destinations),
        "specs_build_s": round(build_s, 3),
        "plan_s": round(plan_s, 4),
        "plan_s_runs": [round(t, 4) for t in times],
        "table_build_s": round(table_s, 4),
        "plan_from_table_s": round(from_table_s, 4),
        "spec_scan_s": round(scan_s, 4),
        "plan_vs_spec_scan": round(plan_s / scan_s, 1) if scan_s else None,
        "program_slot0_s": round(program_s, 4),
        "program_slot0_bytes": len(encode_program(program)),
        **_stat_fields(plan.stats),  # type: ignore[attr-defined]
        "peak_rss_bytes": peak,
    }
    if args.programs:
        out.update(_programs(args, src_t, dst_t, config, from_table_s, pause))
    # last: Megatron-Core's import loads modules of its own (triton, sympy) that the
    # controller's path (its planning processes are forked) does not carry
    out.update(_megatron(args, model, src_par, dst_par, dst_base, best, plan_s))
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(out))
    return 0


def _best(
    f: Callable[[], object], repeat: int, pause: contextlib.AbstractContextManager
) -> tuple[float, list[float], object]:
    """(best seconds, every run's seconds, the last result) of `repeat` runs of f, each
    after a full collection and inside `pause`."""
    times, result = [], None
    for _ in range(repeat):
        result = None
        gc.collect()
        t = time.perf_counter()
        with pause:
            result = f()
        times.append(time.perf_counter() - t)
    return min(times), times, result


def _megatron(
    args: argparse.Namespace,
    model: Preset,
    src_par: Parallel,
    dst_par: Parallel,
    dst_base: int,
    best: Callable[[Callable[[], object]], tuple[float, list[float], object]],
    plan_s: float,
) -> dict[str, Any]:
    """The Megatron-Core reference fields (plan_megatron.reference) and plan_s's ratio."""
    if args.no_megatron:
        return {"megatron": "skipped (--no-megatron)"}
    from refitd.bench.plan_megatron import reference

    out = reference(model, src_par, dst_par, dst_base, best)
    if "megatron_s" in out:
        out["ratio_to_megatron"] = round(plan_s / out["megatron_s"], 3)
    return out


def _stat_fields(s: Any) -> dict[str, Any]:
    """The plan statistics the JSON line reports (PlanStats fields, rounded)."""
    return {
        "copies": s.copies,
        "local_copies": s.local_copies,
        "messages": s.messages,
        "rounds": s.rounds,
        "total_bytes": s.total_bytes,
        "local_bytes": s.local_bytes,
        "max_send_bytes": s.max_send_bytes,
        "source_max_send_bytes": s.source_max_send_bytes,
        "ideal_send_bytes": round(s.ideal_send_bytes),
        "send_imbalance": round(s.send_imbalance, 5),
        "relay_bytes": s.relay_bytes,
        "relay_copies": s.relay_copies,
        "max_recv_bytes": s.max_recv_bytes,
    }


def _programs(
    args: argparse.Namespace,
    src_t,
    dst_t,
    config,
    from_table_s: float,
    pause: contextlib.AbstractContextManager,
) -> dict:
    """The controller's path after registration: plan from tables, then every slot's
    program built and encoded (one pass), with the longest stall of another thread
    meanwhile; the largest decoded; then the membership changes (see _replan and
    _add_replica)."""
    from refitd.plan.planner import build_plan_from_table
    from refitd.plan.program import decode_program, encode_program

    gc.collect()
    with pause:
        plan = build_plan_from_table(args.model, 0, src_t, dst_t, config)

    def encode_all(plan: Plan) -> dict[int, bytes]:
        plan.release_index()  # every pass builds the index again, as a new plan does
        return {s: encode_program(p) for s, p in plan.programs().items()}

    # as the controller does it (inside the caller's GcPause unless --no-gc-pause)
    programs_s, _, encoded = _best(functools.partial(encode_all, plan), max(args.repeat, 1), pause)
    # one more pass beside a ticker: how long another thread (a gRPC handler) could be
    # held up meanwhile (timed apart: the ticker's own wakes slow the pass it watches)
    with Ticker() as ticker, pause:
        encode_all(plan)
    sizes = {s: len(b) for s, b in encoded.items()}
    big = max(sizes, key=sizes.__getitem__)
    t0 = time.perf_counter()
    decode_program(encoded[big], big)
    decode_s = time.perf_counter() - t0
    del encoded, plan
    out = {
        "programs": len(sizes),
        "programs_s": round(programs_s, 4),
        "controller_path_s": round(from_table_s + programs_s, 4),
        "program_bytes_total": sum(sizes.values()),
        "program_bytes_max": sizes[big],
        "decode_s_max": round(decode_s, 4),
        "thread_stall_ms_max": round(ticker.worst * 1e3, 1),
    }
    out.update(_process_path(args, src_t, dst_t, config, pause))
    out.update(_replan(args, src_t, dst_t, config, pause))
    # peak_rss_bytes (printed last) includes the second replica's plans; this one not
    out["peak_rss_before_replica_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out.update(_add_replica(args, src_t, dst_t, config, pause))
    return out


def _process_path(args: argparse.Namespace, src_t, dst_t, config, pause) -> dict:
    """The controller's path as `refitd serve` runs it: the plan and every program built by
    a planning process (refitd/server/plan_process.py), best of --repeat: its own plan
    and program times, the wall time here (fork to the programs mapped), and the longest
    stall of a thread of this process meanwhile."""
    from refitd.server.plan_process import PlanningProcess
    from refitd.server.planning import make_digest, make_plan

    options = _options(args, config)
    digest = make_digest(args.model, src_t, dst_t, options)
    runs = []
    for _ in range(max(args.repeat, 1)):
        process = PlanningProcess()
        with Ticker() as ticker:
            t0 = time.perf_counter()
            make_plan(args.model, 0, src_t, dst_t, options, _gc_pause(pause), digest, process)
            wall = time.perf_counter() - t0
        runs.append((wall, process.last_timings, ticker.worst))
    wall, child, stall = min(runs, key=lambda r: r[0])
    return {
        "process_plan_s": round(child["plan_s"], 4),
        "process_programs_s": round(child["programs_s"], 4),
        "process_path_s": round(child["plan_s"] + child["programs_s"], 4),
        "process_wall_s": round(wall, 4),
        "process_thread_stall_ms_max": round(stall * 1e3, 1),
    }


def _gc_pause(pause: contextlib.AbstractContextManager):
    """The bench's GcPause for make_plan (None with --no-gc-pause)."""
    from refitd.plan.gc_pause import GcPause

    return pause if isinstance(pause, GcPause) else None


def _options(args: argparse.Namespace, config):
    from refitd.server.planning import PlanOptions

    return PlanOptions(bucket_bytes=config.bucket_bytes, relay=args.relay)


def _replan(args: argparse.Namespace, src_t, dst_t, config, pause) -> dict:
    """One inference rank registers again with new memory handles (a restart), through
    the controller's path (refitd.server.planning, as the registry and the refit driver
    call it): the same-layout check of the registry, the digest of the kept tables, the
    plan cache lookup, the slots whose programs go out again (their workers' registrations
    changed) and those programs with the rank's new handles. replan_s: all of it."""
    from refitd.server.planning import PlanCache, make_digest, make_plan, stale_slots

    options = _options(args, config)
    cache = PlanCache(4)
    cp = make_plan(args.model, 0, src_t, dst_t, options, _gc_pause(pause))
    cache.put(cp)
    for slot in cp.slots:
        cp.load_payload(slot)  # every slot loaded once (the first refit)
    ident = {(t.pool, t.rank): "1" for t in [*src_t.specs, *dst_t.specs]}
    loaded = {}
    for slot, inputs in stale_slots(cp, lambda s: None, ident.__getitem__).items():
        loaded[slot] = inputs
    rank = 0
    old = tuple(t for t in dst_t.specs if t.rank == rank)
    new = tuple(copy.copy(t) for t in old)  # the restarted rank's registration: equal values
    memory = {t.name: b"new-handle" for t in new}
    gc.collect()
    t0, c0 = time.perf_counter(), time.process_time()
    with pause:
        same_layout = old == new
        ident[(new[0].pool, rank)] = "2"
        digest = make_digest(args.model, src_t, dst_t, options)
        hit = cache.get(digest)
        assert hit is not None and same_layout
        todo = stale_slots(hit, loaded.__getitem__, ident.__getitem__)
        handles = [
            [(i, memory.get(t.name, b"")) for i, t in hit.held(hit.load_payload(slot))]
            for slot in todo
        ]
    replan_s, replan_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    assert all(handles)
    return {
        "replan_s": round(replan_s, 4),
        "replan_cpu_s": round(replan_cpu_s, 4),
        "replan_reuses_plan": hit is cp,
        "replan_programs_sent": len(todo),
    }


def _add_replica(args: argparse.Namespace, src_t, dst_t, config, pause) -> dict:
    """A second dp replica (a new destination pool of the same layout on new slots) joins,
    through the controller's path: each new rank's specs are tabulated as it registers
    (add_replica_register_s, registration work, outside the planning figures), appended to
    the kept destination table; the new plan (a new layout: every slot's program again);
    the catch-up plan from the first replica's ranks (each joining rank copied from a rank
    of its layout: a twin plan) with its programs. add_replica_s: all of that planning
    work; add_replica_join_s: what the joining replica waits for before its catch-up (the
    table add and the catch-up), the new plan being the next refit's."""
    from refitd.bench.presets import Parallel, build_specs, preset
    from refitd.plan.table import SpecTable
    from refitd.server.planning import make_catch_up_plan, make_digest, make_plan

    options = _options(args, config)
    dst_par = Parallel.parse(args.dst, args.dst_world)
    base = (0 if args.collocated else args.src_world) + args.dst_world
    replica = build_specs(preset(args.model), dst_par, args.model, "inference-2", base)
    held = [SpecTable.of_worker(w) for w in _by_rank(dst_t.specs)]
    grown = SpecTable.from_tables(held)
    gc_pause = _gc_pause(pause)
    gc.collect()
    t0 = time.perf_counter()
    joining = [SpecTable.of_worker(w) for w in _by_rank(replica)]
    register_s = time.perf_counter() - t0
    t0, c0 = time.perf_counter(), time.process_time()
    for table in joining:  # as its ranks register
        grown.extend(table)
    table_s = time.perf_counter() - t0
    make_digest(args.model, src_t, grown, options)
    cp = make_plan(args.model, 1, src_t, grown, options, gc_pause)
    new_plan_s = time.perf_counter() - t0 - table_s
    with pause:
        cp.plan.programs()  # one index pass, then each slot's payload
        for slot in cp.slots:
            cp.load_payload(slot)
    plan_s, plan_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    t0, c0 = time.perf_counter(), time.process_time()
    catch = make_catch_up_plan(args.model, 1, held, joining, options, gc_pause)
    with pause:
        for slot in catch.slots:
            catch.load_payload(slot)
    catch_up_s, catch_up_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    return {
        "add_replica_s": round(plan_s + catch_up_s, 4),
        "add_replica_join_s": round(table_s + catch_up_s, 4),
        "add_replica_cpu_s": round(plan_cpu_s + catch_up_cpu_s, 4),
        "add_replica_register_s": round(register_s, 4),
        "add_replica_plan_s": round(plan_s, 4),
        "add_replica_table_add_s": round(table_s, 4),
        "add_replica_new_plan_s": round(new_plan_s, 4),
        "add_replica_catch_up_s": round(catch_up_s, 4),
        "add_replica_programs": len(cp.slots) + len(catch.slots),
    }


def _by_rank(specs: list) -> list[list]:
    """Specs grouped per worker rank, in rank order (one registration each)."""
    ranks: dict[int, list] = {}
    for t in specs:
        ranks.setdefault(t.rank, []).append(t)
    return [ranks[r] for r in sorted(ranks)]


class Ticker:
    """A thread that wakes every millisecond and records the longest gap between wakes:
    the longest a gRPC handler thread would have waited for the interpreter meanwhile."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.wait(0.001):
            now = time.perf_counter()
            self.worst = max(self.worst, now - last - 0.001)
            last = now

    def __enter__(self) -> Ticker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
