"""kill -9 fault suite: a controller, a node agent, 2 trainer and 2 inference rank processes.

One Cluster is reused across runs; each run kills one member (trainer rank, inference rank,
transfer process, node agent or controller) at one phase of a refit (before it, during the
transfer, during the commit), waits for every surviving trainer call to end (a call past its
timeout plus a margin is a hang), restarts the member and times the next committed refit.
Inference ranks check every version they serve bit for bit (a mismatch is a torn version);
a rank paused by a refit must be told how it ended (commit, abort or incomplete) before it
is paused again (an untold pause: a rank left paused without an answer); a controller
restart must keep the committed version, its version log and the pools; a trainer rank
killed before it asks must fail the refit at its lease, not at the barrier timeout (late).

With `delta`, the controller runs with --delta-refits and the trainers publish sparse
successive versions (DELTA_DENSITY of the elements change per version), so the refits a
kill lands in send deltas (`delta_refits` counts the committed refits that did).
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil

from refitd._proto import refitd_pb2 as pb
from refitd._proto import refitd_pb2_grpc as pbg
from refitd.demo.run import free_port
from refitd.memory.segment_names import reap_orphaned_segments
from refitd.node.process_handle import PROCESS_NAME_PREFIX

ROLES = ("trainer", "inference", "transfer", "agent", "controller")
PHASES = ("before", "transfer", "commit")
MODEL = "faults"
HANG_MARGIN_S = 5.0
DELTA_DENSITY = 0.04
RECOVERY_DEADLINE_S = 40.0
SERVE_TIMEOUTS = [
    "--heartbeat-interval-s", "0.3",
    "--heartbeat-timeout-s", "2",
    "--barrier-timeout-s", "4",
    "--pause-timeout-s", "4",
    "--transfer-timeout-s", "6",
    "--commit-timeout-s", "4",
    "--connect-timeout-s", "8",
    "--load-timeout-s", "8",
    "--refit-retries", "1",
    "--refit-retry-budget-s", "6",
    "--log-level", "warning",
]  # fmt: skip


class Child:
    """A child process whose stdout lines are queued (and seen by `on_line`)."""

    def __init__(
        self, name: str, cmd: list[str], log: Path, on_line: Callable[[str, str], None]
    ) -> None:
        self.name = name
        self.cmd = cmd
        self.log = log
        self.on_line = on_line
        self.lines: queue.Queue[str] = queue.Queue()
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.lines = queue.Queue()
        err = open(self.log, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True
        )
        err.close()
        threading.Thread(target=self._read, args=(self.proc, self.lines), daemon=True).start()

    def _read(self, proc: subprocess.Popen, lines: queue.Queue[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.strip()
            self.on_line(self.name, line)
            lines.put(line)

    def send(self, line: str) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass

    def expect(self, prefix: str, timeout_s: float) -> str | None:
        """The next line starting with `prefix`, or None after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                return None
            if line.startswith(prefix):
                return line
        return None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.send("stop")
        try:
            self.proc.terminate()
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()


@dataclass
class RunResult:
    """One run of one case."""

    role: str
    phase: str
    hit: bool = False  # the kill landed in the phase asked for
    delta: bool | None = None  # delta suite: the killed refit was planned with deltas
    hangs: int = 0
    torn: int = 0
    lost: int = 0
    untold: int = 0  # pauses never answered with commit, abort or incomplete
    late: int = 0  # calls failed by the barrier timeout: a dead trainer rank not noticed
    recovery_s: float | None = None  # restart -> next committed refit on every rank
    back_s: float | None = None  # restart -> the member registered (connected) again
    notes: list[str] = field(default_factory=list)


class Cluster:
    """The processes of the suite on free loopback ports, state in a temp dir."""

    def __init__(
        self, mb: float = 8.0, refit_timeout_s: float = 20.0, delta: bool = False,
        links: str = "auto",
    ) -> None:  # fmt: skip
        self.mb = mb
        self.delta = delta
        self.links = links
        self.refit_timeout_s = refit_timeout_s
        self.tmp = tempfile.TemporaryDirectory(prefix="refitd-faults-")
        self.dir = Path(self.tmp.name)
        self.grpc_port = free_port()
        self.http_port = free_port()
        self.address = f"127.0.0.1:{self.grpc_port}"
        self.version = 0
        self.mismatches: list[str] = []
        self.untold: list[str] = []
        self.open_pause: dict[str, int] = {}  # inference child -> version it is paused in
        self._lock = threading.Lock()
        self.controller: Child | None = None
        self.agent: Child | None = None
        self.trainers: list[Child] = []
        self.inference: list[Child] = []
        self._channel = grpc.insecure_channel(self.address)
        self._stub = pbg.RefitStub(self._channel)

    def _on_line(self, name: str, line: str) -> None:
        word, _, rest = line.partition(" ")
        with self._lock:
            if "mismatch" in line:
                self.mismatches.append(f"{name}: {line}")
            if word == "paused":
                old = self.open_pause.get(name)
                if old is not None:
                    self.untold.append(
                        f"{name}: paused for {rest.split()[0]} while still "
                        f"paused for {old} (never told how it ended)"
                    )
                self.open_pause[name] = int(rest.split()[0])
            elif word in ("commit", "abort", "incomplete", "ready"):
                self.open_pause.pop(name, None)

    def _child(self, name: str, cmd: list[str]) -> Child:
        return Child(name, cmd, self.dir / f"{name}.log", self._on_line)

    def controller_cmd(self) -> list[str]:
        return [
            sys.executable, "-m", "refitd.cli.main", "serve", "--no-embedded-agent",
            "--grpc-port", str(self.grpc_port), "--http-port", str(self.http_port),
            "--data-dir", str(self.dir / "state"), *SERVE_TIMEOUTS, "--links", self.links,
            # kills must land in delta refits: no dense-by-speed choice on loopback
            *(["--delta-refits", "--no-delta-speed-rule"] if self.delta else []),
        ]  # fmt: skip

    def agent_cmd(self) -> list[str]:
        return [
            sys.executable, "-m", "refitd.cli.main", "agent", "--controller", self.address,
            "--devices", "cpu:0,cpu:1", "--log-level", "warning",
        ]  # fmt: skip

    def worker_cmd(self, role: str, rank: int) -> list[str]:
        # Inference rank r sits on the other slot than trainer rank r: bytes cross slots.
        device = f"cpu:{rank}" if role == "trainer" else f"cpu:{1 - rank}"
        return [
            sys.executable, "-m", "refitd.bench.faults.worker", role, self.address, MODEL,
            str(rank), device, str(self.mb), "--refit-timeout", str(self.refit_timeout_s),
            *(["--density", str(DELTA_DENSITY)] if self.delta else []),
        ]  # fmt: skip

    # ------------------------------------------------------------------ control
    def status(self, timeout_s: float = 2.0) -> dict | None:
        try:
            return json.loads(self._stub.GetStatus(pb.StatusRequest(), timeout=timeout_s).json)
        except grpc.RpcError:
            return None

    def model_status(self) -> dict | None:
        doc = self.status()
        if doc is None:
            return None
        return next((m for m in doc["models"] if m["name"] == MODEL), None)

    def wait_for(self, what: str, pred: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not pred():
            if time.monotonic() > deadline:
                raise RuntimeError(f"fault suite: {what} not within {timeout_s:g} s")
            time.sleep(0.05)

    def delta_sent(self, version: int) -> bool:
        """Whether `version` committed with messages sent as deltas: then every sender holds
        it as its base and every destination holds it, so the next refit's first attempt is
        planned with deltas (a retry's plan replaces it in the record, hence this check)."""
        doc = self.status()
        return any(
            r.get("version") == version
            and r.get("model", MODEL) == MODEL
            and r.get("state") == "committed"
            and ((r.get("delta") or {}).get("sent_as_delta") or 0) > 0
            for r in (doc or {}).get("refits", [])
        )

    def slots_connected(self) -> int:
        doc = self.status()
        return 0 if doc is None else sum(1 for s in doc["slots"] if s["connected"])

    def ranks_ready(self) -> bool:
        m = self.model_status()
        if m is None:
            return False
        ranks = {(p["role"], r["rank"]): r for p in m["pools"] for r in p["ranks"]}
        if len(ranks) != 4 or not all(r["live"] for r in ranks.values()):
            return False
        return all(r["subscribed"] for (role, _), r in ranks.items() if role == "destination")

    def start(self) -> None:
        self.controller = self._child("controller", self.controller_cmd())
        self.wait_for("controller up", lambda: self.status() is not None, 60)
        self.agent = self._child("agent", self.agent_cmd())
        self.wait_for("agent slots", lambda: self.slots_connected() == 2, 60)
        self.trainers = [self._child(f"trainer{r}", self.worker_cmd("trainer", r)) for r in (0, 1)]
        self.inference = [
            self._child(f"inference{r}", self.worker_cmd("inference", r)) for r in (0, 1)
        ]
        for c in self.trainers + self.inference:
            if c.expect("ready", 90) is None:
                raise RuntimeError(f"fault suite: {c.name} never registered")
        self.wait_for("ranks registered and subscribed", self.ranks_ready, 30)

    def close(self) -> None:
        for c in [*self.trainers, *self.inference, self.agent, self.controller]:
            if c is not None:
                c.stop()
        self._channel.close()
        self.tmp.cleanup()
        # workers killed with -9 (the suite's point) or stopped by a signal cannot unlink
        # their shared memory; no node agent is left to reap it
        reap_orphaned_segments()

    def transfer_processes(self) -> list[psutil.Process]:
        assert self.agent is not None and self.agent.proc is not None
        try:
            children = psutil.Process(self.agent.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        return [p for p in children if p.name().startswith(PROCESS_NAME_PREFIX)]

    def step(self, version: int, trainers: list[Child] | None = None) -> None:
        for t in trainers if trainers is not None else self.trainers:
            t.send(f"step {version}")

    def outcomes(self, version: int, trainers: list[Child]) -> dict[str, str | None]:
        """Each trainer's refit state for `version`, None when its call hung past its
        timeout (plus a margin)."""
        lines = self.outcome_lines(version, trainers)
        return {name: None if line is None else line.split()[2] for name, line in lines.items()}

    def outcome_lines(self, version: int, trainers: list[Child]) -> dict[str, str | None]:
        """Each trainer's "refit <v> <state> <seconds> <message>" line, None when its call
        hung past its timeout (plus a margin)."""
        deadline = time.monotonic() + self.refit_timeout_s + HANG_MARGIN_S
        return {
            t.name: t.expect(f"refit {version} ", max(0.0, deadline - time.monotonic()))
            for t in trainers
        }

    def refit(self, timeout_s: float = RECOVERY_DEADLINE_S) -> tuple[int, bool]:
        """Refit the next version until one commits on every rank (or `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.version += 1
            v = self.version
            self.step(v)
            states = self.outcomes(v, self.trainers)
            if all(s == "committed" for s in states.values()):
                seen = [c.expect(f"commit {v} ", 10) for c in self.inference]
                if all(seen):
                    return v, True
            time.sleep(0.2)
        return self.version, False


class FaultSuite:
    """Runs cases on one Cluster, rebuilding it only when a run leaves it broken."""

    def __init__(
        self, mb: float = 8.0, say: Callable[[str], None] = print, delta: bool = False,
        links: str = "auto",
    ) -> None:  # fmt: skip
        self.mb = mb
        self.delta = delta
        # deltas travel on the communicator: a mapped link writes in place (dense)
        self.links = "collective" if delta and links == "auto" else links
        self.paths: dict = {}  # messages per path of the cluster's plan (from the status)
        self.say = say
        self.cluster: Cluster | None = None
        self.healthy = False  # the last run ended with a committed refit on every rank
        self.killed_at = 0.0

    def ensure(self) -> Cluster:
        if self.cluster is not None and self.healthy:
            return self.cluster
        if self.cluster is not None:
            _, ok = self.cluster.refit(timeout_s=20)
            if ok:
                return self.cluster
            self.say("fault suite: cluster unhealthy, rebuilding it")
            self.cluster.close()
        self.cluster = Cluster(self.mb, delta=self.delta, links=self.links)
        self.cluster.start()
        _, ok = self.cluster.refit(timeout_s=60)
        if not ok:
            raise RuntimeError("fault suite: a fresh cluster does not commit a refit")
        return self.cluster

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.close()
            self.cluster = None

    def run(self, role: str, phase: str) -> RunResult:
        c = self.ensure()
        self.healthy = False
        res = RunResult(role, phase)
        before = c.model_status() or {}
        self.paths = (before.get("plan") or {}).get("links") or self.paths
        committed0 = before.get("committed_version", 0)
        torn0 = len(c.mismatches)
        untold0 = len(c.untold)
        if self.delta and not c.delta_sent(c.version):
            c.refit(timeout_s=20)  # e.g. after a fresh sender: its next refit sends deltas
        victim = self._victim(c, role)
        if self.delta:
            res.delta = c.delta_sent(c.version)
        survivors = [t for t in c.trainers if t is not victim]
        v = c.version + 1
        c.version = v
        if phase == "before":
            self._kill(c, role, victim)
            res.hit = True
            c.step(v, survivors)
        else:
            c.step(v)
            res.hit = self._kill_at(c, role, victim, phase, v)
        lines = c.outcome_lines(v, survivors)
        states = {n: None if line is None else line.split()[2] for n, line in lines.items()}
        res.hangs += sum(1 for s in states.values() if s is None)
        if res.hangs:
            res.notes.append(f"v{v} hung: {states}")
        # A trainer rank dead before it asks fails the refit when its lease expires (naming
        # it), long before the barrier timeout.
        late = [line for line in lines.values() if line and "barrier timeout" in line]
        res.late += len(late)
        res.notes.extend(f"noticed only at the barrier timeout: {line}" for line in late)
        # The agent restarts a transfer process at once: time it from the kill.
        restart = self.killed_at if role == "transfer" else time.monotonic()
        try:
            self._restart(c, role, victim)
            if role == "controller":
                res.lost += self._check_persisted(c, committed0, res)
            if role == "agent":
                c.wait_for("agent slots back", lambda: c.slots_connected() == 2, 60)
            c.wait_for("members back", c.ranks_ready, RECOVERY_DEADLINE_S)
            res.back_s = time.monotonic() - restart
        except RuntimeError as err:
            res.notes.append(str(err))
        v_next, ok = c.refit(max(1.0, RECOVERY_DEADLINE_S - (time.monotonic() - restart)))
        self.healthy = ok
        if ok:
            res.recovery_s = time.monotonic() - restart
        else:
            res.notes.append("no committed refit after the restart")
        after = c.model_status() or {}
        if after.get("committed_version", 0) < committed0 or (ok and v_next <= committed0):
            res.lost += 1
            res.notes.append(f"version went back: {committed0} -> {after.get('committed_version')}")
        res.torn = len(c.mismatches) - torn0
        if res.torn:
            res.notes.extend(c.mismatches[torn0:])
        res.untold = len(c.untold) - untold0
        if res.untold:
            res.notes.extend(c.untold[untold0:])
        return res

    def _victim(self, c: Cluster, role: str) -> Child | None:
        return {"trainer": c.trainers[1], "inference": c.inference[0], "agent": c.agent,
                "controller": c.controller}.get(role)  # fmt: skip

    def _kill(self, c: Cluster, role: str, victim: Child | None) -> None:
        self.killed_at = time.monotonic()
        if role == "transfer":
            procs = c.transfer_processes()
            if procs:
                procs[0].kill()
        elif victim is not None:
            victim.kill()

    def _kill_at(self, c: Cluster, role: str, victim: Child | None, phase: str, v: int) -> bool:
        """Kill once the refit of `v` reaches `phase`; whether it was caught in that phase."""
        deadline = time.monotonic() + c.refit_timeout_s
        watch = c.inference[1] if victim is c.inference[0] else c.inference[0]
        while time.monotonic() < deadline:
            # COMMIT events go out after the version log write: the acks are pending.
            if phase == "commit" and watch.expect(f"commit {v} ", 0.02) is not None:
                self._kill(c, role, victim)
                return True
            m = c.model_status()
            running = (m or {}).get("running") or {}
            transferring = running.get("version") == v and running.get("state") == "transferring"
            if phase == "transfer" and transferring:
                self._kill(c, role, victim)
                return True
            if m is not None and m.get("committed_version", 0) >= v and phase == "transfer":
                break
            time.sleep(0.002)
        self._kill(c, role, victim)
        return False

    def _restart(self, c: Cluster, role: str, victim: Child | None) -> None:
        if role == "transfer":
            return  # the agent restarts its transfer process itself
        assert victim is not None
        victim.start()
        if role in ("trainer", "inference") and victim.expect("ready", 60) is None:
            raise RuntimeError(f"fault suite: restarted {victim.name} never registered")
        if role == "controller":
            c.wait_for("controller up", lambda: c.status() is not None, 60)

    def _check_persisted(self, c: Cluster, committed0: int, res: RunResult) -> int:
        """Right after a controller restart: the model, its committed version, its version
        log and both pools must be there (workers come back on their own)."""
        m = c.model_status()
        lost = 0
        if m is None:
            res.notes.append("model lost after the controller restart")
            return 1
        if m["committed_version"] < committed0:
            res.notes.append(f"committed version {m['committed_version']} < {committed0}")
            lost += 1
        if committed0 and committed0 not in [x["version"] for x in m["versions"]]:
            res.notes.append(f"version {committed0} missing from the version log")
            lost += 1
        pools = {p["name"] for p in m["pools"]}
        if not {"trainer", "infer"} <= pools:
            res.notes.append(f"pools lost after the controller restart: {sorted(pools)}")
            lost += 1
        return lost
