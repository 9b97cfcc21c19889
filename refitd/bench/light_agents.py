"""What the control-plane benches (`bench control`, `bench load`) share: light agents that
answer the controller's commands at once without moving bytes, and percentiles."""

from __future__ import annotations

from typing import Any


def pct(xs: list[float], q: float) -> float:
    """The q-th percentile of xs (nearest rank)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def answer_setup(
    agents: Any, agent_id: str, cmd: Any, slots: list[int], held: dict[int, set[str]]
) -> str:
    """Report a connect (for every slot of the agent) or a load (its slot) as done at once,
    as a light agent that moves no bytes; returns the command's kind. `held` (the caller's,
    one per agent): slot -> the plans it loaded, which a connect reports as a real slot's
    transfer process does."""
    from refitd._proto import refitd_pb2 as pb

    which = cmd.WhichOneof("command")
    rep = pb.AgentReport(agent_id=agent_id, command_id=cmd.command_id)
    if which == "connect":
        for slot in slots:
            rep.slot, rep.kind = slot, pb.REPORT_KIND_CONNECTED
            rep.loaded_plans[:] = sorted(held.get(slot, ()))
            agents.Report(rep, timeout=30)
    elif which == "load":
        held.setdefault(cmd.load.slot, set()).add(cmd.load.digest)
        rep.slot, rep.kind = cmd.load.slot, pb.REPORT_KIND_LOADED
        agents.Report(rep, timeout=30)
    return which


def answer_execute(agents: Any, agent_id: str, cmd: Any, hold_s: float = 0.0) -> float:
    """Report an execute as a light agent that moves nothing: one batched report of every
    slot's SOURCES_RELEASED, then, `hold_s` later (a transfer's length), one of their DONE
    (as a real agent's reporter batches what its slots finish together). Returns the
    monotonic time the DONE report was sent."""
    import time

    from refitd._proto import refitd_pb2 as pb

    slots = list(cmd.execute.slots) or [cmd.execute.slot]
    done = 0.0
    for kind in (pb.REPORT_KIND_SOURCES_RELEASED, pb.REPORT_KIND_DONE):
        items = [
            pb.AgentReport(
                agent_id=agent_id,
                command_id=cmd.command_id,
                slot=slot,
                kind=kind,
                refit_id=cmd.execute.refit_id,
            )
            for slot in slots
        ]
        head = items[0]
        head.more.extend(items[1:])
        if kind == pb.REPORT_KIND_DONE and hold_s > 0:
            time.sleep(hold_s)
        done = time.monotonic()
        agents.Report(head, timeout=30)
    return done
