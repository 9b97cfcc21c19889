"""Recovering from failures the way a trainer does, on a real `refitd serve` with real worker
processes and real kill -9: a version that failed (an inference rank died in its pause hook)
is retried by every trainer rank once the rank is back, and lands; a refit right after the
controller itself was killed and restarted on its data dir lands once `/readyz` says ready;
a second process registering a rank that a live process holds is refused, naming the
holder, and a process restarted after the holder died takes the rank over.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from refitd.demo.run import Daemon

from .test_barrier_served_e2e import Proc, infer_proc, trainer_proc
from .test_faults_e2e import status, wait_subscribed

pytestmark = pytest.mark.slow

SERVE_ARGS = [
    "--heartbeat-interval-s", "0.3",
    "--heartbeat-timeout-s", "2",
    "--pause-timeout-s", "30",
    "--log-level", "info",
]  # fmt: skip
# Trainer ranks heartbeat once a minute: after the restart each registers again on its call.
RESTART_ARGS = [
    "--heartbeat-interval-s", "60",
    "--heartbeat-timeout-s", "300",
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


def refit_all(trainers: list[Proc], version: int) -> list[str]:
    """Every trainer rank refits `version` (wait="committed"): their answer lines."""
    for t in trainers:
        t.send(f"refit {version} committed")
    return [t.expect(f"refit {version} ", timeout_s=90) for t in trainers]


def state(line: str) -> str:
    return line.split()[2]


def test_a_failed_version_is_retried_once_its_inference_rank_is_back(
    daemon: Daemon, tmp_path: Path
) -> None:
    model = "retry"
    gate = tmp_path / "gate"
    gate.mkdir()
    (gate / "1").touch()
    infer = infer_proc(daemon, model, "infer", "cpu:1", "--gate", str(gate))
    trainers = [trainer_proc(daemon, model, r, 2) for r in (0, 1)]
    restarted: Proc | None = None
    try:
        for p in (infer, *trainers):
            p.expect("ready")
        wait_subscribed(daemon.address, model)
        assert [state(x) for x in refit_all(trainers, 1)] == ["committed"] * 2
        assert infer.expect("commit 1") == "commit 1 ok"

        # Version 2: the inference rank dies in its pause hook; every trainer rank is told.
        for t in trainers:
            t.send("refit 2 committed")
        infer.expect("paused 2")
        infer.kill()
        failed = [t.expect("refit 2 ", timeout_s=60) for t in trainers]
        assert [state(x) for x in failed] == ["failed"] * 2, failed
        assert "(rank 0 of pool 'infer') closed its subscription" in failed[0], failed[0]

        # The rank restarts; every trainer rank retries version 2 (a new attempt): it lands,
        # bit for bit on the restarted rank.
        (gate / "2").touch()
        restarted = infer_proc(daemon, model, "infer", "cpu:1", "--gate", str(gate))
        restarted.expect("ready")
        wait_subscribed(daemon.address, model)
        retried = refit_all(trainers, 2)
        assert [state(x) for x in retried] == ["committed"] * 2, retried
        assert restarted.expect("commit 2") == "commit 2 ok"
    finally:
        for p in (infer, *trainers, restarted):
            if p is not None:
                p.kill()


def test_a_rank_held_by_a_live_process_is_not_registered_by_a_second_one(
    daemon: Daemon,
) -> None:
    model = "one-holder"
    infer = infer_proc(daemon, model, "infer", "cpu:1")
    first = trainer_proc(daemon, model, 0, 1)
    procs = [infer, first]
    try:
        holder = first.expect("ready").split()[1]
        infer.expect("ready")
        wait_subscribed(daemon.address, model)
        second = trainer_proc(daemon, model, 0, 1)
        procs.append(second)
        refused = second.expect("refused", timeout_s=60)
        assert (
            f"rank 0 of pool 'trainer' of model {model!r} is held by live worker {holder} "
            f"(rank 0 of pool 'trainer'), pid {first.proc.pid} on host "
            f"{socket.gethostname()!r}" in refused
        ), refused
        # The holder is undisturbed: its refit lands.
        assert [state(x) for x in refit_all([first], 1)] == ["committed"]
        assert infer.expect("commit 1") == "commit 1 ok"

        # The holder dies; a restarted process takes the rank over, and its refit lands.
        first.kill()
        third = trainer_proc(daemon, model, 0, 1)
        procs.append(third)
        assert third.expect("ready", timeout_s=60).split()[1] != holder
        assert [state(x) for x in refit_all([third], 2)] == ["committed"]
        assert infer.expect("commit 2") == "commit 2 ok"
    finally:
        for p in procs:
            p.kill()


def wait_ready(d: Daemon, timeout_s: float) -> float:
    """Poll /readyz until it answers 200; seconds it took."""
    t0 = time.monotonic()
    with httpx.Client(base_url=f"http://127.0.0.1:{d.http_port}", timeout=2) as http:
        while True:
            try:
                if http.get("/readyz").status_code == 200:
                    return time.monotonic() - t0
            except httpx.TransportError:
                pass  # not listening yet
            assert time.monotonic() - t0 < timeout_s, f"not ready in {timeout_s:g}s"
            time.sleep(0.05)


def connected_slots(d: Daemon) -> int:
    return sum(1 for x in status(d.address)["slots"] if x["connected"])


def test_a_refit_right_after_a_controller_restart_lands() -> None:
    """kill -9 of `refitd serve` (controller and embedded agent), restarted on the same data
    dir: the refit asked as soon as /readyz answers 200 lands bit for bit, and the trainer
    ranks see no error (their heartbeat period is long, so each registers again on its
    Refit call)."""
    d = Daemon(cpu_slots=2, extra_args=RESTART_ARGS)
    model = "restart"
    procs: list[Proc] = []
    try:
        d.start(wait=False)
        wait_ready(d, timeout_s=60)  # a fresh start: ready once the embedded agent is connected
        assert connected_slots(d) == 2
        infer = infer_proc(d, model, "infer", "cpu:1")
        trainers = [trainer_proc(d, model, r, 2) for r in (0, 1)]
        procs = [infer, *trainers]
        for p in (infer, *trainers):
            p.expect("ready")
        wait_subscribed(d.address, model)
        assert [state(x) for x in refit_all(trainers, 1)] == ["committed"] * 2
        assert infer.expect("commit 1") == "commit 1 ok"

        d.kill()
        d.start(wait=False)
        wait_ready(d, timeout_s=60)
        assert connected_slots(d) == 2
        answers = refit_all(trainers, 2)
        assert [state(x) for x in answers] == ["committed"] * 2, (answers, d.log_tail())
        assert infer.expect("commit 2") == "commit 2 ok"
    finally:
        for p in procs:
            p.kill()
        d.stop()
