"""The peer process of `refitd bench control`: light agents and subscribing inference ranks.

They stand for processes on other cores and hosts, so they run as coroutines on one asyncio
loop (grpc.aio), which keeps their own cost off the cores the bench shares with the
controller, while the controller sees the traffic of separate clients: each agent its own
Commands stream and reports, each inference rank its own Events stream (or, with
`unary_acks`, a Subscribe stream and an Ack call) with an ack per event. Agents answer every
command at once without moving bytes (light_agents); per executed slot, (refit id, command
received, DONE sent) goes to the bench's queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import time
from typing import Any

from refitd.bench.light_agents import execute_reports, setup_reports

AGENTS = 8
ROWS_PER_RANK = 4
COLS = 64
OPEN_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class PeerConfig:
    """What the peer process runs: `slots` slots on `host` in AGENTS agents (half of them
    trainer ranks, half the subscribing inference ranks here)."""

    address: str
    host: str
    slots: int
    batch: bool
    unary_acks: bool


def worker_request(pool: str, role: int, rank: int, size: int, host: str, slot: int) -> Any:
    """Registration of rank `rank` of a pool of `size` ranks holding its rows of "w"."""
    from refitd._proto import refitd_pb2 as pb

    tensor = pb.TensorRegistration(
        name="w",
        global_shape=[ROWS_PER_RANK * size, COLS],
        dtype="bfloat16",
        local_shape=[ROWS_PER_RANK, COLS],
        boxes=[
            pb.Box(
                offset=[rank * ROWS_PER_RANK, 0], shape=[ROWS_PER_RANK, COLS], local_offset=[0, 0]
            )
        ],
        memory=b"bench-handle",
    )
    return pb.RegisterWorkerRequest(
        model="bench",
        pool=pool,
        role=role,
        rank=rank,
        pool_size=size,
        host=host,
        device=f"cpu:{slot}",
        pid=os.getpid(),
        tensors=[tensor],
    )


def run_peers(cfg: PeerConfig, ready: Any, out: Any, stop: Any) -> None:
    """Process entry: the agents and subscribers until `stop` is set; `ready` once every
    subscriber has its HELLO."""
    asyncio.run(_peers(cfg, ready, out, stop))


async def _peers(cfg: PeerConfig, ready: Any, out: Any, stop: Any) -> None:
    import grpc

    from refitd._proto import refitd_pb2_grpc as pbg

    ch = grpc.aio.insecure_channel(cfg.address)
    agents = pbg.AgentControlStub(ch)
    refit = pbg.RefitStub(ch)
    per = cfg.slots // AGENTS
    tasks = [asyncio.create_task(_agent(agents, cfg, a * per, per, out)) for a in range(AGENTS)]
    await _streams_open(refit, AGENTS, tasks)
    n = cfg.slots // 2
    hellos = [asyncio.Event() for _ in range(n)]
    tasks += [asyncio.create_task(_subscriber(refit, cfg, r, n, hellos[r])) for r in range(n)]
    await asyncio.wait_for(asyncio.gather(*(h.wait() for h in hellos)), OPEN_TIMEOUT_S)
    ready.set()
    await asyncio.get_running_loop().run_in_executor(None, stop.wait)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await ch.close()


async def _streams_open(refit: Any, agents: int, tasks: list[asyncio.Task]) -> None:
    """Wait until the controller's status counts `agents` agents with their Commands
    stream open (the controller sends nothing on open, so the agents cannot tell), or
    raise after OPEN_TIMEOUT_S; an agent task that ended early raises its error."""
    from refitd._proto import refitd_pb2 as pb

    deadline = time.monotonic() + OPEN_TIMEOUT_S
    pause = 0.005
    while True:
        for t in tasks:
            if t.done():
                t.result()  # an agent that failed to register or open its stream
        doc = await refit.GetStatus(pb.StatusRequest(), timeout=30)
        if json.loads(doc.json)["summary"]["agents_connected"] >= agents:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{agents} agent streams did not open within {OPEN_TIMEOUT_S} s")
        await asyncio.sleep(pause)  # between two status polls
        pause = min(2 * pause, 0.1)


async def _agent(agents: Any, cfg: PeerConfig, first: int, per: int, out: Any) -> None:
    """A light agent of slots cpu:first.. (per of them): register, read its commands as
    they come (timestamped on receipt) while another task answers them in order."""
    from refitd._proto import refitd_pb2 as pb

    resp = await agents.RegisterAgent(
        pb.RegisterAgentRequest(
            host=cfg.host,
            slots=[pb.SlotInfo(device=f"cpu:{first + i}") for i in range(per)],
            pid=os.getpid(),
            batch_execute=cfg.batch,
        ),
        timeout=30,
    )
    todo: asyncio.Queue[tuple[Any, float]] = asyncio.Queue()
    answer = asyncio.create_task(_answer(agents, resp.agent_id, list(resp.slot_ids), todo, out))
    try:
        async for cmd in agents.Commands(pb.AgentStreamRequest(agent_id=resp.agent_id)):
            todo.put_nowait((cmd, time.monotonic()))
    finally:
        answer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await answer


async def _answer(
    agents: Any, agent_id: str, slot_ids: list[int], todo: asyncio.Queue, out: Any
) -> None:
    """Answer each command at once; per executed slot, (refit id, received, DONE sent)
    goes to `out`."""
    held: dict[int, set[str]] = {}
    while True:
        cmd, got = await todo.get()
        which, reports = setup_reports(agent_id, cmd, slot_ids, held)
        for rep in reports:
            await agents.Report(rep, timeout=30)
        if which != "execute":
            continue
        released, done_report = execute_reports(agent_id, cmd)
        await agents.Report(released, timeout=30)
        done = time.monotonic()
        await agents.Report(done_report, timeout=30)
        for _ in list(cmd.execute.slots) or [cmd.execute.slot]:
            out.put((cmd.execute.refit_id, got, done))


async def _subscriber(refit: Any, cfg: PeerConfig, rank: int, n: int, hello: Any) -> None:
    """Inference rank `rank` of n: register, subscribe and ack every event, on one Events
    stream as the client library does (with `unary_acks`: Subscribe, and an Ack call each)."""
    from refitd._proto import refitd_pb2 as pb

    req = worker_request("infer", pb.ROLE_DESTINATION, rank, n, cfg.host, n + rank)
    resp = await refit.RegisterWorker(req, timeout=30)
    subscribe = pb.SubscribeRequest(worker_id=resp.worker_id)
    if cfg.unary_acks:
        call = refit.Subscribe(subscribe)
    else:
        call = refit.Events()
        await call.write(pb.EventsRequest(subscribe=subscribe))
    async for ev in call:
        if ev.kind == pb.EVENT_KIND_HELLO:
            hello.set()
            continue
        ack = pb.AckRequest(worker_id=resp.worker_id, event_id=ev.event_id, ok=True)
        if cfg.unary_acks:
            await refit.Ack(ack, timeout=30)
        else:
            await call.write(pb.EventsRequest(ack=ack))
