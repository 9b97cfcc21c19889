"""One verified refit through real Executors: every slot of a plan a rank of a real Gloo group,
one thread each (the transfer process boundary left out)."""

from __future__ import annotations

import datetime
import threading

import torch.distributed as dist

from refitd.executor.run import DirectResolver, Executor, ExecutorConfig
from refitd.plan.planner import Plan
from refitd.slot_protocol import ExecReport
from refitd.transport.base import ConnectInfo
from refitd.transport.gloo import GlooTransport


def run_verified(
    plan: Plan,
    resolvers: dict[int, DirectResolver],
    config: ExecutorConfig | None = None,
    verify: bool = True,
) -> dict[int, ExecReport]:
    """One verified refit (`verify` off: unverified), every slot a rank of a real Gloo group
    (threads); each slot's report, or the first slot's error raised."""
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(30)
    )
    slots = plan.slots()
    results: dict[int, ExecReport | BaseException] = {}

    def rank(r: int) -> None:
        t = GlooTransport()
        try:
            t.connect(ConnectInfo(0, "127.0.0.1", store.port, r, len(slots), 20.0))
            ex = Executor(plan.program(slots[r]), resolvers[slots[r]], t, config=config)
            results[slots[r]] = ex.run(20.0, verify=verify)
        except BaseException as e:
            results[slots[r]] = e
        finally:
            t.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(slots))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    for res in results.values():
        if isinstance(res, BaseException):
            raise res
    assert len(results) == len(slots)
    return results  # type: ignore[return-value]
