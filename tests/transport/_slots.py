"""Transfer slots of one process, one thread each: the transfer process's own command
handlers (TransferSlot) over real Gloo, a real rendezvous TCPStore, real shared memory
(every tensor registered in its slot's SharedTensorArena, as a worker would) and the real
one-sided paths; only the process boundary is left out, so a hypothesis test stays cheap."""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from refitd.memory.arena import SharedTensorArena
from refitd.memory.handles import MemoryHandle
from refitd.plan.layout import TensorSpec
from refitd.plan.planner import Plan
from refitd.plan.program import encode_program
from refitd.slot_protocol import Apply, Connect, Execute, Load
from refitd.transfer.slot import TransferSlot


class Slots:
    """One TransferSlot per slot of a plan over tensors registered like a worker's."""

    def __init__(self, slots: Iterable[int], timeout_s: float = 30.0) -> None:
        self.slots = sorted(slots)
        self.timeout_s = timeout_s
        self.store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )  # fmt: skip
        self.state = {s: TransferSlot(s) for s in self.slots}
        self.arenas = {s: SharedTensorArena(prefix="refitd-test") for s in self.slots}
        self.handles: dict[int, MemoryHandle] = {}
        self.ranks = {s: k for k, s in enumerate(self.slots)}

    def register(self, specs: list[TensorSpec], tensors: list[torch.Tensor]) -> None:
        """Plan tensor i (specs[i], tensors[i]) into its slot's arena."""
        for i, (s, t) in enumerate(zip(specs, tensors, strict=True)):
            self.handles[i] = self.arenas[s.slot].register({f"t{i}": t})[f"t{i}"]

    def each(self, f: Callable[[int], Any], slots: Iterable[int] | None = None) -> dict:
        """f(slot) on a thread per slot; every result, or the errors (RuntimeError)."""
        out: dict[int, Any] = {}

        def run(s: int) -> None:
            try:
                out[s] = f(s)
            except BaseException as e:  # reported below
                out[s] = e

        threads = [threading.Thread(target=run, args=(s,)) for s in (slots or self.slots)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout_s * 3)
        assert not any(t.is_alive() for t in threads), "a slot hung"
        bad = {s: v for s, v in out.items() if isinstance(v, BaseException)}
        if bad:
            raise RuntimeError(bad)
        return out

    def connect(self, epoch: int = 1) -> None:
        n = len(self.slots)
        self.each(lambda s: self.state[s].connect(Connect(
            epoch, "127.0.0.1", self.store.port, self.ranks[s], n, "gloo", self.timeout_s,
            slot_ranks=self.ranks,
        )))  # fmt: skip

    def load(self, plan: Plan, staged: tuple[int, ...] = (), snapshot: tuple[int, ...] = (),
             slots: Iterable[int] | None = None, chunk: int | None = 256) -> None:  # fmt: skip
        def one(s: int) -> Any:
            p = plan.program(s)
            return self.state[s].load(Load(
                plan.digest, encode_program(p),
                {i: self.handles[i].to_bytes() for i in p.tensors},
                staging_bytes=1 << 20, wire_chunk=chunk, staged_chunk=chunk, staged=staged,
                model="m", snapshot=snapshot,
            ))  # fmt: skip

        self.each(one, slots)

    def execute(
        self, plan: Plan, refit_id: int, verify: bool = True, timeout_s: float | None = None
    ) -> dict:
        wait = timeout_s or self.timeout_s

        def one(s: int) -> Any:
            self.state[s].aborting.clear()  # as the command loop does before a refit
            cmd = Execute(plan.digest, 1, refit_id, wait, verify=verify)
            return self.state[s].execute(cmd, lambda: None)

        return self.each(one)

    def apply(self, plan: Plan, refit_id: int, slots: Iterable[int]) -> None:
        self.each(lambda s: self.state[s].apply(Apply(plan.digest, refit_id)), slots)

    def close(self) -> None:
        for st in self.state.values():
            st.close(None)  # type: ignore[arg-type]
        for a in self.arenas.values():
            a.close()


def checksum_mismatch(plan: Plan, results: dict) -> str | None:
    """The controller's comparison of the slots' per-message checksums."""
    from refitd.server.refit.checksums import compare_checksums

    sent, landed = {}, {}
    for s, r in results.items():
        sent |= {i: (s, c) for i, c in r.report.checksums["send"].items()}
        landed |= {i: (s, c) for i, c in r.report.checksums["recv"].items()}
    return compare_checksums(plan, sent, landed)
