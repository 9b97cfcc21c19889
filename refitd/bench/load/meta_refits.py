"""Refits of the metadata model, as the peers of `refitd bench load --faults` take part in
them: inference ranks that read their version events and ack them, trainer ranks that call
Refit when the bench says so, and what each rank was told (for the torn and untold counts).
The light agents' side (executes answered after a hold) is in meta.py.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any

RankKey = tuple[str, int]  # (pool, rank)


@dataclass
class Told:
    """Every version event each inference rank of this peer received: (kind name, version)
    in order. Thread-safe appends."""

    events: dict[RankKey, list[tuple[str, int]]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, key: RankKey, kind: str, version: int) -> None:
        with self.lock:
            self.events.setdefault(key, []).append((kind, version))

    def snapshot(self) -> dict[RankKey, list[tuple[str, int]]]:
        with self.lock:
            return {k: list(v) for k, v in self.events.items()}


def subscriber(refit: Any, worker_id: str, key: RankKey, stream: Any, told: Told) -> None:
    """Read an inference rank's version events and ack each (a rank with no engine to
    pause); records them in `told`. Ends when the stream does."""
    import grpc

    from refitd._proto import refitd_pb2 as pb

    names = {v.number: v.name for v in pb.EventKind.DESCRIPTOR.values}
    with contextlib.suppress(grpc.RpcError):
        for ev in stream:
            if ev.kind == pb.EVENT_KIND_HELLO:
                continue
            told.add(key, names.get(ev.kind, str(ev.kind)), ev.version)
            refit.Ack(pb.AckRequest(worker_id=worker_id, event_id=ev.event_id, ok=True), timeout=30)


def refit_all(refit: Any, trainer_ids: list[str], version: int, timeout_s: float) -> dict:
    """Every trainer rank of this peer asks for `version` at once (the default wait: until
    its sources were read). Returns the calls, their states (or gRPC errors), the first
    message, and the slowest call's seconds."""
    import grpc

    from refitd._proto import refitd_pb2 as pb
    from refitd.refit_states import state_name

    t0 = time.monotonic()
    futures = [
        refit.Refit.future(pb.RefitRequest(worker_id=w, version=version), timeout=timeout_s)
        for w in list(trainer_ids)
    ]
    states: collections.Counter[str] = collections.Counter()
    messages: list[str] = []
    for f in futures:
        try:
            r = f.result()
            states[state_name(r.state)] += 1
            if r.message:
                messages.append(r.message)
        except grpc.RpcError as e:
            states[f"rpc_{e.code().name.lower()}"] += 1
            messages.append(str(e.details()))
    return {
        "calls": len(futures),
        "states": dict(states),
        "message": messages[0] if messages else "",
        "seconds": time.monotonic() - t0,
    }


def rtt_figures(
    rtts: list[tuple[float, float]], since: float = 0.0, until: float = float("inf")
) -> dict[str, float]:
    """Count, p99 and max of the round trips of the heartbeats sent in [since, until]
    (monotonic; the clock is the host's, shared by the bench's processes)."""
    got = sorted(r for t, r in list(rtts) if since <= t <= until)
    if not got:
        return {"count": 0, "p99_s": 0.0, "max_s": 0.0}
    return {"count": len(got), "p99_s": got[int(0.99 * (len(got) - 1))], "max_s": got[-1]}


def serve_commands(
    commands: Any,
    out: Any,
    role: Any,
    stop: threading.Event,
    refit: Any,
    trainer_ids: list[str],
    told: Told,
    rtts: list[tuple[float, float]],
) -> None:
    """The bench's commands to this peer (of PeerRole `role`), until it closes the pipe or
    sends None: ("refit", version, timeout_s) -> ("refit", name, version, result) on `out`
    once this peer's calls returned; ("told",) -> ("told", name, what each rank was told);
    ("rtts", since, until) -> ("rtts", name, figures of the heartbeats sent meanwhile)."""
    name = role.name

    def run(version: int, timeout_s: float) -> None:
        out.put(("refit", name, version, refit_all(refit, trainer_ids, version, timeout_s)))

    with contextlib.suppress(EOFError, OSError):
        while (msg := commands.recv()) is not None:
            if msg[0] == "refit":
                threading.Thread(target=run, args=msg[1:], daemon=True).start()
            elif msg[0] == "told":
                out.put(("told", name, told.snapshot()))
            elif msg[0] == "rtts":
                out.put(("rtts", name, rtt_figures(rtts, *msg[1:])))
    stop.set()
