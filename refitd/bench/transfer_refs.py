"""References of `refitd bench transfer`, measured in the same run between the same
transfer processes as the refit they are compared to: raw link sends, memcpys between
shared-memory buffers, and the controller's checksum comparison."""

from __future__ import annotations

import math
import statistics
import time
from collections import defaultdict

from refitd.slot_protocol import Probe


def keep_memcpy_buffers(args, handles, per_slot: dict[int, int]) -> None:
    """Allocate each slot's kept memcpy buffers now, beside the worker memory the bench
    just registered (as old as it: a VM backs fresh pages more slowly than old ones)."""
    by_slot = {h.slot: h for h in handles}
    for s, n in per_slot.items():
        if n > 0:
            size = min(n, args.ref_chunk)
            by_slot[s].send(Probe(args.timeout, memcpy=size, prepare=True, kept=True)).result()


def memcpy_of(
    args, handles, per_slot: dict[int, int], piece: int | None = None, kept: bool = False
) -> float:
    """Seconds of a memcpy of `per_slot[slot]` bytes between two shared-memory buffers in
    each of those slots' processes, all at once, --ref-chunk bytes at a time (two whole
    copies of a 2 GiB slot would double the run's shared memory), in `piece`-byte copies
    when given."""
    by_slot = {h.slot: h for h in handles}
    sizes = {
        s: {
            "memcpy": min(n, args.ref_chunk),
            "repeat": ref_sizes(n, args.ref_chunk)[1],
            "memcpy_piece": piece,
            "kept": kept,
        }
        for s, n in per_slot.items()
        if n > 0
    }
    for slot, size in sizes.items():
        by_slot[slot].send(Probe(args.timeout, prepare=True, **size)).result()
    t0 = time.monotonic()
    pend = [by_slot[slot].send(Probe(args.timeout, **size)) for slot, size in sizes.items()]
    for p in pend:
        p.result()
    seconds = time.monotonic() - t0
    release(args, handles)
    return seconds


def memcpy_reference(args, handles, src) -> float:
    """A memcpy of each source slot's source bytes, all slots at once: what a snapshot
    release must at least cost the trainer."""
    per_slot: dict[int, int] = defaultdict(int)
    for s in src:
        per_slot[s.slot] += math.prod(s.local_shape) * 2
    return memcpy_of(args, handles, per_slot)


def sent_memcpy_reference(args, handles, reports, piece: int) -> float:
    """A memcpy of the bytes each slot sent in a refit, in that slot's process, all at
    once, in copies of the refit's chunk size (`piece`), between its kept buffers: what
    one-sided writes by the same processes are measured against."""
    return memcpy_of(args, handles, {r.slot: r.sent_bytes for r in reports}, piece, kept=True)


def compare_reports(plan, handles, reports) -> str | None:
    """The controller's comparison of a verified refit's per-message checksums."""
    from refitd.server.refit.checksums import compare_checksums

    sent, landed = {}, {}
    for h, r in zip(handles, reports, strict=True):
        sent |= {i: (h.slot, c) for i, c in r.checksums["send"].items()}
        landed |= {i: (h.slot, c) for i, c in r.checksums["recv"].items()}
    return compare_checksums(plan, sent, landed)


def link_reference(args, handles, plan, rank_of, reports) -> float:
    """Seconds of the raw reference moving the same bytes between the same processes."""
    if args.transport == "local":
        return memcpy_of(args, handles, {r.slot: r.local_bytes for r in reports})
    pair: dict[tuple[int, int], int] = defaultdict(int)
    for r in reports:
        for m in r.messages:
            if m.direction == "send":
                pair[(r.slot, m.peer_slot)] += m.nbytes
    pend = []
    for h in handles:
        sends = {
            rank_of[d]: ref_sizes(n, args.ref_chunk) for (s, d), n in pair.items() if s == h.slot
        }
        recvs = {
            rank_of[s]: ref_sizes(n, args.ref_chunk) for (s, d), n in pair.items() if d == h.slot
        }
        pend.append((h, sends, recvs))
    # buffers are allocated before the clock starts: a prepare call, then the timed run
    for h, sends, recvs in pend:
        h.send(Probe(args.timeout, sends=sends, recvs=recvs, prepare=True)).result()
    t0 = time.monotonic()
    started = [h.send(Probe(args.timeout, sends=sends, recvs=recvs)) for h, sends, recvs in pend]
    for p in started:
        p.result()
    seconds = time.monotonic() - t0
    release(args, handles)
    return seconds


def release(args, handles) -> None:
    """Free the reference buffers (after the clock stopped)."""
    for h in handles:
        h.send(Probe(args.timeout, release=True)).result()


def ref_sizes(n: int, chunk: int) -> list[int]:
    size = min(n, chunk)
    return [size, max(1, round(n / size))]


def links_summary(plan, timed, moved: int) -> dict:
    """--links: the one-sided refit over a memcpy of the bytes each slot sent (same
    processes, same run), beside the collective refit of the same model and its ratio to
    the raw link (`ratio`, `ref_gbps` are the collective's here)."""
    runs, mem, coll, refs = timed.runs, timed.sent_memcpys, timed.collective, timed.refs
    seconds, cseconds = statistics.median(runs), statistics.median(coll)
    return {
        "links": plan.config.links.mode,
        "paths": plan.link_summary(),
        "memcpy_gbps": round(moved / statistics.median(mem) / 1e9, 3),
        # each refit against the memcpy right after it, median over the pairs
        "memcpy_ratio": round(statistics.median(m / x for x, m in zip(runs, mem, strict=True)), 3),
        "memcpy_seconds_all": [round(x, 4) for x in mem],
        "collective_gbps": round(moved / cseconds / 1e9, 3),
        "collective_seconds_all": [round(x, 4) for x in coll],
        "ratio": round(statistics.median(r / x for x, r in zip(coll, refs, strict=True)), 3),
        "over_collective": round(cseconds / seconds, 3),
    }
