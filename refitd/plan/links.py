"""Paths of links: how the bytes of each message travel from its source slot to its
destination slot.

A link is a (source slot, destination slot) pair. A copy inside one slot is `local` (no
message). A message gets one of:
- `mapped`: both slots on one host, of one device kind, and both agents offer it: the
  sender's transfer process maps the destination's registered memory (shared memory on the
  CPU, CUDA IPC on a GPU) and writes into it;
- `rdma`: both agents offer it: one-sided writes into the destination's registered memory
  through a transfer engine (under `auto` only where both agents also offer `rdma-auto`:
  an RDMA fabric, or an operator who asked for it; over plain TCP the collective path is
  usually the faster one);
- `collective`: two-sided send and receive on the refit communicator (Gloo, NCCL).

`LinkPolicy` is what the planner is given: the mode (`auto` picks the best path each link
can take: mapped, else rdma, else collective; a forced mode gives every message that path
where its link can take it and `collective` elsewhere, counting those as fallbacks with
the reason) and, per slot, its host, device kind and the paths its agent offers. The policy
is part of the plan config, so the paths are part of the plan digest.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refitd.plan.errors import PlanError

COLLECTIVE, MAPPED, RDMA = "collective", "mapped", "rdma"
LOCAL = "local"  # a copy inside one slot (no message)
PATHS = (COLLECTIVE, MAPPED, RDMA)  # message path code -> name (the programs' path column)
POLICIES = ("auto", COLLECTIVE, MAPPED, RDMA)
ONE_SIDED = frozenset({MAPPED, RDMA})  # paths whose sender writes into the destination
RDMA_AUTO = "rdma-auto"  # an offer: `auto` may pick rdma on this agent's links
OFFERS = ONE_SIDED | {RDMA_AUTO}  # what an agent may offer
# why a forced path fell back to collective on a link (code -> text)
FALLBACKS = (
    "",
    "the slots are on different hosts",
    "the slots hold different kinds of device",
    "an agent of the link does not offer it",
    "a slot of the link is unknown to the policy",
)


@dataclass(frozen=True, slots=True)
class SlotSite:
    """Where a slot is and what its agent offers: host name, device kind ("cpu", "cuda")
    and the one-sided paths its transfer processes can take."""

    slot: int
    host: str
    device: str
    offers: tuple[str, ...] = ()


@dataclass(frozen=True)
class LinkPolicy:
    """The links setting and the slots' sites (sorted by slot; see the module docstring)."""

    mode: str = COLLECTIVE
    sites: tuple[SlotSite, ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in POLICIES:
            raise PlanError(f"unknown links policy {self.mode!r}; known: {', '.join(POLICIES)}")
        slots = [s.slot for s in self.sites]
        if slots != sorted(set(slots)):
            raise PlanError("link policy sites must be sorted by slot, one per slot")

    @classmethod
    def of(cls, mode: str, sites: list[SlotSite] | tuple[SlotSite, ...]) -> LinkPolicy:
        """A policy over `sites` in any order (sorted here)."""
        return cls(mode, tuple(sorted(sites, key=lambda s: s.slot)))

    def choose(self, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per message (source slot, destination slot): the path code (into PATHS) and the
        fallback code (into FALLBACKS, 0: none) of a forced path the link cannot take."""
        n = src.size
        path = np.zeros(n, np.uint8)
        fallback = np.zeros(n, np.uint8)
        if self.mode == COLLECTIVE or not n:
            return path, fallback
        # per message the row of each end's site; row len(sites) (unknown) matches nothing
        unknown = len(self.sites)
        a, b = self._rows(src), self._rows(dst)
        found = (a < unknown) & (b < unknown)
        host = _codes([s.host for s in self.sites])
        kind = _codes([s.device for s in self.sites])
        same_host = found & (host[a] == host[b])
        same_kind = found & (kind[a] == kind[b])
        both = {o: (on := self._offered(o))[a] & on[b] for o in OFFERS}
        can = {p: found & both[p] for p in ONE_SIDED}
        can[MAPPED] &= same_host & same_kind
        if self.mode == "auto":
            path[can[RDMA] & both[RDMA_AUTO]] = PATHS.index(RDMA)
            path[can[MAPPED]] = PATHS.index(MAPPED)
            return path, fallback
        want = self.mode
        path[can[want]] = PATHS.index(want)
        why = np.full(n, FALLBACKS.index("an agent of the link does not offer it"), np.uint8)
        if want == MAPPED:
            why[~same_kind] = FALLBACKS.index("the slots hold different kinds of device")
            why[~same_host] = FALLBACKS.index("the slots are on different hosts")
        why[~found] = FALLBACKS.index("a slot of the link is unknown to the policy")
        fallback[~can[want]] = why[~can[want]]
        return path, fallback

    def _rows(self, slots: np.ndarray) -> np.ndarray:
        """Site row of every slot in `slots`, len(sites) for a slot without a site: one
        gather from a table indexed by slot (slots are small non-negative integers)."""
        unknown = len(self.sites)
        top = max(int(slots.max(initial=0)), self.sites[-1].slot if self.sites else 0)
        lut = np.full(top + 1, unknown, np.int64)
        lut[[s.slot for s in self.sites]] = np.arange(unknown)
        return lut[slots]

    def _offered(self, offer: str) -> np.ndarray:
        """Per site row whether its agent offers `offer`, and False last (an unknown slot)."""
        return np.array([offer in s.offers for s in self.sites] + [False], bool)


def _codes(values: list[str]) -> np.ndarray:
    """Equal strings -> equal integers, and -1 last (the row of an unknown slot)."""
    ids: dict[str, int] = {}
    return np.array([ids.setdefault(v, len(ids)) for v in values] + [-1], np.int64)


def path_summary(
    path: np.ndarray,
    nbytes: np.ndarray,
    fallback: np.ndarray,
    local_copies: int,
    local_bytes: int,
    mode: str,
) -> dict[str, object]:
    """Messages and bytes per path (and local copies), and the fallbacks of a forced mode
    by reason: what the refit record and the status show."""
    out: dict[str, object] = {"policy": mode}
    counts = np.bincount(path.astype(np.int64), minlength=len(PATHS))
    sums = np.bincount(path.astype(np.int64), weights=nbytes, minlength=len(PATHS))
    for code, name in enumerate(PATHS):
        if counts[code]:
            out[name] = {"messages": int(counts[code]), "bytes": int(sums[code])}
    if local_copies:
        out[LOCAL] = {"copies": local_copies, "bytes": local_bytes}
    why = np.bincount(fallback.astype(np.int64), minlength=len(FALLBACKS))
    falls = {FALLBACKS[k]: int(why[k]) for k in range(1, len(FALLBACKS)) if why[k]}
    if falls:
        out["fallback"] = {"to": COLLECTIVE, "from": mode, "messages": falls}
    return out
