"""The controller's side of delta refits: per refit, the DeltaCommands of every slot (from
the policy), the agents' outcomes folded into the refit record and the ledger, and the
ledger kept current on commit, failure and catch-up. Off unless Settings.delta_refits."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import numpy as np

from refitd._proto import refitd_pb2 as pb
from refitd.config import Settings
from refitd.server.delta.plan import PlanDelta, plan_delta
from refitd.server.delta.policy import (
    UNKNOWN,
    DeltaLedger,
    DeltaSettings,
    Timing,
    decide,
    refit_mode,
)
from refitd.server.members import Worker
from refitd.server.planning import ControllerPlan


@dataclass
class _Tally:
    """What the agents reported for one refit attempt's delta path."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    delta_messages: int = 0
    dense_messages: int = 0
    changed: int = 0
    elements: int = 0
    wire_bytes: int = 0
    dense_wire_bytes: int = 0
    encode_s: float = 0.0
    apply_s: float = 0.0
    base_bytes: int = 0
    model: str = ""
    planned: bool = True  # the refit tried deltas (False: dense by refit_mode)


class DeltaRefits:
    """Delta decisions and bookkeeping of every model of one controller."""

    def __init__(self, settings: Settings) -> None:
        self.settings = DeltaSettings(
            settings.delta_refits,
            settings.delta_max_density,
            settings.delta_probe_every,
            settings.delta_speed_rule,
        )
        self._ledgers: dict[str, DeltaLedger] = {}
        self._plans: dict[str, PlanDelta] = {}
        self._tallies: dict[int, _Tally] = {}  # attempt id -> tally
        self._timing: dict[str, Timing] = {}  # model -> its last attempt's transfer time
        self._lock = threading.Lock()

    def ledger(self, model: str) -> DeltaLedger:
        with self._lock:
            return self._ledgers.setdefault(model, DeltaLedger.empty())

    def _plan(self, plan: ControllerPlan, staged: Iterable[str]) -> PlanDelta:
        with self._lock:
            pd = self._plans.get(plan.digest)
        if pd is None:
            pd = plan_delta(plan.plan, frozenset(staged))
            with self._lock:
                self._plans = {plan.digest: pd}  # the current plan's columns only
        return pd

    def commands(
        self,
        model: str,
        plan: ControllerPlan,
        dest_workers: list[Worker],
        staged_pools: Iterable[str],
        committed: int,
        attempt: int,
        detail: dict,
        delta_slots: frozenset[int] = frozenset(),
    ) -> dict[int, pb.DeltaCommand]:
        """Slot -> its DeltaCommand for this attempt (empty: everything goes dense through
        the executor); the decision's summary goes into `detail["delta"]`. Only messages
        between `delta_slots` (the registry's delta_slots: the codec runs on host memory,
        which the transport must carry) take the delta path."""
        if not self.settings.enabled:
            return {}
        led = self.ledger(model)
        mode = refit_mode(self.settings, led.densities, led.timings)
        if not mode.delta:
            detail["delta"] = {"mode": mode.reason, "delta_messages": 0}
            with self._lock:  # its transfer time is measured too (refit_mode compares them)
                self._tallies[attempt] = _Tally(model=model, planned=False)
            return {}
        pd = self._plan(plan, staged_pools)
        ends = np.array(sorted(delta_slots), dtype=np.int64)
        served = np.isin(pd.columns.src_slot, ends) & np.isin(pd.dst_slot, ends)
        pd = replace(pd, columns=replace(pd.columns, capable=pd.columns.capable & served))
        by_key = {(w.pool, w.rank): w for w in dest_workers}
        states = [
            led.destination(w.worker_id, w.registered_at)
            if (w := by_key.get(key)) is not None
            else led.destination(f"{key[0]}/{key[1]}", -1.0)
            for key in pd.workers
        ]
        promote = committed if committed > 0 else UNKNOWN
        senders = led.senders(promote, pd.layout_key)
        d = decide(self.settings, mode, pd.layout_key, pd.columns, senders, states)
        detail["delta"] = d.summary()
        if d.dense_workers:
            detail["delta"]["dense_workers"] = dict(list(d.dense_workers.items())[:8])
        allowed = {int(m) for m in pd.mids[d.delta].tolist()}
        sends, recvs = pd.capable_by_slot()
        with self._lock:
            self._tallies[attempt] = _Tally(model=model)
        return {
            slot: pb.DeltaCommand(
                slot=slot,
                send=sends.get(slot, []),
                recv=recvs.get(slot, []),
                allowed=[m for m in sends.get(slot, []) if m in allowed],
                promote=promote,
                max_density=self.settings.max_density,
            )
            for slot in sorted(set(sends) | set(recvs))
        }

    def reported(self, model: str, digest: str, attempt: int, r: pb.AgentReport) -> None:
        """A DONE report of an execute with a delta path."""
        if not r.HasField("delta"):
            return
        o = r.delta
        with self._lock:
            pd = self._plans.get(digest)
        key = pd.layout_key if pd is not None else ""
        self.ledger(model).reported(r.slot, o.base_version, o.pending_version, key)
        with self._lock:
            t = self._tallies.get(attempt)
        if t is None:
            return
        with t.lock:
            for m in o.sent:
                t.delta_messages += m.delta
                t.dense_messages += not m.delta
                t.changed += m.changed
                t.elements += m.elements
                t.wire_bytes += m.nbytes
                t.dense_wire_bytes += m.dense_nbytes or m.nbytes
            t.encode_s = max(t.encode_s, o.encode_s)
            t.apply_s = max(t.apply_s, o.apply_s)
            t.base_bytes += o.base_bytes

    def finish_attempt(self, attempt: int, detail: dict) -> float | None:
        """Fold the attempt's tally into `detail["delta"]`; returns the achieved density."""
        with self._lock:
            t = self._tallies.pop(attempt, None)
        if t is None or "delta" not in detail:
            return None
        sent_at = detail.get("executes_sent_at")
        if sent_at is not None:  # recorded in the ledger if this attempt commits
            with self._lock:
                self._timing[t.model] = Timing(t.delta_messages > 0, time.monotonic() - sent_at)
        if not t.planned:
            return None  # a dense refit through the executor: nothing of the delta path
        density = t.changed / t.elements if t.elements else None
        detail["delta"].update(
            sent_as_delta=t.delta_messages,
            sent_dense=t.dense_messages,
            density=density,
            wire_bytes=t.wire_bytes,
            dense_wire_bytes=t.dense_wire_bytes,
            encode_s=t.encode_s,
            apply_s=t.apply_s,
            base_memory_bytes=t.base_bytes,
        )
        return density

    def committed(self, model: str, version: int, digest: str, workers: Iterable[Worker],
                  density: float | None, how: str = "refit") -> None:  # fmt: skip
        """`version` landed in full in `workers` through the plan `digest`."""
        with self._lock:
            pd = self._plans.get(digest)
        key = pd.layout_key if pd is not None else f"digest:{digest}"
        led = self.ledger(model)
        led.committed(version, key, {w.worker_id: w.registered_at for w in workers}, how)
        if how == "refit":
            led.measured(density)
            with self._lock:
                timing = self._timing.pop(model, None)
            if timing is not None:
                led.timed(timing.delta, timing.seconds)

    def failed(self, model: str, workers: Iterable[Worker]) -> None:
        self.ledger(model).wrote_and_failed([w.worker_id for w in workers])
