"""`refitd bench control`: control-plane overhead of refits with a cached plan.

A real controller (`refitd serve` child process, gRPC on loopback) with 64 registered slots
(8 agents x 8 slots), a trainer pool of 32 ranks and an inference pool of 32 subscribed
ranks. The agents and the inference ranks are coroutines of one peer process
(control_peers), each with its own streams; the agents answer every command at once without
moving bytes: this bench measures the controller's overhead only. The trainer ranks call
Refit from threads of the bench's process, each a blocking call as the client library
makes. Per refit:
start = last trainer Refit call -> every slot has received its ExecuteCommand (all ranks at
once by default; --skew-ms lets the last rank ask later, as ranks finishing their step at
different times do, so the barrier and the PAUSE handshake are off the critical path);
end = last DONE report sent -> the version committed (first Refit(WAIT_COMMITTED) return).
The start is split with the controller's record (one monotonic clock on the host): the last
Refit's way in, the wait for the inference ranks' PAUSE acks after it, the controller's own
share (everything in hand -> executes sent) and the executes' way out.
The reference measured in the same run is one unary gRPC round trip to the controller.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from refitd.bench.control_peers import AGENTS, PeerConfig, run_peers, worker_request
from refitd.bench.light_agents import pct
from refitd.rpc.asks import AskStream
from refitd.rpc.connection import ControllerConnection


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--refits", type=int, default=200, help="timed refits")
    parser.add_argument("--warmup", type=int, default=30, help="untimed refits first")
    parser.add_argument("--slots", type=int, default=64, help="slots (half trainer, half infer)")
    parser.add_argument(
        "--skew-ms",
        type=float,
        default=0.0,
        help="the last trainer rank asks this long after the others (0: all at once, the "
        "worst case: the barrier's 32 RPCs and the PAUSE handshake share the CPU)",
    )
    parser.add_argument(
        "--no-early-pause",
        action="store_true",
        help="controller pauses destination pools only after the barrier (early_pause off)",
    )
    parser.add_argument(
        "--unary-acks",
        action="store_true",
        help="inference ranks subscribe with Subscribe and ack each event with an Ack call "
        "(clients before the Events stream) instead of acking on their Events stream",
    )
    parser.add_argument(
        "--per-slot",
        action="store_true",
        help="agents without batch_execute: one ExecuteCommand and report per slot",
    )


def _start_controller(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """`refitd serve` as a child process (no embedded agent); returns it and its gRPC
    address once it printed it."""
    data = tempfile.mkdtemp(prefix="refitd-bench-")
    ctl = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "refitd.cli.main",
            "serve",
            "--grpc-port",
            "0",
            "--http-port",
            "0",
            "--no-embedded-agent",
            "--data-dir",
            data,
            "--log-level",
            "warning",
            *(["--no-early-pause"] if args.no_early_pause else []),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = ctl.stdout.readline()  # type: ignore[union-attr]
    match = re.search(r"gRPC (\S+),", line)
    if not match:
        ctl.terminate()
        raise RuntimeError(f"controller did not start: {line!r}")
    return ctl, match.group(1)


@dataclasses.dataclass
class _Marks:
    """Per timed refit: start (last Refit call -> last ExecuteCommand received), end (last
    DONE sent -> committed), total (last call -> last return), and (version, last call,
    last ExecuteCommand received) for the split against the controller's record."""

    starts: list[float] = dataclasses.field(default_factory=list)
    ends: list[float] = dataclasses.field(default_factory=list)
    totals: list[float] = dataclasses.field(default_factory=list)
    spreads: list[float] = dataclasses.field(default_factory=list)  # first -> last call
    marks: list[tuple[int, float, float]] = dataclasses.field(default_factory=list)
    # the controller's threads (schedstat) and the clock when the timed refits began, ended
    sched: list[dict[int, tuple[float, float]]] = dataclasses.field(default_factory=list)
    clock: list[float] = dataclasses.field(default_factory=list)


def _thread_times(pid: int) -> dict[int, tuple[float, float]]:
    """Per thread of process `pid`: (seconds on a CPU, seconds runnable but waiting for one)
    from Linux's schedstat; empty where there is none."""
    times = {}
    for path in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        with contextlib.suppress(OSError, ValueError):
            with open(path) as f:
                run, wait = f.read().split()[:2]
            times[int(path.split("/")[4])] = (int(run) / 1e9, int(wait) / 1e9)
    return times


def _controller_cpu(m: _Marks, refits: int) -> dict[str, float]:
    """The controller's CPU over the timed refits: its CPU time per refit, and the share of
    the wall time its busiest thread (the gRPC loop) ran and waited for a core."""
    if len(m.sched) < 2 or not m.sched[0]:
        return {}
    before, after = m.sched
    delta = {
        t: [a - b for a, b in zip(after[t], before.get(t, (0.0, 0.0)), strict=True)] for t in after
    }
    busiest = max(delta.values(), key=lambda d: d[0])
    wall = m.clock[1] - m.clock[0]
    return {
        "controller_cpu_ms_per_refit": sum(d[0] for d in delta.values()) / refits * 1e3,
        "controller_loop_on_cpu_share": busiest[0] / wall,
        "controller_loop_runqueue_share": busiest[1] / wall,
    }


def _refits(
    args: argparse.Namespace,
    trainers: list[str],
    slots: int,
    out: Any,
    controller: tuple[str, int],
) -> _Marks:
    """--warmup then --refits refits, every trainer rank asking for the version
    (WAIT_COMMITTED) from its own thread on its own Asks stream, as TrainerClient.refit
    does; the timed ones measured. `controller`: its address and pid."""
    from refitd._proto import refitd_pb2 as pb

    # each rank asks as the client library's TrainerClient.refit does: on its own stream
    address, pid = controller
    conn = ControllerConnection(address)
    asks = {w: AskStream(conn) for w in trainers}

    def call(wid: str, version: int) -> tuple[float, float, int]:
        t0 = time.monotonic()
        req = pb.RefitRequest(worker_id=wid, version=version, wait=pb.WAIT_COMMITTED)
        resp = asks[wid].ask(req, f"refit of version {version}", 60.0)
        if resp.state != pb.REFIT_STATE_COMMITTED:
            raise RuntimeError(f"refit {version} ended {resp.state}: {resp.message}")
        return t0, time.monotonic(), resp.state

    m = _Marks()
    with ThreadPoolExecutor(len(trainers)) as pool:
        for i in range(args.warmup + args.refits):
            version = i + 1
            if i == args.warmup:
                m.sched.append(_thread_times(pid))
                m.clock.append(time.monotonic())
            if args.skew_ms > 0:  # the last rank asks after the others (barrier skew)
                futs = [pool.submit(call, w, version) for w in trainers[:-1]]
                time.sleep(args.skew_ms / 1e3)
                futs.append(pool.submit(call, trainers[-1], version))
                res = [f.result() for f in futs]
            else:
                res = list(pool.map(lambda w, v=version: call(w, v), trainers))
            if any(s != pb.REFIT_STATE_COMMITTED for _, _, s in res):
                raise RuntimeError(f"refit {version} did not commit: {res}")
            got, done = [], []
            while len(got) < slots:
                _, g, d = out.get(timeout=30)
                got.append(g)
                done.append(d)
            t_last_call = max(t0 for t0, _, _ in res)
            t_commit = min(t1 for _, t1, _ in res)
            if i >= args.warmup:
                m.marks.append((version, t_last_call, max(got)))
                m.starts.append(max(got) - t_last_call)
                m.ends.append(t_commit - max(done))
                m.totals.append(max(t1 for _, t1, _ in res) - t_last_call)
                m.spreads.append(t_last_call - min(t0 for t0, _, _ in res))
    for a in asks.values():
        a.close()
    conn.close()
    m.clock.append(time.monotonic())
    m.sched.append(_thread_times(pid))
    return m


def _burst(stub: Any, trainers: list[str], rounds: int = 50) -> list[float]:
    """The reference for all ranks at once: every trainer rank sends a Heartbeat from its
    own thread at once; per round, the last call's start -> the last answer."""
    from refitd._proto import refitd_pb2 as pb

    def beat(wid: str) -> tuple[float, float]:
        t0 = time.monotonic()
        stub.Heartbeat(pb.HeartbeatRequest(worker_id=wid), timeout=10)
        return t0, time.monotonic()

    spans = []
    with ThreadPoolExecutor(len(trainers)) as pool:
        for _ in range(rounds):
            res = list(pool.map(beat, trainers))
            spans.append(max(t1 for _, t1 in res) - max(t0 for t0, _ in res))
    return spans


def _result(
    args: argparse.Namespace,
    slots: int,
    m: _Marks,
    refs: tuple[list[float], list[float]],
    doc: dict,
) -> dict:
    """The bench's JSON document from the measured marks, the RPC round trips and the
    controller's status (its refit records)."""
    n = slots // 2
    inside = [r for r in doc["refits"] if r["state"] == "committed"][: args.refits]
    ctl_start = [r["control_start_s"] for r in inside]
    ctl_end = [r["control_end_s"] for r in inside]
    pauses = [r.get("pause_s", 0.0) for r in inside]
    barriers = [r.get("barrier_s", 0.0) for r in inside]
    by_version = {r["version"]: r for r in inside}
    # CLOCK_MONOTONIC is shared by the processes of one host: split the start into the
    # last Refit's way in, the controller, and the ExecuteCommands' way out.
    ask_in = [by_version[v]["last_ask_at"] - t for v, t, _ in m.marks if v in by_version]
    cmd_out = [g - by_version[v]["executes_sent_at"] for v, _, g in m.marks if v in by_version]
    # The controller's own share: from when it had everything the start needs (the last
    # Refit and the last PAUSE ack) to the executes sent; the rest of its share is the wait
    # for the inference ranks' acks after the last Refit came in.
    ready = [max(r["last_ask_at"], r.get("paused_at", 0.0)) for r in inside]
    own = [r["executes_sent_at"] - t for r, t in zip(inside, ready, strict=True)]
    ack_wait = [max(0.0, r.get("paused_at", 0.0) - r["last_ask_at"]) for r in inside]
    # the first ask -> PAUSE sent (early pause: the driver prepares the run first)
    pause_out = [
        r["pause_sent_at"] - (r["last_ask_at"] - r.get("barrier_s", 0.0))
        for r in inside
        if "pause_sent_at" in r
    ]
    ms = 1e3
    rtts, burst = refs
    return {
        "bench": "control",
        "slots": slots,
        "agents": AGENTS,
        "trainer_ranks": n,
        "inference_ranks": n,
        "refits": args.refits,
        "batch_execute": not args.per_slot,
        "acks": "unary" if args.unary_acks else "events stream",
        "early_pause": not args.no_early_pause,
        "skew_ms": args.skew_ms,
        "start_p50_ms": pct(m.starts, 50) * ms,
        "start_p99_ms": pct(m.starts, 99) * ms,
        "end_p50_ms": pct(m.ends, 50) * ms,
        "end_p99_ms": pct(m.ends, 99) * ms,
        "refit_p50_ms": pct(m.totals, 50) * ms,
        "controller_start_p50_ms": pct(ctl_start, 50) * ms,
        "controller_end_p50_ms": pct(ctl_end, 50) * ms,
        "controller_start_p99_ms": pct(ctl_start, 99) * ms,
        "controller_end_p99_ms": pct(ctl_end, 99) * ms,
        "controller_own_start_p50_ms": pct(own, 50) * ms,
        "controller_own_start_p99_ms": pct(own, 99) * ms,
        "pause_acks_after_last_refit_p50_ms": pct(ack_wait, 50) * ms,
        "pause_acks_after_last_refit_p99_ms": pct(ack_wait, 99) * ms,
        "pause_handshake_p50_ms": pct(pauses, 50) * ms,
        "first_ask_to_pause_sent_p50_ms": pct(pause_out, 50) * ms if pause_out else 0.0,
        "calls_spread_p50_ms": pct(m.spreads, 50) * ms,
        "barrier_at_controller_p50_ms": pct(barriers, 50) * ms,
        "last_refit_call_to_controller_p50_ms": pct(ask_in, 50) * ms,
        "execute_to_agents_p50_ms": pct(cmd_out, 50) * ms,
        "rpc_rtt_p50_ms": pct(rtts, 50) * ms,
        "start_p50_over_rtt": pct(m.starts, 50) / pct(rtts, 50),
        "all_ranks_heartbeat_p50_ms": pct(burst, 50) * ms,
        "all_ranks_heartbeat_p99_ms": pct(burst, 99) * ms,
        **_controller_cpu(m, args.refits),
        "target_p50_ms": 5.0,
        "target_p99_ms": 15.0,
        "note": "light agents answer commands at once without moving bytes: control "
        "overhead only; controller, agents+subscribers and trainers are 3 processes on "
        f"{os.cpu_count()} cores",
    }


def run(args: argparse.Namespace) -> int:
    import grpc

    from refitd._proto import refitd_pb2 as pb
    from refitd._proto import refitd_pb2_grpc as pbg

    slots = args.slots - args.slots % (2 * AGENTS) or 2 * AGENTS
    n = slots // 2
    host = "bench-host"
    ctl, address = _start_controller(args)
    ctx = mp.get_context("spawn")
    ready, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    peers = None
    try:
        cfg = PeerConfig(address, host, slots, not args.per_slot, args.unary_acks)
        peers = ctx.Process(target=run_peers, args=(cfg, ready, out, stop), daemon=True)
        peers.start()
        if not ready.wait(60):
            raise RuntimeError("bench peers did not come up within 60 s")
        ch = grpc.insecure_channel(address)
        stub = pbg.RefitStub(ch)
        trainers = [
            stub.RegisterWorker(
                worker_request("trainer", pb.ROLE_SOURCE, r, n, host, r), timeout=30
            ).worker_id
            for r in range(n)
        ]
        marks = _refits(args, trainers, slots, out, (address, ctl.pid))
        rtts = []
        for _ in range(200):
            t0 = time.perf_counter()
            stub.Heartbeat(pb.HeartbeatRequest(worker_id=trainers[0]), timeout=10)
            rtts.append(time.perf_counter() - t0)
        burst = _burst(stub, trainers)
        doc = json.loads(stub.GetStatus(pb.StatusRequest(model="bench"), timeout=30).json)
        print(json.dumps(_result(args, slots, marks, (rtts, burst), doc)))
        ch.close()
        return 0
    finally:
        stop.set()
        if peers is not None:
            peers.join(10)
            if peers.is_alive():
                peers.kill()
        ctl.terminate()
        try:
            ctl.wait(15)
        except subprocess.TimeoutExpired:
            ctl.kill()
