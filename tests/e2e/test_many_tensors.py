"""100,000 tensors on one worker refit bit for bit with 1,024 file descriptors per process.

The daemon (controller, agent, transfer processes) and both workers run under
RLIMIT_NOFILE = 1024 (soft and hard): shared memory must cost descriptors per segment, not
per tensor, in the workers and in the transfer processes that map them.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from refitd.demo.run import Daemon

pytestmark = pytest.mark.slow

WORKER = os.path.join(os.path.dirname(__file__), "_many_tensors_worker.py")
NOFILE = 1024
COUNT = 100_000


def _limit_nofile() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


@pytest.fixture(scope="module")
def limited_daemon() -> Iterator[Daemon]:
    d = Daemon(cpu_slots=2, preexec_fn=_limit_nofile, extra_args=["--log-level", "info"])
    d.start()
    try:
        yield d
    finally:
        d.stop()


def _start(daemon: Daemon, role: str, device: str) -> subprocess.Popen:
    cmd = [sys.executable, WORKER, daemon.address, "many", role, "--count", str(COUNT)]
    return subprocess.Popen(
        [*cmd, "--device", device],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=_limit_nofile,
    )


def _line(proc: subprocess.Popen, timeout_s: float) -> str:
    """The next stdout line of a worker (readline under a deadline via a helper thread)."""
    import queue
    import threading

    q: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: q.put(proc.stdout.readline()), daemon=True).start()  # type: ignore[union-attr]
    try:
        line = q.get(timeout=timeout_s)
    except queue.Empty:
        raise AssertionError(f"worker said nothing within {timeout_s:.0f} s") from None
    assert line, f"worker exited with {proc.poll()}"
    return line.strip()


def test_100k_tensors_refit_bit_for_bit_under_1024_descriptors(limited_daemon: Daemon) -> None:
    t0 = time.monotonic()
    trainer = _start(limited_daemon, "trainer", "cpu:0")
    infer = _start(limited_daemon, "infer", "cpu:1")
    try:
        ready = [_line(p, 180).split() for p in (trainer, infer)]
        assert [r[0] for r in ready] == ["ready", "ready"], ready
        assert all(int(r[2]) < 100 for r in ready), ready  # descriptors do not grow with tensors
        for v in (1,):  # one refit: the cached replay is covered by the other e2e tests
            trainer.stdin.write(f"refit {v}\n")  # type: ignore[union-attr]
            trainer.stdin.flush()  # type: ignore[union-attr]
            assert _line(trainer, 180) == f"refit {v} committed", limited_daemon.log_tail()
            assert _line(infer, 60) == f"commit {v} ok"
    finally:
        for p in (trainer, infer):
            p.kill()
            p.wait(10)
    print(
        f"registered in {ready[0][1]} s / {ready[1][1]} s; whole test {time.monotonic() - t0:.1f} s"
    )
