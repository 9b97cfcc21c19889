"""The bench's side of the metadata peers: spawned processes (meta.py), one per role,
driven over a pipe each and heard on one queue; killed and started again by role."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
from dataclasses import dataclass, field
from typing import Any

from refitd.bench.load.meta import PeerRole, meta_peers


@dataclass
class Registered:
    """One role's registration report."""

    seconds: float
    workers: int
    specs: int
    agents: int
    rtt: dict[str, float]
    wall_s: float


@dataclass
class Peers:
    """The peer processes of one bench run. Messages other than the ones awaited are kept:
    refused heartbeats in `lost`, the rest in `inbox`."""

    address: str
    args: dict[str, Any]
    ctx: Any = field(default_factory=lambda: mp.get_context("spawn"))
    out: Any = None
    procs: dict[str, Any] = field(default_factory=dict)
    pipes: dict[str, Any] = field(default_factory=dict)
    roles: dict[str, PeerRole] = field(default_factory=dict)
    lost: list[tuple] = field(default_factory=list)
    inbox: list[tuple] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.out = self.ctx.Queue()

    def start(self, role: PeerRole) -> None:
        """Spawn the process of `role` (again, after a kill)."""
        theirs, ours = self.ctx.Pipe(duplex=False)
        p = self.ctx.Process(
            target=meta_peers, args=(self.address, self.args, role, self.out, theirs), daemon=True
        )
        p.start()
        theirs.close()
        self.procs[role.name], self.pipes[role.name], self.roles[role.name] = p, ours, role

    def start_all(self, roles: list[PeerRole], timeout_s: float = 600.0) -> None:
        """Start `roles`: those holding light agents first, the rest once their agents are
        registered (a worker's slot must be served by an agent when it registers)."""
        hosts = [r for r in roles if r.agents is None or r.agents]
        for role in hosts:
            self.start(role)
        deadline = time.monotonic() + timeout_s
        for role in hosts:
            msg = self.next(deadline, lambda m, n=role.name: m[:2] in (("agents", n), ("error", n)))
            if msg[0] == "error":
                raise RuntimeError(f"metadata peer {msg[1]} failed: {msg[2]}")
        for role in roles:
            if role not in hosts:
                self.start(role)

    def registered(self, names: list[str], timeout_s: float = 1800.0) -> dict[str, Registered]:
        """Wait for the registration report of each role in `names`."""
        t0 = time.monotonic()
        got: dict[str, Registered] = {}
        while len(got) < len(names):
            msg = self.next(t0 + timeout_s, lambda m: m[0] in ("registered", "error"))
            if msg[0] == "error":
                raise RuntimeError(f"metadata peer {msg[1]} failed: {msg[2]}")
            got[msg[1]] = Registered(*msg[2:], wall_s=time.monotonic() - t0)
        return got

    def next(self, deadline: float, want: Any) -> tuple:
        """The next message `want(msg)` accepts, within `deadline` (monotonic); refused
        heartbeats go to `lost`, others to `inbox`."""
        for i, msg in enumerate(self.inbox):
            if want(msg):
                return self.inbox.pop(i)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no awaited message from the metadata peers")
            msg = self.out.get(timeout=left)
            if msg[0] == "lost":
                self.lost.append(msg)
            elif want(msg):
                return msg
            else:
                self.inbox.append(msg)

    def send(self, name: str, msg: tuple | None) -> None:
        with contextlib.suppress(OSError):
            self.pipes[name].send(msg)

    def rtts(self, since: float, until: float, timeout_s: float = 60.0) -> dict[str, float]:
        """Round trips of the heartbeats the live roles sent in [since, until] (monotonic):
        the longest max and p99 over roles, the total count."""
        live = [n for n, p in self.procs.items() if p.is_alive()]
        for name in live:
            self.send(name, ("rtts", since, until))
        deadline = time.monotonic() + timeout_s
        got = [self.next(deadline, lambda m, n=n: m[:2] == ("rtts", n))[2] for n in live]
        return _combined(got)

    def kill(self, name: str) -> None:
        """kill -9 the role's process and reap it."""
        p = self.procs[name]
        p.kill()
        p.join(30)
        self.pipes[name].close()

    def stop(self, timeout_s: float = 60.0) -> dict[str, float]:
        """Tell every live role to stop; the round-trip figures of their heartbeats (the
        longest max and p99 over roles, the total count)."""
        live = [n for n, p in self.procs.items() if p.is_alive()]
        for name in live:
            self.send(name, None)
        deadline = time.monotonic() + timeout_s
        got = []
        for _ in live:
            with contextlib.suppress(TimeoutError):
                got.append(self.next(deadline, lambda m: m[0] == "heartbeats")[2])
        return _combined(got)

    def close(self) -> None:
        for name, p in self.procs.items():
            self.send(name, None)
            p.join(10)
            if p.is_alive():
                p.kill()


def _combined(figures: list[dict[str, float]]) -> dict[str, float]:
    """Round-trip figures of several roles: the longest max and p99, the total count."""
    return {
        "count": sum(f["count"] for f in figures),
        "p99_s": max((f["p99_s"] for f in figures), default=0.0),
        "max_s": max((f["max_s"] for f in figures), default=0.0),
    }
