"""Version safety of delta refits: which messages may go as deltas, decided by the controller.

A delta turns the sender's base version into the new one; applied to anything else it
silently produces weights that never existed. So a message goes as a delta only when every
destination worker it writes provably holds exactly the sender's base version, bit for bit:
the version was written into that worker's current memory by a complete refit of this
controller, under the same plan, and nothing has written into it since. Everything else goes
dense: a new replica, a restarted worker (a version it claims at registration is not proof),
a worker caught up from a replica, one whose last refit failed part-way, a new plan, a
sender without a base (or with one from another plan), a destination that converts on landing.
A refit whose predicted density is above the threshold goes dense as a whole; it is probed
again every `probe_every` refits.

Pure: no gRPC, no tensors, no bytes. Per-message decisions are vectorised over NumPy columns
(message -> source slot; message x destination worker pairs), so a plan of many thousand
messages is decided in microseconds per message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

UNKNOWN = -1  # a held or base version that is not known exactly


class Why(IntEnum):
    """Why a message goes the way it goes (the refit record counts messages per reason)."""

    DELTA = 0
    DISABLED = 1  # delta refits are off
    DENSITY = 2  # the refit's predicted density is above the threshold
    NO_BASE = 3  # the sender holds no base, or one from another plan
    FORMAT = 4  # a destination converts on landing (cast, quantize, dequantize)
    UNKNOWN_BASE = 5  # a destination's version is not known exactly
    OTHER_VERSION = 6  # a destination holds another version than the sender's base
    SLOWER = 7  # the last delta refit took longer than the last dense one
    LINK = 8  # its link is one-sided (mapped, rdma): the sender writes in place, dense


@dataclass(frozen=True, slots=True)
class Landing:
    """A version a complete refit of this controller wrote into a destination worker."""

    version: int
    registered_at: float  # the worker registration (incarnation) it was written into
    plan_key: str  # layout identity of the plan that wrote it
    how: str = "refit"  # "refit" | "catch_up"


@dataclass(frozen=True, slots=True)
class DestinationState:
    """What the controller knows of one destination worker's memory."""

    worker_id: str
    registered_at: float  # its current registration
    landed: Landing | None  # the last complete landing recorded for it
    torn: bool = False  # a refit wrote into it part-way and failed after `landed`


@dataclass(frozen=True, slots=True)
class SenderBase:
    """The version a source slot's base buffer holds, and the plan it was cut for."""

    version: int
    plan_key: str


@dataclass(frozen=True)
class DeltaSettings:
    enabled: bool = False
    max_density: float = 0.4  # a refit (and a message) denser than this goes dense
    probe_every: int = 8  # after a dense-by-density refit, measure again this often
    speed_rule: bool = True  # dense while the last delta refit was slower than a dense one


def held_version(dest: DestinationState, plan_key: str) -> tuple[int, str]:
    """(the version dest holds exactly, or UNKNOWN; why), from its landing record."""
    landed = dest.landed
    if landed is None:
        return UNKNOWN, "nothing landed by a refit since it registered (new replica or restart)"
    if landed.registered_at != dest.registered_at:
        return UNKNOWN, f"restarted since version {landed.version} landed"
    if dest.torn:
        return UNKNOWN, "its last refit failed part-way"
    if landed.how != "refit":
        return UNKNOWN, f"version {landed.version} came by {landed.how}, not from the senders"
    if landed.plan_key != plan_key:
        return UNKNOWN, f"version {landed.version} landed under another plan"
    return landed.version, f"holds version {landed.version}"


@dataclass(frozen=True)
class RefitMode:
    """Whether a refit may use deltas at all, and why."""

    delta: bool
    why: Why
    reason: str


@dataclass(frozen=True, slots=True)
class Timing:
    """How long one refit's transfer took, and whether it sent deltas."""

    delta: bool
    seconds: float


def _slower(settings: DeltaSettings, timings: Sequence[Timing]) -> RefitMode | None:
    """Dense when the last delta refit was slower than the last dense one before it (a fast
    link, a slow codec); deltas are tried again `probe_every` refits after that one."""
    last = next((i for i in range(len(timings) - 1, -1, -1) if timings[i].delta), None)
    if last is None or not settings.speed_rule:
        return None
    dense = next((t for t in reversed(timings[:last]) if not t.delta), None)
    ago = len(timings) - last
    d = timings[last]
    if dense is None or d.seconds <= dense.seconds or ago >= settings.probe_every:
        return None
    return RefitMode(
        False,
        Why.SLOWER,
        f"the last delta refit took {d.seconds:.3g} s, the last dense one {dense.seconds:.3g} s "
        f"(measured {ago} refits ago)",
    )


def refit_mode(
    settings: DeltaSettings, recent: Sequence[float | None], timings: Sequence[Timing] = ()
) -> RefitMode:
    """Decide from the achieved densities of the model's recent refits (oldest first; None
    where a refit measured none) and their transfer times (oldest first) whether this refit
    tries deltas: never where a delta refit measured slower than dense (never slower than
    dense: a codec slower than the link)."""
    if not settings.enabled:
        return RefitMode(False, Why.DISABLED, "delta refits are disabled")
    slower = _slower(settings, timings)
    if slower is not None:
        return slower
    measured = [(ago, d) for ago, d in enumerate(reversed(recent), 1) if d is not None]
    if measured:
        ago, density = measured[0]
        if density > settings.max_density and ago < settings.probe_every:
            return RefitMode(
                False,
                Why.DENSITY,
                f"predicted density {density:.3g} above the threshold "
                f"{settings.max_density:g} (measured {ago} refits ago)",
            )
    return RefitMode(True, Why.DELTA, "deltas where every destination holds the base")


@dataclass(frozen=True)
class DeltaMessageColumns:
    """The plan's messages as columns: source slot and delta capability per message, and the
    (message, destination worker) pairs of every destination worker a message writes."""

    src_slot: np.ndarray  # int64 [messages]
    capable: np.ndarray  # bool [messages]: every copy lands without conversion
    pair_message: np.ndarray  # int64 [pairs]
    pair_worker: np.ndarray  # int64 [pairs]: index into the workers sequence
    one_sided: np.ndarray | None = None  # bool [messages]: on a one-sided path (dense)


@dataclass(frozen=True)
class DeltaDecision:
    """Per message: delta or dense, and the reason (Why codes)."""

    delta: np.ndarray  # bool [messages]
    why: np.ndarray  # int8 [messages]
    mode: RefitMode
    base_version: int  # the base the deltas are against (UNKNOWN: none)
    dense_workers: dict[str, str]  # worker_id -> why its messages went dense

    def summary(self) -> dict[str, object]:
        """For the refit record: messages per reason and the base."""
        counts = np.bincount(self.why.astype(np.int64), minlength=len(Why))
        return {
            "delta_messages": int(self.delta.sum()),
            "dense_messages": int((~self.delta).sum()),
            "dense_why": {w.name.lower(): int(counts[w]) for w in Why if w and counts[w]},
            "base_version": self.base_version,
            "mode": self.mode.reason,
        }


def decide(
    settings: DeltaSettings,
    mode: RefitMode,
    plan_key: str,
    columns: DeltaMessageColumns,
    senders: Mapping[int, SenderBase],
    workers: Sequence[DestinationState],
) -> DeltaDecision:
    """Delta or dense for every message of a refit (see the module docstring for the rules)."""
    n = columns.src_slot.size
    why = np.full(n, Why.DELTA, dtype=np.int8)
    if not mode.delta:
        why[:] = mode.why
        return DeltaDecision(np.zeros(n, dtype=bool), why, mode, UNKNOWN, {})
    slots = np.unique(columns.src_slot)
    base_of = np.array(
        [
            senders[s].version
            if s in senders and senders[s].plan_key == plan_key and senders[s].version >= 0
            else UNKNOWN
            for s in slots.tolist()
        ],
        dtype=np.int64,
    )
    msg_base = base_of[np.searchsorted(slots, columns.src_slot)] if n else base_of[:0]
    held = [held_version(w, plan_key) for w in workers]
    held_arr = np.array([v for v, _ in held], dtype=np.int64)
    reasons = [r for _, r in held]
    pair_held = held_arr[columns.pair_worker]
    pair_base = msg_base[columns.pair_message]
    unknown = np.zeros(n, dtype=bool)
    unknown[columns.pair_message[pair_held == UNKNOWN]] = True
    other = np.zeros(n, dtype=bool)
    other[columns.pair_message[(pair_held != UNKNOWN) & (pair_held != pair_base)]] = True
    # the first failing rule names the reason (most fundamental first)
    link = columns.one_sided if columns.one_sided is not None else np.zeros(n, dtype=bool)
    for mask, code in (
        (link, Why.LINK),
        (msg_base == UNKNOWN, Why.NO_BASE),
        (~columns.capable, Why.FORMAT),
        (unknown, Why.UNKNOWN_BASE),
        (other, Why.OTHER_VERSION),
    ):
        why[(why == Why.DELTA) & mask] = code
    bad = (pair_held == UNKNOWN) | ((pair_base != UNKNOWN) & (pair_held != pair_base))
    dense_workers = {
        workers[i].worker_id: (
            reasons[i] if held_arr[i] == UNKNOWN else f"holds version {held_arr[i]}, not the base"
        )
        for i in np.unique(columns.pair_worker[bad]).tolist()
    }
    bases = np.unique(msg_base[msg_base != UNKNOWN])
    base_version = int(bases[0]) if bases.size == 1 else UNKNOWN
    return DeltaDecision(why == Why.DELTA, why, mode, base_version, dense_workers)


@dataclass
class DeltaLedger:
    """What the controller knows for delta refits of one model, kept in memory: each
    destination worker's last landing, each source slot's base as its agent reported it, and
    the achieved densities of recent refits. A controller restart forgets it, so the first
    refit after one goes dense (safe)."""

    landed: dict[str, Landing]
    torn: set[str]
    slots: dict[int, tuple[int, int, str]]  # slot -> (base, pending version, plan key)
    densities: list[float | None]
    timings: list[Timing] = field(default_factory=list)

    @classmethod
    def empty(cls) -> DeltaLedger:
        return cls({}, set(), {}, [])

    def timed(self, delta: bool, seconds: float, keep: int = 32) -> None:
        """A refit attempt's transfer took `seconds` (with deltas or not)."""
        self.timings = [*self.timings, Timing(delta, seconds)][-keep:]

    def committed(self, version: int, plan_key: str, workers: Mapping[str, float],
                  how: str = "refit") -> None:  # fmt: skip
        """`version` landed in full in `workers` (worker_id -> registered_at)."""
        for wid, registered_at in workers.items():
            self.landed[wid] = Landing(version, registered_at, plan_key, how)
            self.torn.discard(wid)

    def wrote_and_failed(self, worker_ids: Sequence[str]) -> None:
        """A refit wrote into these workers and failed: their memory may be torn."""
        self.torn.update(worker_ids)

    def reported(self, slot: int, base: int, pending: int, plan_key: str) -> None:
        """A source slot's base and pending versions after an execute."""
        self.slots[slot] = (base, pending, plan_key)

    def measured(self, density: float | None, keep: int = 32) -> None:
        self.densities = [*self.densities, density][-keep:]

    def destination(self, worker_id: str, registered_at: float) -> DestinationState:
        return DestinationState(
            worker_id, registered_at, self.landed.get(worker_id), worker_id in self.torn
        )

    def senders(self, promote: int, plan_key: str) -> dict[int, SenderBase]:
        """Each source slot's base once it has been told that `promote` is committed
        everywhere (its agent promotes its pending version if it is that one, and forgets
        its base otherwise)."""
        out = {}
        for slot, (base, pending, key) in self.slots.items():
            after = promote if promote >= 0 and promote in (base, pending) else UNKNOWN
            out[slot] = SenderBase(after, key if key == plan_key else "")
        return out
