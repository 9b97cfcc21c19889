"""Emulated hosts on one machine: Linux network namespaces on a private bridge.

Each host is a network namespace with one interface `eth0` on a private /24 (10.213.K.0/24,
K drawn per run), plugged into a bridge that lives in its own "switch" namespace: nothing is
added to the machine's own namespace, so no address of the private subnet is reachable from
it and no packet leaves the machine. Each host gets its own /etc/hosts and an empty
resolv.conf through /etc/netns/<ns>/, and its processes run under their own host name (a UTS
namespace). Names carry a per-run id behind a fixed prefix, so concurrent runs never collide
and namespaces of killed runs are recognised and removed (`clean_stale`). Links can be taken
down (partitions) and shaped (`tc tbf` on both ends of each host's veth).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import shutil
import signal
import subprocess
import threading
import time
from bisect import bisect_left
from dataclasses import dataclass, field
from pathlib import Path

import psutil

PREFIX = "rfm"  # every namespace and veth of these networks starts with it
OWNERS = Path("/run/refitd-netns")  # run id -> pid of the process that made it
ETC_NETNS = Path("/etc/netns")
CLONE_NEWNET = 0x40000000  # setns(2): join a network namespace


def unavailable() -> str | None:
    """Why network namespaces cannot be used here (None: they can)."""
    if os.geteuid() != 0:
        return "multi-host tests need root (network namespaces, veth, bridge)"
    if shutil.which("ip") is None:
        return "multi-host tests need iproute2's `ip`"
    if shutil.which("unshare") is None:
        return "multi-host tests need util-linux's `unshare` (a host name per emulated host)"
    return None


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=30)


def clean_stale() -> list[str]:
    """Remove namespaces (and their /etc/netns entries) of runs whose process is gone."""
    out = _ip("netns", "list", check=False).stdout.split()
    removed = []
    for name in out:
        if not name.startswith(PREFIX) or len(name) < len(PREFIX) + 6:
            continue
        run = name[len(PREFIX) : len(PREFIX) + 6]
        owner = OWNERS / run
        try:
            pid = int(owner.read_text())
        except (OSError, ValueError):
            pid = 0
        if pid and psutil.pid_exists(pid):
            continue
        _delete_ns(name)
        removed.append(name)
        owner.unlink(missing_ok=True)
    return removed


def _delete_ns(ns: str) -> None:
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for p in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(p), signal.SIGKILL)
    _ip("netns", "del", ns, check=False)
    shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)


@dataclass
class Host:
    """One emulated host: its namespace, host name, address and switch port."""

    name: str  # host name its processes see (and give refitd)
    ns: str
    address: str
    port: str  # its veth end in the switch namespace
    resolves_to: str | None  # what /etc/hosts maps its own name to (None: not at all)


@dataclass
class Network:
    """A bridge and N hosts; `create()` builds it, `destroy()` removes every trace."""

    names: list[str]
    resolves: dict[str, str | None] = field(default_factory=dict)  # name -> hosts entry
    run: str = field(
        default_factory=lambda: f"{os.getpid() % 4096:03x}{random.randrange(4096):03x}"
    )
    hosts: dict[str, Host] = field(default_factory=dict)
    subnet: int = field(default_factory=lambda: random.randrange(1, 255))

    @property
    def switch(self) -> str:
        return f"{PREFIX}{self.run}sw"

    def create(self) -> Network:
        clean_stale()
        OWNERS.mkdir(parents=True, exist_ok=True)
        (OWNERS / self.run).write_text(str(os.getpid()))
        try:
            self._build()
        except BaseException:
            self.destroy()
            raise
        return self

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
        _ip("link", "set", "br0", "up", ns=self.switch)
        for i, name in enumerate(self.names):
            ns = f"{PREFIX}{self.run}h{i}"
            addr = f"10.213.{self.subnet}.{i + 2}"
            port, peer = f"{PREFIX}{self.run}s{i}", f"{PREFIX}{self.run}e{i}"
            host = Host(name, ns, addr, port, self.resolves.get(name, addr))
            self.hosts[name] = host
            _ip("netns", "add", ns)
            _ip("link", "add", port, "type", "veth", "peer", "name", peer)
            _ip("link", "set", port, "netns", self.switch)
            _ip("link", "set", peer, "netns", ns)
            _ip("link", "set", port, "master", "br0", ns=self.switch)
            _ip("link", "set", port, "up", ns=self.switch)
            _ip("link", "set", peer, "name", "eth0", ns=ns)
            _ip("addr", "add", f"{addr}/24", "dev", "eth0", ns=ns)
            _ip("link", "set", "eth0", "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
        for host in self.hosts.values():
            self._etc(host)

    def _etc(self, host: Host) -> None:
        """/etc/hosts of a host: localhost, the other hosts, and its own name as asked
        (127.0.1.1 like Debian, or absent: unresolvable); resolv.conf names no server."""
        d = ETC_NETNS / host.ns
        d.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost"]
        if host.resolves_to is not None:
            lines.append(f"{host.resolves_to} {host.name}")
        lines += [f"{h.address} {h.name}" for h in self.hosts.values() if h is not host]
        (d / "hosts").write_text("\n".join(lines) + "\n")
        (d / "resolv.conf").write_text("# no name server: names resolve from hosts only\n")

    # ---------------------------------------------------------------- processes
    def command(self, host: str, argv: list[str]) -> list[str]:
        """argv run on `host`: in its namespace, under its own host name."""
        h = self.hosts[host]
        script = 'hostname "$0" && exec "$@"'
        return ["ip", "netns", "exec", h.ns, "unshare", "--uts", "sh", "-c", script, h.name, *argv]

    def pids(self, host: str) -> list[int]:
        out = _ip("netns", "pids", self.hosts[host].ns, check=False).stdout.split()
        return [int(p) for p in out]

    def kill_host(self, host: str) -> int:
        """Power cut: SIGKILL every process of the host; returns how many."""
        n = 0
        for pid in self.pids(host):
            try:
                os.kill(pid, signal.SIGKILL)
                n += 1
            except ProcessLookupError:
                pass
        return n

    # ---------------------------------------------------------------- links
    def set_link(self, host: str, up: bool) -> None:
        """Take a host's switch port down (a partition) or up again."""
        _ip("link", "set", self.hosts[host].port, "up" if up else "down", ns=self.switch)

    def shape(self, rate_bit: int, burst_bytes: int = 256 << 10, latency_ms: int = 50) -> None:
        """tc tbf on both ends of every host's link: rate_bit per direction."""
        for h in self.hosts.values():
            for ns, dev in ((self.switch, h.port), (h.ns, "eth0")):
                subprocess.run(
                    ["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
                     "rate", f"{rate_bit}bit", "burst", str(burst_bytes),
                     "latency", f"{latency_ms}ms"],
                    check=True, capture_output=True, timeout=30,
                )  # fmt: skip

    def link_bytes(self) -> dict[str, tuple[int, int]]:
        """host -> (bytes it sent, bytes it received) on its link, from the switch side."""
        out = _ip("-j", "-s", "link", "show", ns=self.switch).stdout
        by_port = {d["ifname"]: d["stats64"] for d in json.loads(out)}
        res = {}
        for name, h in self.hosts.items():
            st = by_port[h.port]
            res[name] = (int(st["rx"]["bytes"]), int(st["tx"]["bytes"]))  # switch rx = host tx
        return res

    # ---------------------------------------------------------------- teardown
    def destroy(self) -> None:
        for h in self.hosts.values():
            _delete_ns(h.ns)
        for i in range(len(self.names)):  # a host namespace not yet recorded in self.hosts
            _delete_ns(f"{PREFIX}{self.run}h{i}")
        _delete_ns(self.switch)
        for i in range(len(self.names)):  # veths left in the machine's namespace by a failure
            _ip("link", "del", f"{PREFIX}{self.run}s{i}", check=False)
        (OWNERS / self.run).unlink(missing_ok=True)

    def __enter__(self) -> Network:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.destroy()


def _join_netns(path: str) -> None:
    """Move the calling thread into the network namespace at `path` (setns(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns {path}: {os.strerror(err)}")
    finally:
        os.close(fd)


class LinkSampler:
    """A host's bytes sent on its link (the switch side's received bytes), sampled every
    `every_s` by a thread that joins the switch namespace (setns acts on the calling thread
    only) and reads its /proc/thread-self/net/dev: cheap enough to sample every few
    milliseconds. `between(t0, t1)`: the bytes sent in a monotonic interval, interpolated."""

    def __init__(self, net: Network, host: str, every_s: float = 0.002) -> None:
        self.ns_path = f"/run/netns/{net.switch}"
        self.port = net.hosts[host].port
        self.every_s = every_s
        self.times: list[float] = []
        self.counts: list[int] = []
        self.error: OSError | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="link-sampler", daemon=True)

    def __enter__(self) -> LinkSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        try:
            _join_netns(self.ns_path)
        except OSError as e:
            self.error = e
            return
        while not self._stop.is_set():
            t, n = time.monotonic(), self._read()
            self.counts.append(n)  # counts first: a reader sees len(times) <= len(counts)
            self.times.append(t)
            self._stop.wait(self.every_s)

    def _read(self) -> int:
        with open("/proc/thread-self/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == self.port:
                    return int(rest.split()[0])
        raise RuntimeError(f"no counters for {self.port} in {self.ns_path}")

    def at(self, t: float) -> float:
        """The counter at monotonic time t, linear between the samples around it."""
        if self.error is not None:
            raise RuntimeError(f"link sampler: {self.error}")
        times = self.times[:]
        i = bisect_left(times, t)
        if i == 0 or i == len(times):
            raise RuntimeError(f"link sampled over {times[:1]}..{times[-1:]}, not at {t}")
        t0, t1, c0, c1 = times[i - 1], times[i], self.counts[i - 1], self.counts[i]
        return c0 + (c1 - c0) * (t - t0) / max(t1 - t0, 1e-9)

    def between(self, t0: float, t1: float) -> float:
        return self.at(t1) - self.at(t0)
