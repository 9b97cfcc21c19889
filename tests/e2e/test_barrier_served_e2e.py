"""Dead trainer ranks in the barrier, `wait="served"`, and the order in which an inference
client publishes its state and delivers its events; real `refitd serve`, real worker
processes, real kill -9.

The daemon's barrier timeout is 60 s and its lease 2 s: a refit that fails well within the
lease (plus a margin) was failed by the lost member, not by the barrier timeout.
"""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from refitd.client import InferenceClient, Placed, TrainerClient
from refitd.demo.gpt import ParallelLayout, WeightGenerator, rank_shards
from refitd.demo.run import Daemon

from ._inference_worker import SEED, TINY
from .test_faults_e2e import wait_subscribed

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
LEASE_S = 2.0
COMMIT_TIMEOUT_S = 4.0
MARGIN_S = 6.0  # lease watcher period, gRPC, and a loaded 2-core machine
SERVE_ARGS = [
    "--heartbeat-interval-s", "0.3",
    "--heartbeat-timeout-s", str(LEASE_S),
    "--barrier-timeout-s", "60",
    "--commit-timeout-s", str(COMMIT_TIMEOUT_S),
    "--pause-timeout-s", "20",
    "--log-level", "info",
]  # fmt: skip


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    d = Daemon(cpu_slots=2, extra_args=SERVE_ARGS)
    d.start()
    try:
        yield d
    finally:
        d.stop()


class Proc:
    """A worker process driven by stdin lines; `expect` takes the first line with a prefix
    out of those it printed (other lines stay for later expects)."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=HERE,
        )
        self.lines: list[str] = []
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self.cond:
                self.lines.append(line.strip())
                self.cond.notify_all()

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def expect(self, prefix: str, timeout_s: float = 60.0) -> str:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                for i, line in enumerate(self.lines):
                    if line.startswith(prefix):
                        return self.lines.pop(i)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no line {prefix!r} within {timeout_s:g}s")
                self.cond.wait(left)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def ask_until(p: Proc, want: str, timeout_s: float) -> str:
    """Query the process until it answers `want` (or the timeout); its last answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        p.send("query")
        got = p.expect("served")
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def trainer_proc(d: Daemon, model: str, rank: int, size: int) -> Proc:
    return Proc(["_trainer_worker.py", d.address, model, str(rank), str(size), f"cpu:{rank}"])


def infer_proc(d: Daemon, model: str, pool: str, device: str, *extra: str) -> Proc:
    args = ["_inference_worker.py", d.address, model, "--pool", pool, "--device", device]
    return Proc([*args, "--queries", *extra])


def test_trainer_rank_killed_before_it_asks_fails_the_refit_at_its_lease(
    daemon: Daemon,
) -> None:
    model = "dead-rank"
    infer = infer_proc(daemon, model, "infer", "cpu:1")
    ranks = [trainer_proc(daemon, model, r, 2) for r in (0, 1)]
    restarted = None
    try:
        for p in (infer, *ranks):
            p.expect("ready")
        wait_subscribed(daemon.address, model)
        for p in ranks:
            p.send("refit 1 committed")
        for p in ranks:
            assert p.expect("refit 1 ").split()[2] == "committed"
        assert infer.expect("commit 1") == "commit 1 ok"

        ranks[1].kill()  # dies before it asks for version 2
        t0 = time.monotonic()
        ranks[0].send("refit 2 committed")
        line = ranks[0].expect("refit 2 ", timeout_s=LEASE_S + MARGIN_S)
        elapsed = time.monotonic() - t0
        assert line.split()[2] == "failed", line
        assert "(rank 1 of pool 'trainer')" in line and "lease expired" in line, line
        assert "barrier timeout" not in line, line
        assert elapsed < LEASE_S + MARGIN_S
        # Early pause had paused the pool: nothing was written, it resumes version 1.
        assert infer.expect("abort 2", timeout_s=10).startswith("abort 2")
        # Its state is published once the abort's delivery (the callback printing it) ended.
        assert ask_until(infer, "served 1 serving", timeout_s=10) == "served 1 serving"

        # The rank comes back and the next refit commits bit for bit.
        restarted = trainer_proc(daemon, model, 1, 2)
        restarted.expect("ready")
        for p in (ranks[0], restarted):
            p.send("refit 3 committed")
        for p in (ranks[0], restarted):
            assert p.expect("refit 3 ").split()[2] == "committed"
        assert infer.expect("commit 3") == "commit 3 ok"
    finally:
        for p in (infer, *ranks, restarted):
            if p is not None:
                p.kill()


def test_wait_served_returns_once_every_inference_rank_serves_the_version(
    daemon: Daemon, tmp_path: Path
) -> None:
    """Two inference processes with a slow resume; wait="served" returns only when both
    serve v, as each process itself reports. A rank that does not ack in time, or dies
    in its resume hook, is named (and only it), and the call ends within the commit
    timeout; every rank not named serves v."""
    model = "served"
    gate = tmp_path / "resume"
    gate.mkdir()
    a = infer_proc(daemon, model, "infer-a", "cpu:1", "--resume-delay", "0.3")
    b = infer_proc(daemon, model, "infer-b", "cpu:0", "--resume-gate", str(gate))
    shards = rank_shards(TINY, ParallelLayout(), 0)
    src = {s.name: torch.zeros(s.local_shape, dtype=torch.bfloat16) for s in shards}
    gen = WeightGenerator(SEED)
    trainer = TrainerClient(daemon.address, model, rank=0, pool_size=1, device="cpu:0")
    try:
        trainer.register(src)
        for p in (a, b):
            p.expect("ready")
        wait_subscribed(daemon.address, model)

        def refit(v: int):
            for s in shards:
                gen.fill(src[s.name], s, v)
            t0 = time.monotonic()
            return trainer.refit(v, wait="served", timeout=60), time.monotonic() - t0

        for v in (1, 2):
            (gate / str(v)).touch()
            r, _ = refit(v)
            assert (r.state, r.served, r.message) == ("committed", True, "")
            for p in (a, b):  # asked only after the call returned
                p.send("query")
                assert p.expect("served") == f"served {v} serving"
                assert p.expect(f"commit {v}") == f"commit {v} ok"

        # b's resume hook hangs: the call ends at the commit timeout, naming b.
        r, seconds = refit(3)
        assert (r.state, r.served) == ("committed", False)
        assert f"no COMMIT ack within {COMMIT_TIMEOUT_S:g}s" in r.message, r.message
        assert "(rank 0 of pool 'infer-b')" in r.message and "infer-a" not in r.message
        assert seconds < COMMIT_TIMEOUT_S + MARGIN_S
        (gate / "3").touch()
        assert b.expect("commit 3") == "commit 3 ok"

        # b dies in its resume hook: the call ends when its subscription closes.
        out: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: out.put(refit(4)), daemon=True).start()
        b.expect("resuming 4")
        b.kill()
        r, seconds = out.get(timeout=COMMIT_TIMEOUT_S + MARGIN_S)
        assert (r.state, r.served) == ("committed", False)
        assert "(rank 0 of pool 'infer-b') closed its subscription" in r.message, r.message
        assert "infer-a" not in r.message, r.message  # a acked: it serves 4
        a.send("query")
        assert a.expect("served") == "served 4 serving"
        assert a.expect("commit 4") == "commit 4 ok"
    finally:
        trainer.close()
        for p in (a, b):
            p.kill()


def test_served_version_is_published_after_the_event_is_delivered(daemon: Daemon) -> None:
    """While the on_update callback of a commit runs, the callback already sees the new
    served_version, other threads still see the old one, and the controller has no ack
    (wait="served" has not returned); after it returns all three agree."""
    model = "ordering"
    shards = rank_shards(TINY, ParallelLayout(), 0)
    src = {s.name: torch.zeros(s.local_shape, dtype=torch.bfloat16) for s in shards}
    dst = {s.name: torch.zeros(s.local_shape, dtype=torch.bfloat16) for s in shards}
    trainer = TrainerClient(daemon.address, model, rank=0, pool_size=1, device="cpu:0")
    infer = InferenceClient(daemon.address, model, "infer", rank=0, pool_size=1, device="cpu:1")
    entered, release = threading.Event(), threading.Event()
    seen_inside: list[int | None] = []
    commits: list[int] = []

    def on_event(event) -> None:
        if event.kind == "commit":
            seen_inside.append(infer.served_version)
            entered.set()
            release.wait(30)
            commits.append(event.version)

    try:
        trainer.register(src)
        infer.register({n: Placed(t) for n, t in dst.items()})
        infer.on_update(on_event)
        wait_subscribed(daemon.address, model)
        out: queue.Queue = queue.Queue()
        threading.Thread(
            target=lambda: out.put(trainer.refit(1, wait="served", timeout=60)), daemon=True
        ).start()
        assert entered.wait(60), "the commit never reached the callback"
        assert seen_inside == [1]
        assert infer.served_version is None and infer.state == "paused"
        assert out.empty()  # no ack before the callback returned
        release.set()
        r = out.get(timeout=30)
        assert (r.state, r.served) == ("committed", True)
        assert infer.served_version == 1 and infer.state == "serving"
        assert commits == [1]
    finally:
        release.set()
        infer.close()
        trainer.close()
