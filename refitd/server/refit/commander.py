"""The agent commander: the only place that builds agent commands (connect, load,
execute, apply, abort) and gathers the agents' reports.

The refit communicator is one for all models. Refits of different models run on it at once,
each in a lane of its own (its own tag space, its model's weight on shared links); a refit
of one model holds that model's `turn`. Setting the communicator and programs up is one at
a time, and rebuilding the communicator waits until no transfer runs on it. What each slot's
transfer process holds (agent incarnation, communicator epoch, loaded programs) is tracked
here, so a refit whose plan is connected and loaded everywhere starts with a dict compare.
A program goes to a slot only when the slot lacks it or loaded it with other workers'
memory handles (a worker on the slot registered again), or its transfer process does not
hold it (a connect reports what each holds: a restarted one holds none). After a restart
that keeps every layout, only the restarted rank's slots get theirs (`stale_slots`).
One ExecuteCommand goes to each agent for all its slots, reports batched per agent.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from refitd._proto import refitd_pb2 as pb
from refitd.config import Settings
from refitd.plan.lanes import LANE_PIECE, LANES
from refitd.server.delta.refits import DeltaRefits
from refitd.server.metrics import ControllerMetrics
from refitd.server.planning import PlanCache, SlotInputs, stale_slots
from refitd.server.refit.checksums import compare_checksums
from refitd.server.refit.load_handles import LoadHandles
from refitd.server.refit.membership import Membership
from refitd.server.refit.run import RefitRun, attempt_id
from refitd.server.registry import Registry
from refitd.server.streams import AgentHub, Gather, GatherBoard, PhaseFailed


@dataclass
class SlotLoadState:
    """What a slot's transfer process holds: its agent incarnation, comm epoch, and per
    model the plan digest last loaded with the inputs its handles came from (see
    planning.slot_inputs). One per model: loading a plan may free the model's older ones
    there (their staging buffers), so only the last is known to be loaded."""

    incarnation: int
    comm_epoch: int = 0
    loaded: dict[str, tuple[str, SlotInputs]] = field(default_factory=dict)

    def inputs(self, model: str, digest: str) -> SlotInputs | None:
        """The inputs the slot loaded `digest` with, if it is the model's loaded plan."""
        last = self.loaded.get(model)
        return last[1] if last is not None and last[0] == digest else None

    def held(self, digests: frozenset[str]) -> None:
        """Keep only the loads its transfer process says it holds (a new one: none)."""
        self.loaded = {m: v for m, v in self.loaded.items() if v[0] in digests}


class CommunicatorTurn:
    """This driver's turn for its model (acquired at construction); release() is
    idempotent so every exit path can call it."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        lock.acquire()
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._lock.release()


class AgentCommander:
    """Commands to the node agents over their Commands streams, and the waits on reports."""

    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        agents: AgentHub,
        board: GatherBoard,
        delta: DeltaRefits,
        store_address: tuple[str, int] | None,
        metrics: ControllerMetrics,
        plans: PlanCache,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.plans = plans  # its programs_sent count
        self.registry = registry
        self.agents = agents
        self.board = board
        self.delta = delta
        self.store_address = store_address
        self._slots: dict[int, SlotLoadState] = {}
        self.handles = LoadHandles(registry)
        self._comm_key: tuple | None = None
        self._comm_epoch = 0
        # model -> (digest, epoch, comm epoch) connected and loaded on every slot of its
        # plan: the same digest in a later epoch may need some slots loaded again
        self._ready: dict[str, tuple[str, int, int]] = {}
        self._turns: dict[str, threading.Lock] = {}
        self._setup = threading.Lock()  # connect and load, one model at a time
        self._lanes = threading.Condition()
        self._lane_of: dict[int, str] = {}  # lanes of the transfers running -> model

    def turn(self, model: str) -> CommunicatorTurn:
        """Wait for, and take, the turn of `model` (one refit or catch-up per model)."""
        with self._lanes:
            lock = self._turns.setdefault(model, threading.Lock())
        return CommunicatorTurn(lock)

    def prepare(self, ms: Membership) -> None:
        """Communicator and programs in place on every slot (a dict compare when they are)."""
        with self._setup:
            self._prepare(ms)

    def _prepare(self, ms: Membership) -> None:
        if self._ready.get(ms.model) == (ms.plan.digest, ms.epoch, self._comm_epoch):
            return
        self._connect(ms)
        self._load(ms)
        self._ready[ms.model] = (ms.plan.digest, ms.epoch, self._comm_epoch)

    def _take_lane(self, ms: Membership) -> tuple[int, int]:
        """A lane for this transfer (the lowest free) and the piece size of its chunks on
        shared links: LANE_PIECE while programs of several models are in place on the
        communicator (their refits may run at once), else 0 (whole chunks). Its setup is
        checked again first, under the setup lock, so no rebuild of the communicator comes
        in between."""
        with self._setup:
            self._prepare(ms)
            # an NCCL communicator serves one thread, and the delta path's tags have no
            # lanes: then transfers take turns
            one = self.settings.transport == "nccl" or self.settings.delta_refits
            lanes = 1 if one else LANES
            with self._lanes:
                if not self._lanes.wait_for(
                    lambda: len(self._lane_of) < lanes, self.settings.transfer_timeout_s
                ):
                    raise PhaseFailed(f"no free lane: {lanes} models are transferring")
                lane = min(set(range(LANES)) - set(self._lane_of))
                self._lane_of[lane] = ms.model
            models = sum(1 for r in self._ready.values() if r[2] == self._comm_epoch)
            return lane, LANE_PIECE if lanes > 1 and models > 1 else 0

    def _free_lane(self, lane: int) -> None:
        with self._lanes:
            self._lane_of.pop(lane, None)
            self._lanes.notify_all()

    def _await_no_transfer(self, ms: Membership) -> None:
        """Before the communicator is rebuilt: wait until no transfer runs on it."""
        wait_s = self.settings.transfer_timeout_s + self.settings.connect_timeout_s
        with self._lanes:
            if not self._lanes.wait_for(lambda: not self._lane_of, wait_s):
                busy = sorted(set(self._lane_of.values()))
                raise PhaseFailed(
                    f"model {ms.model!r}: the communicator must be rebuilt for its plan, and "
                    f"refits of {busy} kept transferring on it for {wait_s:.0f} s"
                )

    def _gather(self, what: str, ms: Membership) -> tuple[Gather, int]:
        g = Gather(what)
        g.watch = ms.members
        return g, self.board.add(g)

    def _end_gather(self, g: Gather, gid: int) -> None:
        self.agents.forget(g)
        self.board.remove(gid)

    def _track_incarnations(self, ms: Membership) -> None:
        """Slot state of re-registered agents starts afresh."""
        for slot, incarnation in ms.owners.incarnations.items():
            st = self._slots.get(slot)
            if st is None or st.incarnation != incarnation:
                self._slots[slot] = SlotLoadState(incarnation)
                self._ready.clear()

    def _connect(self, ms: Membership) -> None:
        plan = ms.plan
        self._track_incarnations(ms)
        key = (tuple(plan.slots), tuple(self._slots[s].incarnation for s in plan.slots))
        if key == self._comm_key and all(
            self._slots[s].comm_epoch == self._comm_epoch for s in plan.slots
        ):
            return
        if self.store_address is None:
            raise PhaseFailed("the rendezvous store is not running (rendezvous disabled)")
        self._await_no_transfer(ms)
        self._comm_epoch += 1
        ranks = {slot: i for i, slot in enumerate(plan.slots)}
        held: dict[int, frozenset[str]] = {}  # slot -> the plans its transfer process holds

        def connected(r: pb.AgentReport) -> None:
            held[r.slot] = frozenset(r.loaded_plans)

        g, gid = self._gather("connect", ms)
        try:
            for agent_id, slots in ms.by_agent.items():
                cmd = pb.AgentCommand(
                    connect=pb.ConnectCommand(
                        epoch=self._comm_epoch,
                        store_host=self.store_address[0],
                        store_port=self.store_address[1],
                        world_size=len(ranks),
                        comm_rank=ranks,
                        transport=self.settings.transport,
                        timeout_s=self.settings.connect_timeout_s,
                        store_token=self.settings.store_token,
                    )
                )
                keys = [(s, pb.REPORT_KIND_CONNECTED) for s in slots]
                self.agents.send(agent_id, cmd, g, keys, on_report=connected)
            g.wait(self.settings.connect_timeout_s)
        finally:
            self._end_gather(g, gid)
        for s in plan.slots:
            self._slots[s].comm_epoch = self._comm_epoch
            self._slots[s].held(held.get(s, frozenset()))
        self._comm_key = key

    def _load(self, ms: Membership) -> None:
        """LoadProgramCommand to the slots whose program of this plan is missing or was
        loaded with other workers' memory handles; the others keep theirs."""
        plan = ms.plan
        identity = self.registry.identities(ms.model)
        todo = stale_slots(
            plan,
            lambda slot: self._slots[slot].inputs(ms.model, plan.digest),
            lambda key: identity.get(key, ""),
            ms.staged_pools,
            ms.snapshot_pools,
        )
        if not todo:
            return
        handles = self.handles.of(ms, todo)
        g, gid = self._gather("load program", ms)
        try:
            for agent_id, slots in ms.by_agent.items():
                for slot in slots:
                    if slot not in todo:
                        continue
                    load = pb.LoadProgramCommand(
                        model=ms.model,
                        digest=plan.digest,
                        slot=slot,
                        program=bytes(plan.load_payload(slot).program),
                    )
                    load.MergeFromString(handles[slot])
                    cmd = pb.AgentCommand(load=load)
                    self.agents.send(agent_id, cmd, g, [(slot, pb.REPORT_KIND_LOADED)])
            g.wait(self.settings.load_timeout_s)
        finally:
            self._end_gather(g, gid)
        for s, inputs in todo.items():
            self._slots[s].loaded[ms.model] = (plan.digest, inputs)
        self.metrics.programs_sent.labels(ms.model).inc(len(todo))
        self.plans.programs_sent += len(todo)

    # ------------------------------------------------------------------ transfer
    def transfer(self, ms: Membership, run: RefitRun, cond: threading.Condition) -> float:
        """ExecuteCommand to every slot (one per agent); returns when all are DONE (the
        monotonic time of the last DONE). Source releases update `run` under `cond`."""
        plan = ms.plan
        exec_id = attempt_id(run.refit_id, run.attempt)
        tally = _TransferTally(run, cond, self.delta, plan.digest, exec_id)
        timeout = self.settings.transfer_timeout_s
        verify = self.settings.verify_checksums
        deltas = self._delta_commands(ms, run, exec_id)
        lane, piece = self._take_lane(ms)
        weight = self.settings.model_weight(run.model)
        g, gid = self._gather(f"transfer of version {run.version}", ms)
        try:
            for agent_id, slots in ms.by_agent.items():
                batched = agent_id in ms.batch_agents
                for batch in [slots] if batched else [[slot] for slot in slots]:
                    cmd = pb.AgentCommand(
                        execute=pb.ExecuteCommand(
                            model=run.model,
                            digest=plan.digest,
                            slot=batch[0],
                            slots=batch if batched else (),
                            version=run.version,
                            refit_id=exec_id,
                            timeout_s=timeout,
                            verify=verify,
                            delta=[deltas[s] for s in batch if s in deltas],
                            lane=lane,
                            share_weight=weight,
                            share_piece=piece,
                        )
                    )
                    keys = [
                        (slot, kind)
                        for slot in batch
                        for kind in (pb.REPORT_KIND_SOURCES_RELEASED, pb.REPORT_KIND_DONE)
                    ]
                    self.agents.send(agent_id, cmd, g, keys, tally.on_report)
            sent = time.monotonic()
            run.detail["control_start_s"] = sent - max(run.started, run.last_ask)
            run.detail["last_ask_at"] = run.last_ask  # monotonic: for benchmarks on this host
            run.detail["executes_sent_at"] = sent
            g.wait(timeout)
        finally:
            self._free_lane(lane)
            self._end_gather(g, gid)
            self.delta.finish_attempt(exec_id, run.detail)
        if verify:
            t = time.monotonic()
            mismatch = compare_checksums(plan, tally.sums[True], tally.sums[False])
            if mismatch:
                raise PhaseFailed(f"transfer of version {run.version}: {mismatch}")
            run.detail.update(verified=True, verify_check_s=time.monotonic() - t)
        return tally.last_done or time.monotonic()

    def _delta_commands(
        self, ms: Membership, run: RefitRun, exec_id: int
    ) -> dict[int, pb.DeltaCommand]:
        committed = self.registry.committed_version(run.model)
        # Gloo carries host buffers (NCCL only device ones): there GPU slots join the path
        slots = self.registry.delta_slots(self.settings.transport == "gloo")
        return self.delta.commands(
            run.model, ms.plan, ms.dest_workers, ms.staged_pools | ms.adapter_pools, committed,
            exec_id,
            run.detail, slots,
        )  # fmt: skip

    def apply(self, ms: Membership, run: RefitRun, slots: set[int]) -> None:
        """ApplyCommand (staging -> live) for `slots` to their agents; returns when every
        one is DONE (PhaseFailed otherwise). Idempotent: the transfer processes refuse it
        unless their staging holds this attempt's transfer in full."""
        s = self.settings
        g, gid = self._gather(f"apply of version {run.version}", ms)
        try:
            for agent_id, agent_slots in ms.by_agent.items():
                mine = [slot for slot in agent_slots if slot in slots]
                if not mine:
                    continue
                cmd = pb.AgentCommand(
                    apply=pb.ApplyCommand(
                        model=run.model,
                        digest=ms.plan.digest,
                        slots=mine,
                        version=run.version,
                        refit_id=attempt_id(run.refit_id, run.attempt),
                        timeout_s=s.commit_timeout_s,
                    )
                )
                keys = [(slot, pb.REPORT_KIND_DONE) for slot in mine]
                self.agents.send(agent_id, cmd, g, keys)
            g.wait(s.commit_timeout_s)
        finally:
            self._end_gather(g, gid)

    def abort(self, ms: Membership, run: RefitRun, reason: str) -> None:
        """AbortCommand (this attempt's id) to every connected agent of the plan; the
        communicator is rebuilt and programs reloaded before the next execute."""
        for agent_id in ms.by_agent:
            try:
                cmd = pb.AgentCommand(
                    abort=pb.AbortCommand(
                        refit_id=attempt_id(run.refit_id, run.attempt), reason=reason
                    )
                )
                self.agents.send(agent_id, cmd, None)
            except PhaseFailed:
                pass
        with self._setup:
            self._comm_key = None
            self._ready.clear()


class _TransferTally:
    """What the reports of one transfer attempt say: sources released, bytes, checksums."""

    def __init__(
        self, run: RefitRun, cond: threading.Condition, delta: DeltaRefits, digest: str,
        exec_id: int,
    ) -> None:  # fmt: skip
        self.run = run
        self.cond = cond
        self.delta = delta
        self.digest = digest
        self.exec_id = exec_id
        self.last_done = 0.0
        # sender side? -> message id -> (reporting slot, checksum)
        self.sums: dict[bool, dict[int, tuple[int, int]]] = {True: {}, False: {}}

    def on_report(self, r: pb.AgentReport) -> None:
        run = self.run
        if r.kind == pb.REPORT_KIND_SOURCES_RELEASED:
            with self.cond:
                run.release(r.slot)
        elif r.kind == pb.REPORT_KIND_DONE:
            moved = r.bytes_sent + r.bytes_received + r.bytes_local
            run.slot_stats[r.slot] = (moved, r.seconds)
            run.bytes += r.bytes_sent + r.bytes_local
            for c in r.checksums:
                self.sums[c.sent][c.message_id] = (r.slot, c.checksum)
            self.delta.reported(run.model, self.digest, self.exec_id, r)
            if r.snapshot_bytes or r.snapshot_fallback:
                snaps = run.detail.setdefault("snapshot", {})
                snaps[str(r.slot)] = {
                    "bytes": r.snapshot_bytes,
                    "fallback": r.snapshot_fallback,
                }
            self.last_done = time.monotonic()
            if r.first_landed_ago_s:
                _landed(run.detail, self.last_done, r)


def _landed(detail: dict, now: float, r: pb.AgentReport) -> None:
    """The refit's first and last received chunks over its slots (monotonic, like
    executes_sent_at; the first one's bytes): between them its bytes arrived, the interval
    of its share of a link shared with others."""
    first, last = now - r.first_landed_ago_s, now - r.last_landed_ago_s
    if "first_landed_at" not in detail or first < detail["first_landed_at"]:
        detail["first_landed_at"], detail["first_landed_bytes"] = first, r.first_landed_bytes
    detail["last_landed_at"] = max(last, detail.get("last_landed_at", last))
