"""The metadata peers of `refitd bench load`: a spawned process that registers the large
model's workers through the real gRPC API and keeps their leases.

Light agents (command streams only, no transfer processes) hold the slots; trainer ranks and
agents heartbeat at the period the controller hands out, each at its own phase; inference
ranks hold a subscription. Refused heartbeats are reported to the bench as they happen.
"""

from __future__ import annotations

import contextlib
import heapq
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from refitd.bench.light_agents import answer_execute, answer_setup
from refitd.bench.load.meta_refits import Told, rtt_figures, serve_commands, subscriber


def slots_per_agent(workers: int) -> int:
    """Slots of each light agent: 64 (an 8-GPU host's worth of ranks eight times over),
    fewer for small runs so that they have eight agents."""
    return max(1, min(64, workers // 8))


META_HOST = "bench-meta-host"
META_MODEL = "meta"


def worlds(workers: int, pools: int = 2) -> tuple[int, int]:
    """(trainer world, inference world per pool): `pools` pools of 1/8, the rest trainer
    ranks (two pools: 3/4 trainer; four: 1/2)."""
    pool = max(1, workers // 8)
    return workers - pools * pool, pool


def _registration(spec: Any, memory: bytes) -> Any:
    from refitd._proto import refitd_pb2 as pb

    return pb.TensorRegistration(
        name=spec.name,
        canonical=spec.canonical,
        global_shape=spec.global_shape,
        dtype=spec.dtype,
        local_shape=spec.local_shape,
        boxes=[
            pb.Box(offset=b.offset, shape=b.shape, local_offset=b.local_offset) for b in spec.boxes
        ],
        memory=memory,
    )


@dataclass(frozen=True)
class PeerRole:
    """What one peer process holds (`bench load --faults` runs several, to kill some):
    the workers whose registration index % `of` is in `share`, the light agents whose index
    is in `agents` (None: all), and, with `refits`, the metadata model's refits (executes
    answered after `hold_s`, version events acked, Refit called when the bench says)."""

    name: str = "peers"
    share: tuple[int, ...] = (0,)
    of: int = 1
    agents: tuple[int, ...] | None = None
    refits: bool = False
    hold_s: float = 0.0


def meta_peers(address: str, args: dict[str, Any], role: PeerRole, out: Any, commands: Any) -> None:
    """Peer process: its light agents, then its metadata workers registered through gRPC
    (4 client threads), leases kept; reports ("registered", name, seconds, workers, specs,
    agents, heartbeat round trips) and serves the bench's commands (meta_refits.py)
    until told to stop, then reports ("heartbeats", name, round trips)."""
    import grpc

    from refitd._proto import refitd_pb2_grpc as pbg

    stop = threading.Event()
    try:
        ch = grpc.insecure_channel(
            address,
            options=[("grpc.max_send_message_length", 256 << 20)],
        )
        agents = pbg.AgentControlStub(ch)
        refit = pbg.RefitStub(ch)
        streams: list[Any] = []
        hold = role.hold_s if role.refits else None
        agent_ids, period = _light_agents(agents, args["workers"], streams, role.agents, hold)
        out.put(("agents", role.name, len(agent_ids)))
        trainer_ids: list[str] = []  # appended by the registering threads
        subscriptions: list[Any] = []  # inference ranks: an open Subscribe stream is their lease
        rtts: list[tuple[float, float]] = []  # heartbeats: (sent, round trip), seconds
        beat = threading.Thread(
            target=_heartbeats,
            args=(agents, refit, agent_ids, trainer_ids, stop, out, period, rtts),
            daemon=True,
        )
        beat.start()
        time.sleep(0.5)  # agent streams open
        mine = _meta_requests(args, role)
        told = Told()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(4) as ex:
            ex_args = (refit, trainer_ids, subscriptions, told if role.refits else None)
            list(ex.map(lambda r: _register(r, *ex_args), mine))
        n_specs = sum(len(r.tensors) for r in mine)
        registered = (time.perf_counter() - t0, len(mine), n_specs, len(agent_ids))
        out.put(("registered", role.name, *registered, rtt_figures(rtts)))
        serve_commands(commands, out, role, stop, refit, trainer_ids, told, rtts)
        beat.join(30)
        out.put(("heartbeats", role.name, rtt_figures(rtts)))
        for s in streams + subscriptions:
            s.cancel()
    except Exception as e:  # reported to the bench, which fails with it
        out.put(("error", role.name, repr(e)))


def _light_agents(
    agents: Any,
    workers: int,
    streams: list[Any],
    which: tuple[int, ...] | None,
    hold_s: float | None,
) -> tuple[list[str], float]:
    """Register the agents `which` (None: all) of `slots_per_agent` slots each, of the
    agents for `workers` slots; each answers connect/load at once from a thread and moves
    no bytes, and, when `hold_s` is given, reports an execute's sources released at once
    and the execute done after `hold_s`. Their
    command streams are appended to `streams`; returns the agent ids and the heartbeat
    period the controller hands out."""
    import grpc

    from refitd._proto import refitd_pb2 as pb

    def drain(agent_id: str, stream: Any, slots: list[int]) -> None:
        held: dict[int, set[str]] = {}
        with contextlib.suppress(grpc.RpcError):
            for cmd in stream:
                kind = answer_setup(agents, agent_id, cmd, slots, held)
                if kind == "execute" and hold_s is not None:
                    args = (agents, agent_id, cmd, hold_s)
                    threading.Thread(target=_executed, args=args, daemon=True).start()

    agent_ids: list[str] = []
    period = 1.0
    per = slots_per_agent(workers)
    for a in range(-(-workers // per)):
        if which is not None and a not in which:
            continue
        devices = [f"cpu:{i}" for i in range(a * per, min(workers, (a + 1) * per))]
        resp = agents.RegisterAgent(
            pb.RegisterAgentRequest(
                host=META_HOST,
                slots=[pb.SlotInfo(device=d) for d in devices],
                pid=os.getpid(),
                batch_execute=True,
            ),
            timeout=60,
        )
        agent_ids.append(resp.agent_id)
        period = resp.heartbeat_interval_s or period
        s = agents.Commands(pb.AgentStreamRequest(agent_id=resp.agent_id))
        streams.append(s)
        threading.Thread(
            target=drain, args=(resp.agent_id, s, list(resp.slot_ids)), daemon=True
        ).start()
    return agent_ids, period


def _executed(agents: Any, agent_id: str, cmd: Any, hold_s: float) -> None:
    """An execute's reports (sources released at once, done after `hold_s`), unless the
    controller is gone."""
    import grpc

    with contextlib.suppress(grpc.RpcError):
        answer_execute(agents, agent_id, cmd, hold_s)


def _heartbeats(
    agents: Any,
    refit: Any,
    agent_ids: list[str],
    trainer_ids: list[str],
    stop: threading.Event,
    out: Any,
    period: float,
    rtts: list[tuple[float, float]],
) -> None:
    """Keep the leases as the client library does: agents and trainer ranks heartbeat once a
    `period` (the controller's) each, at their own phase (spread over the period, as
    independent processes do); inference ranks hold a subscription instead. A refused
    heartbeat is reported; every round trip is appended to `rtts`."""
    from refitd._proto import refitd_pb2 as pb

    due: list[tuple[float, str, str]] = []  # (next beat, kind, id): a heap
    known = 0

    in_flight: set[Any] = set()  # a dropped gRPC future cancels its call

    def check(call: Any, sent: float) -> None:
        rtts.append((sent, time.monotonic() - sent))
        in_flight.discard(call)
        if call.exception() is not None:
            out.put(("lost", str(call.exception().details())))

    while not stop.wait(0.01):
        now = time.monotonic()
        members = [("agent", a) for a in agent_ids] + [("worker", w) for w in trainer_ids]
        for kind, member in members[known:]:
            heapq.heappush(due, (now + period * random.random(), kind, member))
        known = len(members)
        while due and due[0][0] <= now:
            at, kind, member = heapq.heappop(due)
            heapq.heappush(due, (max(at + period, now), kind, member))
            sent = time.monotonic()
            call = (
                agents.AgentHeartbeat.future(pb.AgentHeartbeatRequest(agent_id=member), timeout=30)
                if kind == "agent"
                else refit.Heartbeat.future(pb.HeartbeatRequest(worker_id=member), timeout=30)
            )
            in_flight.add(call)
            call.add_done_callback(lambda c, sent=sent: check(c, sent))


def _meta_requests(args: dict[str, Any], role: PeerRole) -> list[Any]:
    """The RegisterWorkerRequests of the metadata workers of `role` (of the preset's
    trainer and inference pools, in order: those whose index % role.of is in role.share)."""
    from refitd._proto import refitd_pb2 as pb
    from refitd.bench.presets import Parallel, build_specs, preset

    p = preset(args["preset"])
    t_world, i_world = worlds(args["workers"], args["pools"])
    inference = Parallel.parse(args["inference_layout"], i_world)
    sides = [("trainer", pb.ROLE_SOURCE, Parallel.parse(args["trainer_layout"], t_world), 0)]
    sides += [
        (f"infer-{i}", pb.ROLE_DESTINATION, inference, t_world + i * i_world)
        for i in range(args["pools"])
    ]
    requests = []
    index = 0
    for pool, kind, par, base in sides:
        # only this role's ranks are built, as a process of its own builds only its own
        mine = [r for r in range(par.world) if (index + r) % role.of in role.share]
        index += par.world
        by_rank: dict[int, list[Any]] = {}
        for spec in build_specs(p, par, META_MODEL, pool, base, mine):
            by_rank.setdefault(spec.rank, []).append(spec)
        for rank, specs in sorted(by_rank.items()):
            requests.append(
                pb.RegisterWorkerRequest(
                    model=META_MODEL,
                    pool=pool,
                    role=kind,
                    rank=rank,
                    pool_size=par.world,
                    host=META_HOST,
                    device=f"cpu:{base + rank}",
                    pid=os.getpid(),
                    tensors=[
                        _registration(s, f"meta:{pool}:{rank}:{i}".encode())
                        for i, s in enumerate(specs)
                    ],
                )
            )
    return requests


def _register(
    req: Any, refit: Any, trainer_ids: list[str], subscriptions: list[Any], told: Told | None
) -> None:
    """Register one metadata worker (with this process's identity, as the client library
    does: a restarted process takes over ranks whose holder it finds gone at once); a
    trainer rank joins the heartbeats, an inference rank subscribes (its lease); with
    `told`, a thread reads and acks its events."""
    from refitd._proto import refitd_pb2 as pb
    from refitd.rpc.process import register_rank

    worker_id = register_rank(refit.RegisterWorker, req, timeout=300).worker_id
    if req.role == pb.ROLE_SOURCE:
        trainer_ids.append(worker_id)
        return
    stream = refit.Subscribe(pb.SubscribeRequest(worker_id=worker_id))
    subscriptions.append(stream)
    if told is not None:
        threading.Thread(
            target=subscriber,
            args=(refit, worker_id, (req.pool, req.rank), stream, told),
            daemon=True,
        ).start()
