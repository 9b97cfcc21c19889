"""What the control-plane benches (`bench control`, `bench load`) share: light agents that
answer the controller's commands at once without moving bytes, and percentiles.

`setup_reports` and `execute_reports` build a light agent's answers; `answer_setup` and
`answer_execute` send them on a blocking stub, and asyncio callers send them on an aio stub.
"""

from __future__ import annotations

from typing import Any


def pct(xs: list[float], q: float) -> float:
    """The q-th percentile of xs (nearest rank)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def setup_reports(
    agent_id: str, cmd: Any, slots: list[int], held: dict[int, set[str]]
) -> tuple[str, list[Any]]:
    """The command's kind and the reports a light agent answers a connect (one per slot of
    the agent) or a load (its slot) with: done at once, no bytes moved; none for other
    commands. `held` (the caller's, one per agent): slot -> the plans it loaded, which a
    connect reports as a real slot's transfer process does."""
    from refitd._proto import refitd_pb2 as pb

    which = cmd.WhichOneof("command")
    reports = []
    if which == "connect":
        for slot in slots:
            reports.append(
                pb.AgentReport(
                    agent_id=agent_id,
                    command_id=cmd.command_id,
                    slot=slot,
                    kind=pb.REPORT_KIND_CONNECTED,
                    loaded_plans=sorted(held.get(slot, ())),
                )
            )
    elif which == "load":
        held.setdefault(cmd.load.slot, set()).add(cmd.load.digest)
        reports.append(
            pb.AgentReport(
                agent_id=agent_id,
                command_id=cmd.command_id,
                slot=cmd.load.slot,
                kind=pb.REPORT_KIND_LOADED,
            )
        )
    return which, reports


def execute_reports(agent_id: str, cmd: Any) -> tuple[Any, Any]:
    """An execute's two batched reports, as a real agent's reporter batches what its slots
    finish together: every slot's SOURCES_RELEASED, then every slot's DONE."""
    from refitd._proto import refitd_pb2 as pb

    slots = list(cmd.execute.slots) or [cmd.execute.slot]
    heads = []
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
        items[0].more.extend(items[1:])
        heads.append(items[0])
    return heads[0], heads[1]


def answer_setup(
    agents: Any, agent_id: str, cmd: Any, slots: list[int], held: dict[int, set[str]]
) -> str:
    """Send a light agent's answer to a connect or load (setup_reports) on a blocking stub;
    returns the command's kind."""
    which, reports = setup_reports(agent_id, cmd, slots, held)
    for rep in reports:
        agents.Report(rep, timeout=30)
    return which


def answer_execute(agents: Any, agent_id: str, cmd: Any, hold_s: float = 0.0) -> float:
    """Report an execute as a light agent that moves nothing (execute_reports) on a
    blocking stub: sources released at once, done `hold_s` later (a transfer's length).
    Returns the monotonic time the DONE report was sent."""
    import time

    released, done_report = execute_reports(agent_id, cmd)
    agents.Report(released, timeout=30)
    if hold_s > 0:
        time.sleep(hold_s)
    done = time.monotonic()
    agents.Report(done_report, timeout=30)
    return done
