"""One-sided paths of a loaded plan in a transfer process: what this slot exposes as a
destination (at load) and the peers it writes into as a sender (when its executor is made).

A destination exposes, per path kind its receives use, every destination tensor of those
messages (the worker's memory, or the staging buffer of a staged pool) and a doorbell with
one entry per message, then publishes the descriptor in the rendezvous store
(refitd.transport.paths). A sender fetches the descriptor of each destination slot it
writes, checks it (path, epoch, plan, slot) and attaches to it. `PATH_KINDS` names the
path kinds this transfer process can take; another one plugs in there (its module imported
when a plan first uses it).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import numpy as np
import torch

from refitd.executor.errors import ExecutionError
from refitd.executor.onesided import OneSidedLinks
from refitd.executor.segments import block
from refitd.plan.links import COLLECTIVE, PATHS
from refitd.plan.program import SlotProgram
from refitd.plan.wire import PLAIN, RAW_CODE
from refitd.transfer.mapped import MappedResolver
from refitd.transport.doorbell import new_generation
from refitd.transport.errors import TransportError
from refitd.transport.paths import (
    Descriptor,
    Exposed,
    Exposure,
    Links,
    OneSidedPath,
    PathSettings,
)

# a message whose strided destination regions average runs below this many bytes lands
# packed on a path that `packs`: below the engine's 64 KiB per system call, a run's own
# request costs more than its bytes on the wire
LANDING_RUN_BYTES = 64 << 10

# path kind -> "module:class" of its OneSidedPath (imported when a plan first uses it)
PATH_KINDS = {
    "mapped": "refitd.transfer.mapped_path:MappedPath",
    "rdma": "refitd.transfer.rdma_path:RdmaPath",
}


def make_path(kind: str, settings: PathSettings | None = None) -> OneSidedPath:
    """A new path of this kind taking `settings`; TransportError if this transfer process
    has none."""
    where = PATH_KINDS.get(kind)
    if where is None:
        raise TransportError(
            f"path {kind!r} is not available in this transfer process; known: "
            f"{', '.join(PATH_KINDS)}"
        )
    module, _, name = where.partition(":")
    return getattr(importlib.import_module(module), name)(settings)


@dataclass
class Exposures:
    """What this slot exposed for one loaded plan: per path kind its exposure and the
    descriptor published for it."""

    by_kind: dict[str, tuple[Exposure, Descriptor]] = field(default_factory=dict)

    def close(self) -> None:
        for exposure, _ in self.by_kind.values():
            exposure.close()
        self.by_kind.clear()


def _by_kind(program: SlotProgram, side: str) -> dict[str, list[int]]:
    """Path kind -> row positions of the one-sided messages of one side of a program."""
    m = program.send if side == "send" else program.recv
    out: dict[str, list[int]] = {}
    for k, code in enumerate(m.path.tolist()):
        name = PATHS[code]
        if name != COLLECTIVE:
            out.setdefault(name, []).append(k)
    return out


def _run_bytes(v: torch.Tensor) -> int:
    """Bytes of the innermost contiguous run of a view (its whole size when contiguous)."""
    run = 1
    for n, st in zip(reversed(v.shape), reversed(v.stride()), strict=True):
        if n == 1:
            continue
        if st != run:
            break
        run *= n
    return run * v.element_size()


def landing_sizes(
    program: SlotProgram, rows: list[int], tensors: dict[int, Exposed], cap: int
) -> dict[int, int]:
    """Message id -> landing bytes (its wire bytes) of the received messages `rows` that
    land packed: raw copies into plain storage whose strided destination regions average
    runs shorter than LANDING_RUN_BYTES (one request per run otherwise), in order while
    their landing areas together stay within `cap` bytes."""
    c, r, out, held = program.copies, program.recv, {}, 0
    for k in rows:
        strided = runs = 0
        for i in range(int(r.start[k]), int(r.end[k])):
            t = tensors[int(c.dst[i])]
            if int(c.wire[i]) != RAW_CODE or t.storage != PLAIN:
                break
            nd = int(c.ndim[i])
            v = block(t.data, tuple(c.dst_off[i, :nd].tolist()), tuple(c.shape[i, :nd].tolist()))
            nbytes, run = v.numel() * v.element_size(), _run_bytes(v)
            if nbytes > run:
                strided, runs = strided + nbytes, runs + nbytes // run
        else:
            n = int(r.nbytes[k])
            if runs > 1 and strided < runs * LANDING_RUN_BYTES and held + n <= cap:
                out[int(r.id[k])] = n
                held += n
    return out


def expose(
    links: Links | None, program: SlotProgram, resolver: MappedResolver, raw: dict[int, bytes]
) -> Exposures:
    """Expose what senders on one-sided paths write into this slot, and publish it."""
    out = Exposures()
    kinds = _by_kind(program, "recv")
    if not kinds:
        return out
    if links is None:
        raise ExecutionError(
            f"slot {program.slot}: receives on one-sided paths need a connected communicator"
        )
    c = program.copies
    try:
        for kind, rows in kinds.items():
            r = program.recv
            mids = tuple(int(r.id[k]) for k in rows)
            spans = [np.arange(int(r.start[k]), int(r.end[k])) for k in rows]
            indices = np.unique(c.dst[np.concatenate(spans)]).tolist() if spans else []
            tensors = {}
            for i in indices:
                t = resolver.resolve(i)
                h = resolver.staging_handles.get(i)
                handle = h.to_bytes() if h is not None else raw.get(i, b"")
                if not handle:
                    raise ExecutionError(f"slot {program.slot}: no memory handle of tensor {i}")
                tensors[i] = Exposed(t.data, t.scales, t.storage, handle, t.global_scale)
            gen = new_generation()
            path = links.path(kind)
            cap = path.settings.rdma_landing_bytes
            landing = landing_sizes(program, rows, tensors, cap) if path.packs else None
            exposure = path.expose(tensors, len(mids), gen, landing=landing)
            d = Descriptor(kind, links.epoch, program.digest, program.slot, gen, mids,
                           exposure.body)  # fmt: skip
            out.by_kind[kind] = (exposure, d)
            links.publish(d)
    except BaseException:
        out.close()
        raise
    return out


def republish(links: Links, exposures: Exposures) -> None:
    """The same exposures under a new communicator epoch (a reconnect kept the plan)."""
    for kind, (exposure, d) in list(exposures.by_kind.items()):
        fresh = Descriptor(kind, links.epoch, d.digest, d.slot, d.generation, d.messages, d.body)
        exposures.by_kind[kind] = (exposure, fresh)
        links.publish(fresh)


def attach(links: Links | None, program: SlotProgram, exposures: Exposures) -> OneSidedLinks:
    """This slot's one-sided links for its executor: a peer per destination slot of its
    one-sided sends (descriptors fetched now), its own doorbell for its receives."""
    out = OneSidedLinks()
    for exposure, d in exposures.by_kind.values():  # a doorbell per path kind received on
        out.recv.update({m: (exposure.doorbell, k) for m, k in d.entry.items()})
        out.landing.update(exposure.landing_areas())
    sends = _by_kind(program, "send")
    if not sends:
        return out
    if links is None:
        raise ExecutionError(
            f"slot {program.slot}: sends on one-sided paths need a connected communicator"
        )
    s = program.send
    try:
        for kind, rows in sends.items():
            for slot in sorted({int(s.dst_slot[k]) for k in rows}):
                first = next(int(s.id[k]) for k in rows if int(s.dst_slot[k]) == slot)
                what = f"slot {program.slot}: message {first} to slot {slot} ({kind})"
                if slot in out.peers:
                    raise ExecutionError(f"{what}: slot {slot} is reached by two paths")
                d = links.fetch(kind, program.digest, slot, what)
                mine = [int(s.id[k]) for k in rows if int(s.dst_slot[k]) == slot]
                absent = [m for m in mine if m not in d.entry]
                if absent:
                    raise ExecutionError(
                        f"{what}: mismatched descriptor: it has no doorbell entry for "
                        f"messages {absent[:4]}"
                    )
                peer = links.path(kind).attach(d.body, what)
                out.peers[slot] = (peer, d)
                if peer.generation() != d.generation:
                    raise ExecutionError(
                        f"{what}: stale descriptor: slot {slot}'s doorbell shows generation "
                        f"{peer.generation()}, the descriptor {d.generation} (it loaded the "
                        "plan again since)"
                    )
    except BaseException:
        out.close()
        raise
    return out
