"""A refitd cluster over emulated hosts (refitd.bench.cluster.netns): the controller on one
host, a node agent and worker processes on others, every process in its host's namespace.

Used by the multi-host tests (tests/multihost) and `refitd bench cluster`. Workers are
refitd.bench.cluster.host_workers processes (one per host, holding that host's ranks); a
rank-less one on the controller's host is the probe that reads the status document. Every
wait is on a line or a status condition, with a timeout.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from refitd.bench.cluster.host_workers import RankSpec
from refitd.bench.cluster.netns import Network
from refitd.bench.faults.suite import Child

GRPC_PORT = 50151
HTTP_PORT = 50152


class ClusterError(RuntimeError):
    """A process of the cluster failed, or a condition was not met in time."""


@dataclass
class AgentSpec:
    devices: str  # "cpu:0,cpu:1"
    args: list[str] = field(default_factory=list)  # e.g. ["--data-plane-interface", "eth0"]


@dataclass
class ClusterRefitReport:
    """One version as the trainer ranks and the inference ranks reported it."""

    version: int
    states: dict[tuple[str, int], str]  # trainer (pool, rank) -> state
    messages: dict[tuple[str, int], str]
    seconds: float  # the slowest trainer rank's Refit call
    commits: dict[tuple[str, int], str]  # inference (pool, rank) -> "ok" / "mismatch ..."

    @property
    def state(self) -> str:
        states = set(self.states.values())
        return states.pop() if len(states) == 1 else "mixed: " + str(self.states)


class MultiHostCluster:
    """The processes of one cluster on `net`; start() brings them up, close() ends them."""

    def __init__(
        self,
        net: Network,
        controller_host: str,
        agents: dict[str, AgentSpec],
        workers: dict[str, list[RankSpec]],
        mb: float,
        serve_args: list[str],
        model: str = "mh",
        python: str = sys.executable,
        worker_args: list[str] | None = None,
    ) -> None:
        self.net = net
        self.controller_host = controller_host
        self.agent_specs = agents
        self.worker_specs = workers
        self.mb = mb
        self.serve_args = serve_args
        self.model = model
        self.python = python
        self.worker_args = list(worker_args or [])
        self.tmp = tempfile.TemporaryDirectory(prefix="refitd-mh-")
        self.dir = Path(self.tmp.name)
        self.address = f"{net.hosts[controller_host].address}:{GRPC_PORT}"
        self.children: dict[str, Child] = {}
        self.mismatches: list[str] = []
        self.lines: list[tuple[float, str, str]] = []
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- processes
    def _on_line(self, name: str, line: str) -> None:
        with self._lock:
            self.lines.append((time.monotonic(), name, line))
            if "mismatch" in line:
                self.mismatches.append(f"{name}: {line}")

    def spawn(self, name: str, host: str, argv: list[str]) -> Child:
        child = Child(name, self.net.command(host, argv), self.dir / f"{name}.log", self._on_line)
        self.children[name] = child
        return child

    def lines_of(self, name: str) -> list[str]:
        """The lines child `name` printed so far."""
        with self._lock:
            return [line for _, who, line in self.lines if who == name]

    def log_tail(self, name: str, n: int = 3000) -> str:
        try:
            return (self.dir / f"{name}.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def controller_argv(self) -> list[str]:
        addr = self.net.hosts[self.controller_host].address
        return [
            self.python, "-m", "refitd.cli.main", "serve", "--no-embedded-agent",
            "--host", addr, "--grpc-port", str(GRPC_PORT), "--http-port", str(HTTP_PORT),
            "--data-dir", str(self.dir / "state"), *self.serve_args,
        ]  # fmt: skip

    def agent_argv(self, host: str, extra: list[str] | None = None) -> list[str]:
        spec = self.agent_specs[host]
        return [
            self.python, "-m", "refitd.cli.main", "agent", "--controller", self.address,
            "--devices", spec.devices, "--log-level", "warning", *spec.args, *(extra or []),
        ]  # fmt: skip

    def worker_argv(self, host: str, model: str | None = None) -> list[str]:
        ranks = [f"{r.pool}:{r.rank}:{r.size}:{r.device}" for r in self.worker_specs[host]]
        return [
            self.python, "-m", "refitd.bench.cluster.host_workers", self.address,
            model or self.model,
            "--mb", str(self.mb), *[a for r in ranks for a in ("--rank", r)], *self.worker_args,
        ]  # fmt: skip

    def start(self, timeout_s: float = 90.0) -> MultiHostCluster:
        deadline = time.monotonic() + timeout_s
        self.spawn("controller", self.controller_host, self.controller_argv())
        self.probe = self.spawn("probe", self.controller_host, self.worker_argv_probe())
        self._expect(self.probe, "ready", deadline)
        self.wait_for("controller up", lambda: "error" not in self.status(), deadline)
        for host in self.agent_specs:
            self.spawn(f"agent-{host}", host, self.agent_argv(host))
        for host in self.worker_specs:  # they register once their agent's slots are there
            self.spawn(f"workers-{host}", host, self.worker_argv(host))
        self.wait_for("agents connected", self.agents_connected, deadline)
        for host in self.worker_specs:
            self._expect(self.children[f"workers-{host}"], "ready", deadline)
        self.wait_for("ranks live and subscribed", self.ranks_ready, deadline)
        return self

    def worker_argv_probe(self) -> list[str]:
        return [self.python, "-m", "refitd.bench.cluster.host_workers", self.address, self.model]

    def _expect(self, child: Child, prefix: str, deadline: float) -> str:
        line = child.expect(prefix, max(0.0, deadline - time.monotonic()))
        if line is None:
            raise ClusterError(f"{child.name}: no '{prefix}' line:\n{self.log_tail(child.name)}")
        return line

    def close(self, timeout_s: float = 5.0) -> None:
        """Workers first (told to stop: they unregister and free their shared memory),
        then agents and the probe, then the controller; each group at once, killed after
        timeout_s."""
        kids = list(self.children.values())
        groups = [
            [c for c in kids if c.name.startswith("workers-")],
            [c for c in kids if c.name.startswith("agent-") or c.name == "probe"],
            [c for c in kids if c.name == "controller"],
        ]
        for i, group in enumerate(groups):
            live = [c for c in group if c.proc is not None and c.proc.poll() is None]
            for c in live:
                if i == 0:
                    c.send("stop")
                else:
                    c.proc.terminate()  # type: ignore[union-attr]
            # Agents are given 3 s: the namespaces' teardown kills what is left of them
            # (they hold no shared memory; their transfer processes map the workers').
            deadline = time.monotonic() + (3.0 if i == 1 else timeout_s)
            for c in live:
                try:
                    c.proc.wait(max(0.1, deadline - time.monotonic()))  # type: ignore[union-attr]
                except subprocess.TimeoutExpired:
                    c.kill()
        self.tmp.cleanup()

    # ---------------------------------------------------------------- status
    def status(self, timeout_s: float = 10.0) -> dict:
        self.probe.send("status")
        line = self.probe.expect("status ", timeout_s)
        if line is None:
            return {"error": f"probe gave no status in {timeout_s:g}s"}
        return json.loads(line[len("status ") :])

    def wait_for(self, what: str, pred: Callable[[], bool], deadline: float) -> None:
        while not pred():
            if time.monotonic() > deadline:
                raise ClusterError(f"{what}: not within the deadline")
            time.sleep(0.1)

    def agents_connected(self) -> bool:
        doc = self.status()
        hosts = {a["host"] for a in doc.get("agents", []) if a["connected"]}
        return set(self.agent_specs) <= hosts

    def ranks_ready(self) -> bool:
        doc = self.status()
        m = next((m for m in doc.get("models", []) if m["name"] == self.model), None)
        if m is None:
            return False
        want = sum(len(v) for v in self.worker_specs.values())
        ranks = [(p["role"], r) for p in m["pools"] for r in p["ranks"]]
        return len(ranks) == want and all(
            r["live"] and (role == "source" or r["subscribed"]) for role, r in ranks
        )

    # ---------------------------------------------------------------- refits
    def trainer_ranks(self) -> list[tuple[str, RankSpec]]:
        return [(h, r) for h, rs in self.worker_specs.items() for r in rs if r.pool == "trainer"]

    def inference_ranks(self) -> list[tuple[str, RankSpec]]:
        return [(h, r) for h, rs in self.worker_specs.items() for r in rs if r.pool != "trainer"]

    def step(self, version: int, timeout_s: float) -> None:
        """Every trainer rank fills `version` and refits it (wait committed)."""
        for host in {h for h, _ in self.trainer_ranks()}:
            self.children[f"workers-{host}"].send(f"step {version} {timeout_s}")

    def outcome(self, version: int, timeout_s: float) -> ClusterRefitReport:
        """Wait for every trainer rank's answer for `version` (and, when committed, every
        inference rank's bit-for-bit check of it)."""
        deadline = time.monotonic() + timeout_s
        trainers = {(r.pool, r.rank) for _, r in self.trainer_ranks()}
        infers = {(r.pool, r.rank) for _, r in self.inference_ranks()}
        while True:
            states, msgs, secs, commits = self._seen(version)
            committed = set(states.values()) == {"committed"}
            if set(states) >= trainers and (not committed or set(commits) >= infers):
                return ClusterRefitReport(version, states, msgs, max(secs.values()), commits)
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"version {version}: trainer answers {states}, inference checks {commits} "
                    f"after {timeout_s:g}s"
                )
            time.sleep(0.05)

    def _seen(self, version: int) -> tuple[dict, dict, dict, dict]:
        states, msgs, secs, commits = {}, {}, {}, {}
        with self._lock:
            lines = list(self.lines)
        for _, _, line in lines:
            w = line.split(" ", 6)
            if w[0] == "refit" and len(w) >= 6 and int(w[3]) == version:
                key = (w[1], int(w[2]))
                states[key], secs[key] = w[4], float(w[5])
                msgs[key] = w[6] if len(w) > 6 else ""
            elif w[0] == "commit" and len(w) >= 5 and int(w[3]) == version:
                commits[(w[1], int(w[2]))] = w[4]
        return states, msgs, secs, commits

    def refit(self, version: int, timeout_s: float = 30.0) -> ClusterRefitReport:
        self.step(version, timeout_s)
        return self.outcome(version, timeout_s + 15.0)

    def restart(self, name: str, host: str, argv: list[str], ready: str | None) -> Child:
        old = self.children.get(name)
        if old is not None:
            old.kill()
        child = self.spawn(name, host, argv)
        if ready:
            self._expect(child, ready, time.monotonic() + 60)
        return child
