"""`refitd bench load`: a controller under cluster-scale registrations, 1000 small refits.

In this process: a real controller (`Controller`, gRPC on loopback) and its embedded node
agent with real transfer processes, as `refitd serve` runs them. Spawned peer processes
(peers.py, meta.py) register `--workers` workers of a large model (default kimi-k2:
trainer tp=8,pp=8,ep=32, `--pools` inference pools tp=8,ep=32 of 1/8 each) through the
real gRPC API, on slots of light agent threads: their memory handles are metadata only
(never mapped; the light agents answer commands without moving bytes). They keep their
leases as the client library does. Once every pool is registered the controller builds
the plan and all programs ahead (plan_ahead, in a planning process), and the bench waits
for that (its RSS then is `rss_planned_mb`). Then a small real model (the demo GPT: tp=2,pp=2
trainer, two inference pools, on the embedded agent's 4 CPU slots) runs `--refits`
consecutive refits, each checked bit for bit by the inference ranks; with `--faults`, the
large model refits instead and a tenth of its workers and one agent are killed in one of
them (faults.py). Reported: controller RSS, p50/p99 control latency as in `bench control`
(start: Refit of the last rank -> all ExecuteCommands sent; end: last DONE -> committed),
registration figures, heartbeat round trips, and the large model planned again while the
workers heartbeat: by a planning process (the controller's path) and, as same-run
references, in this process (programs compared byte for byte) and from TensorSpec lists.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import resource
import socket
import tempfile
import threading
import time
from typing import Any

import numpy as np

from refitd.bench.light_agents import pct
from refitd.bench.load.faults import fault_roles, run_faults
from refitd.bench.load.meta import META_MODEL, PeerRole, worlds
from refitd.bench.load.peers import Peers, Registered

log = logging.getLogger("refitd.bench.load")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--refits", type=int, default=1000, help="timed refits of the small model")
    parser.add_argument("--warmup", type=int, default=5, help="untimed refits first")
    parser.add_argument(
        "--workers",
        type=int,
        default=1024,
        help="metadata-only workers of the large model: 3/4 trainer ranks, the rest in two "
        "inference pools",
    )
    parser.add_argument(
        "--pools", type=int, default=2, help="inference pools of the large model, 1/8 each"
    )
    parser.add_argument("--preset", default="kimi-k2", help="large model preset")
    parser.add_argument(
        "--lease-s",
        type=float,
        default=10.0,
        help="the controller's lease (heartbeat_timeout_s); the heartbeat period handed out "
        "is a quarter of it (4,096 ranks at 2.5 s are 850 heartbeats a second)",
    )
    parser.add_argument(
        "--no-references",
        action="store_true",
        help="skip the same-run references of the large model's plan (built in this process "
        "and from spec lists): at 4,096 workers each holds the interpreter for seconds",
    )
    parser.add_argument(
        "--faults",
        action="store_true",
        help="instead of the small model's refits: refits of the large model, and in one "
        "kill -9 of a tenth of its workers and of one agent, then their return",
    )
    parser.add_argument(
        "--hold-s",
        type=float,
        default=2.0,
        help="--faults: how long the light agents take to report an execute done",
    )
    parser.add_argument("--trainer-layout", default="tp=8,pp=8,ep=32")
    parser.add_argument("--inference-layout", default="tp=8,ep=32")
    parser.add_argument("--model-mb", type=float, default=2.0, help="size of the small model")


def _plan_meta(ctl: Any, references: bool = True) -> dict[str, Any]:
    """Plan the metadata model on the controller's path while the metadata workers
    heartbeat: tables snapshot -> digest -> the plan and every slot's program from a
    planning process (plan_process.py: the child's own plan and program times, the wall
    time here, and the longest stall of a thread of this process meanwhile). References in
    the same run: the same plan and programs built in this process (checked equal: digest,
    every program's bytes and tensors) and the plan from TensorSpec lists."""
    from refitd.bench.plan import Ticker
    from refitd.server.plan_process import PlanningProcess
    from refitd.server.planning import make_digest, make_plan

    reg, opts, pause = ctl.registry, ctl.refits.plan_options, ctl.refits.gc_pause
    with reg.lock:
        model = reg.model(META_MODEL)
        workers = [reg.workers[w] for p in model.pools.values() for w in p.ranks.values()]
        src = [t for w in workers if w.role == "source" for t in w.specs]
        dst = [t for w in workers if w.role == "destination" for t in w.specs]
        epoch = model.epoch
        t0 = time.perf_counter()
        s_tab, d_tab = model.tables.snapshot(lambda: (src, dst))
        t_snap = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        digest = make_digest(META_MODEL, s_tab, d_tab, opts)
        t_digest = time.perf_counter() - t0
        process = PlanningProcess(timeout_s=ctl.settings.plan_timeout_s)
        with Ticker() as ticker:
            t0, m0 = time.perf_counter(), time.monotonic()
            forked = make_plan(META_MODEL, epoch, s_tab, d_tab, opts, pause, digest, process)
            t_forked = time.perf_counter() - t0
        windows = {"process": (m0, time.monotonic())}
        log.warning("bench load: plan and programs from a planning process %.2f s", t_forked)
        program_mb = sum(len(forked.load_payload(s).program) for s in forked.slots) / 1e6
        here: dict[str, Any] = {}
        same = None
        if references:
            m0 = time.monotonic()
            here = _plan_here(META_MODEL, epoch, s_tab, d_tab, opts, pause)
            windows["in_process"] = (m0, time.monotonic())
            plan = here.pop("plan")
            same = plan.digest == forked.digest and all(
                plan.program_bytes(s) == forked.program_bytes(s)
                and np.array_equal(plan.load_payload(s).tensors, forked.load_payload(s).tensors)
                for s in plan.slots
            )
            del plan
    finally:
        with reg.lock:
            model.tables.release()
    t_lists = None
    if references:
        t0 = time.perf_counter()
        make_plan(META_MODEL, epoch, src, dst, opts, pause)
        t_lists = time.perf_counter() - t0
    child = process.last_timings
    return {
        "meta_specs_source": len(src),
        "meta_specs_destination": len(dst),
        "meta_slots": len(forked.slots),
        "meta_table_rebuilds": model.tables.rebuilds,
        "meta_snapshot_s": t_snap,
        "meta_digest_s": t_digest,
        # the controller's path: a planning process builds the plan, then every program
        "meta_plan_s": child["plan_s"],
        "meta_all_programs_s": child["programs_s"],
        "meta_plan_process_cpu_s": child["cpu_s"],
        "meta_plan_process_plan_cpu_s": child["plan_cpu_s"],
        "meta_plan_process_faults": child["faults"],  # page faults of plan and programs
        "meta_plan_process_plan_faults": child["plan_faults"],
        "meta_plan_process_wall_s": t_forked,  # fork to the programs mapped here
        "meta_plan_thread_stall_ms": ticker.worst * 1e3,
        "meta_plan_process_same_programs": same,
        **here,
        "meta_plan_from_lists_s": t_lists,
        "meta_program_mb": program_mb,
        "windows": windows,  # monotonic spans of the plans, for the heartbeats' figures
    }


def _plan_here(
    model: str, epoch: int, s_tab: Any, d_tab: Any, opts: Any, pause: Any
) -> dict[str, Any]:
    """The same plan and every program built in this process (the reference): times, the
    longest stall of another thread meanwhile, the plan itself ("plan")."""
    from refitd.bench.plan import Ticker
    from refitd.server.planning import make_plan

    with Ticker() as ticker:
        r0 = resource.getrusage(resource.RUSAGE_THREAD)
        t0 = time.perf_counter()
        plan = make_plan(model, epoch, s_tab, d_tab, opts, pause)
        t_plan = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_THREAD)
        t0 = time.perf_counter()
        for s in plan.slots:
            plan.load_payload(s)
        t_all = time.perf_counter() - t0
    return {
        "meta_plan_in_process_s": t_plan,
        "meta_all_programs_in_process_s": t_all,
        # this thread's CPU time, of it the kernel's (mostly page faults)
        "meta_plan_in_process_cpu_s": r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime,
        "meta_plan_in_process_sys_s": r1.ru_stime - r0.ru_stime,
        "meta_plan_in_process_thread_stall_ms": ticker.worst * 1e3,
        "plan": plan,
    }


def _await_plan_ahead(ctl: Any, timeout_s: float = 600.0) -> float:
    """Seconds until the controller holds the metadata model's plan of its current epoch
    with every program built (refitd/server/refit/ahead.py; the daemon's default), so the
    refit loop is measured without it running beside; 0.0 when plan_ahead is off."""
    if not ctl.settings.plan_ahead:
        return 0.0
    t0 = time.perf_counter()
    while True:
        if ctl.refits.ahead.ready(META_MODEL):
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout_s:
            raise RuntimeError(f"the controller built no plan ahead within {timeout_s:.0f} s")
        time.sleep(0.05)


def run(args: argparse.Namespace) -> int:
    import psutil

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    me = psutil.Process()
    ctl, stop, agent = _start_controller(args)
    rss: dict[str, float] = {"idle": me.memory_info().rss}
    peers = Peers(ctl.grpc_address, _meta_args(args))
    demo: Any = None
    try:
        roles = fault_roles(args.workers, args.hold_s) if args.faults else [PeerRole()]
        peers.start_all(roles)
        registered = peers.registered([r.name for r in roles])
        rss["registered"] = me.memory_info().rss
        log.warning("bench load: registered")
        ahead_s = _await_plan_ahead(ctl)
        rss["planned"] = me.memory_info().rss  # the controller's plan and programs built
        rss["peak_to_planned"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        log.warning("bench load: the controller planned ahead in %.2f s", ahead_s)
        meta: dict[str, Any] = {"meta_plan_ahead_wait_s": ahead_s}
        loop_s = 0.0
        if args.faults:
            meta |= run_faults(ctl, peers, roles, args.workers, me)
        else:
            demo, loop_s = _small_model_loop(ctl, args, me, rss)
        # with the metadata workers heartbeating: the plan again, timed
        if _alive(ctl)[1] == args.workers:
            meta |= _plan_meta(ctl, not args.no_references)
            for what, span in meta.pop("windows").items():  # heartbeats while planning
                rtt = peers.rtts(*span)
                meta[f"meta_heartbeat_rtt_max_planning_{what}_s"] = rtt["max_s"]
                meta[f"meta_heartbeat_rtt_p99_planning_{what}_s"] = rtt["p99_s"]
            log.warning("bench load: planned")
        alive = _alive(ctl)
        rtt = peers.stop()
        meta |= _meta_figures(args, registered, peers.lost, alive, rtt, ctl)
        result = _result(args, meta, _controls(ctl, args.warmup), loop_s, rss)
        print(json.dumps(result), flush=True)
        return 0
    finally:
        if demo is not None:
            demo.close()
        peers.close()
        stop.set()
        agent.join(10)
        ctl.stop()


def _meta_args(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "workers": args.workers,
        "pools": args.pools,
        "preset": args.preset,
        "trainer_layout": args.trainer_layout,
        "inference_layout": args.inference_layout,
    }


def _small_model_loop(
    ctl: Any, args: argparse.Namespace, me: Any, rss: dict[str, float]
) -> tuple[Any, float]:
    """The small real model's --warmup, then --refits timed refits (each checked bit for
    bit); returns the demo (for the caller to close) and the loop's seconds."""
    from refitd.demo.gpt import GptConfig
    from refitd.demo.run import Demo

    demo = Demo(ctl.grpc_address, GptConfig.for_megabytes(args.model_mb), say=lambda _: None)
    demo.start()
    for v in range(1, args.warmup + 1):
        demo.refit(v)
    rss["loop_start"] = me.memory_info().rss
    log.warning("bench load: refit loop starts")
    t_loop = time.perf_counter()
    for v in range(args.warmup + 1, args.warmup + args.refits + 1):
        demo.refit(v)
    loop_s = time.perf_counter() - t_loop
    rss["loop_end"] = me.memory_info().rss
    return demo, loop_s


def _alive(ctl: Any) -> tuple[int, int]:
    """(pools, workers) of the metadata model registered now."""
    with ctl.registry.lock:
        pools = len(ctl.registry.model(META_MODEL).pools)
        return pools, sum(1 for w in ctl.registry.workers.values() if w.model == META_MODEL)


def _meta_figures(
    args: argparse.Namespace,
    registered: dict[str, Registered],
    lost: list[tuple],
    alive: tuple[int, int],
    rtt_all: dict[str, float],
    ctl: Any,
) -> dict[str, Any]:
    """The metadata model's registration figures (over the peer roles), heartbeats, and
    what of it was alive at the end."""
    regs = list(registered.values())
    meta_alive, meta_live = alive
    rtt = {k: max(r.rtt[k] for r in regs) for k in ("max_s", "p99_s")}
    register_s, wall_register_s = max(r.seconds for r in regs), max(r.wall_s for r in regs)
    n_workers, n_specs = sum(r.workers for r in regs), sum(r.specs for r in regs)
    n_agents = sum(r.agents for r in regs)
    return {
        "meta_model": f"{args.preset} trainer {args.trainer_layout} + {args.pools} pools "
        f"{args.inference_layout}",
        "meta_workers": n_workers,
        "meta_workers_registered_at_end": meta_live,
        "meta_pools_at_end": meta_alive,
        "meta_heartbeats_refused": len(lost),
        "meta_heartbeats_refused_why": dict(collections.Counter(m[1] for m in lost)),
        "meta_agents": n_agents,
        "meta_worlds": list(worlds(args.workers, args.pools)),
        "meta_specs": n_specs,
        "meta_register_s": register_s,
        "meta_register_wall_s": wall_register_s,
        "meta_heartbeat_rtt_registering_max_s": rtt["max_s"],
        "meta_heartbeat_rtt_registering_p99_s": rtt["p99_s"],
        "meta_heartbeat_rtt_max_s": rtt_all["max_s"],
        "meta_heartbeat_rtt_p99_s": rtt_all["p99_s"],
        "meta_heartbeats": rtt_all["count"],
        "meta_lease_s": ctl.settings.heartbeat_timeout_s,
    }


def _start_controller(args: argparse.Namespace) -> tuple[Any, threading.Event, threading.Thread]:
    """A controller in this process and its embedded node agent (a thread with the demo's
    CPU slots), as `refitd serve` runs them; returns the controller, the agent's stop
    event and its thread."""
    from refitd.config import Settings
    from refitd.demo.run import DEMO_SLOTS
    from refitd.node.agent import run_node_agent
    from refitd.server.controller import Controller

    data = tempfile.mkdtemp(prefix="refitd-bench-load-")
    settings = Settings(
        grpc_port=0,
        http_port=0,
        data_dir=data,
        cpu_slots=DEMO_SLOTS,
        log_level="warning",
        history_size=max(50, args.refits + args.warmup),
        heartbeat_timeout_s=args.lease_s,
        heartbeat_interval_s=args.lease_s / 4,
    )
    ctl = Controller(settings).start()
    stop = threading.Event()
    agent = threading.Thread(
        target=run_node_agent,
        args=(ctl.grpc_address, socket.gethostname(), settings.local_devices(), settings, stop),
        name="local-agent",
        daemon=True,
    )
    agent.start()
    return ctl, stop, agent


def _controls(ctl: Any, warmup: int) -> tuple[list[float], list[float], list[float]]:
    """(control start, control end, refit seconds) of the small model's committed refits
    after the warm-up, from the controller's history."""
    starts, ends, secs = [], [], []
    for r in ctl.refits.history:
        d = r.to_json()
        if d.get("model") != "demo-gpt" or d.get("state") != "committed":
            continue
        if d.get("version", 0) <= warmup:
            continue
        det = r.detail
        if "control_start_s" in det and "control_end_s" in det:
            starts.append(float(det["control_start_s"]))
            ends.append(float(det["control_end_s"]))
            secs.append(r.seconds)
    return starts, ends, secs


def _result(
    args: argparse.Namespace,
    meta: dict[str, Any],
    controls: tuple[list[float], list[float], list[float]],
    loop_s: float,
    rss: dict[str, float],
) -> dict[str, Any]:
    """The bench's JSON document: the metadata model's figures, then the small model's."""
    from refitd.demo.gpt import GptConfig

    starts, ends, secs = controls
    ms = 1e3
    return {
        "bench": "load",
        **meta,
        "small_model_mb": GptConfig.for_megabytes(args.model_mb).nbytes / 1e6,
        "refits": args.refits,
        "refits_recorded": len(starts),
        "refit_loop_s": loop_s,
        "refit_p50_ms": pct(secs, 50) * ms if secs else None,
        "control_start_p50_ms": pct(starts, 50) * ms if starts else None,
        "control_start_p99_ms": pct(starts, 99) * ms if starts else None,
        "control_end_p50_ms": pct(ends, 50) * ms if ends else None,
        "control_end_p99_ms": pct(ends, 99) * ms if ends else None,
        "rss_idle_mb": rss["idle"] / 1e6,
        "rss_registered_mb": rss["registered"] / 1e6,
        "rss_planned_mb": rss["planned"] / 1e6,
        "rss_peak_to_planned_mb": rss["peak_to_planned"] / 1e6,
        "rss_loop_start_mb": rss.get("loop_start", 0.0) / 1e6,
        "rss_loop_end_mb": rss.get("loop_end", 0.0) / 1e6,
        "rss_growth": rss["loop_end"] / rss["loop_start"] - 1.0 if "loop_end" in rss else None,
        "target_rss_growth": 0.05,
        "target_control_p99_ms": 20.0,
        "note": "controller and embedded agent in the bench process (RSS is that process; "
        "transfer processes, workers and metadata peers are children); metadata workers "
        "are registered through gRPC with handles that are never mapped, their slots "
        "belong to light agent threads that execute nothing; the small model moves real "
        f"bytes through real transfer processes, verified bit for bit; {os.cpu_count()} "
        "cores",
    }
