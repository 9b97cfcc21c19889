"""The main job: the daemon, a tp=2 x pp=2 trainer and two inference pools, N refits.

Pool A is tp=2 (explicit boxes), pool B is tp=1 x dp=2 (whole replicas); the trainer
registers Megatron attributes. Slots: `refitd serve --cpu-slots 4`; trainer rank r on
cpu:r, pool A rank r on cpu:r (collocated with the first PP stage: local copies), pool B
rank r on cpu:(2 + r) (collocated with the last stage). Every version is checked bit for
bit on every inference rank before the trainer steps again.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from refitd._proto import refitd_pb2 as pb
from refitd._proto import refitd_pb2_grpc as pb_grpc
from refitd.demo.gpt import GptConfig, ParallelLayout
from refitd.demo.workers import WorkerSpec, inference_main, trainer_main

MODEL = "demo-gpt"
DEMO_SLOTS = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Daemon:
    """`refitd serve` as a child process on free loopback ports, state in a temp dir."""

    cpu_slots: int = DEMO_SLOTS
    extra_args: list[str] = field(default_factory=list)
    preexec_fn: Callable[[], Any] | None = None  # run in the child before exec (e.g. rlimits)
    grpc_port: int = 0
    http_port: int = 0
    process: subprocess.Popen | None = None
    _tmp: tempfile.TemporaryDirectory | None = None
    _log: Any = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def status_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/"

    def start(self, ready_timeout_s: float = 60.0, wait: bool = True) -> Daemon:
        """Start `refitd serve`; with `wait`, until every slot's agent is connected. After
        `kill()` it starts again on the same ports and state dir (a restart)."""
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="refitd-demo-")
            self._log = open(os.path.join(self._tmp.name, "serve.log"), "w+b")  # noqa: SIM115
        self.grpc_port = self.grpc_port or free_port()
        self.http_port = self.http_port or free_port()
        cmd = [
            sys.executable, "-m", "refitd.cli.main", "serve",
            "--grpc-port", str(self.grpc_port),
            "--http-port", str(self.http_port),
            "--cpu-slots", str(self.cpu_slots),
            "--data-dir", self._tmp.name,
            *self.extra_args,
        ]  # fmt: skip
        self.process = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=self.preexec_fn
        )
        if wait:
            self._wait_ready(ready_timeout_s)
        return self

    def kill(self) -> None:
        """SIGKILL the daemon (a crash): its state dir and ports stay for `start()`."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def _wait_ready(self, timeout_s: float) -> None:
        import grpc

        channel = grpc.insecure_channel(self.address)
        stub = pb_grpc.RefitStub(channel)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if self.process is not None and self.process.poll() is not None:
                    raise RuntimeError(f"refitd serve exited early:\n{self.log_tail()}")
                if self._slots_connected(stub) >= self.cpu_slots:
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"refitd serve: {self.cpu_slots} slots not connected after "
                        f"{timeout_s:.0f} s:\n{self.log_tail()}"
                    )
                time.sleep(0.2)
        finally:
            channel.close()

    @staticmethod
    def _slots_connected(stub: Any) -> int:
        """Slots whose agent has its command stream open (0 while the daemon starts)."""
        import grpc

        try:
            doc = json.loads(stub.GetStatus(pb.StatusRequest(), timeout=2.0).json)
        except grpc.RpcError:
            return 0
        return sum(1 for s in doc.get("slots", []) if s.get("connected"))

    def log_tail(self, n: int = 4000) -> str:
        if self._log is None:
            return ""
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-n:]

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        if self._log is not None:
            self._log.close()
        if self._tmp is not None:
            self._tmp.cleanup()


@dataclass(frozen=True)
class RefitLine:
    """One refit as the demo reports it."""

    version: int
    seconds: float
    bytes: int
    step_s: float
    verify_s: float

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class DemoError(RuntimeError):
    """A worker failed or a version did not land bit for bit."""


class Demo:
    """Worker processes of the main job around a running daemon."""

    def __init__(
        self,
        controller: str,
        config: GptConfig,
        seed: int = 1234,
        timeout_s: float = 120.0,
        say: Callable[[str], None] = print,
    ) -> None:
        self.controller = controller
        self.config = config
        self.seed = seed
        self.timeout_s = timeout_s
        self.say = say
        self.ctx = mp.get_context("spawn")
        self.out: Any = self.ctx.Queue()
        self.stop_event = self.ctx.Event()
        self.trainer_queues: list[Any] = []
        self.procs: list[Any] = []
        trainer = ParallelLayout(tp=2, pp=2)
        pool_a = ParallelLayout(tp=2)
        pool_b = ParallelLayout(tp=1, dp=2)
        self.trainers = [
            self._spec("trainer", r, trainer, f"cpu:{r}", "megatron") for r in range(4)
        ]
        self.inference = [self._spec("infer-a", r, pool_a, f"cpu:{r}", "boxes") for r in range(2)]
        self.inference += [
            self._spec("infer-b", r, pool_b, f"cpu:{2 + r}", "replica") for r in range(2)
        ]

    def _spec(
        self, pool: str, rank: int, layout: ParallelLayout, device: str, how: str
    ) -> WorkerSpec:
        return WorkerSpec(
            self.controller, MODEL, pool, rank, layout, device, self.config, self.seed, how,
            self.timeout_s,
        )  # fmt: skip

    @property
    def destination_bytes(self) -> int:
        """Bytes written per refit: pool A holds one copy of the model, pool B two."""
        return 3 * self.config.nbytes

    def start(self) -> None:
        for spec in self.trainers:
            q = self.ctx.Queue()
            self.trainer_queues.append(q)
            self._spawn(trainer_main, spec, q)
        for spec in self.inference:
            self._spawn(inference_main, spec, self.stop_event)
        want = {(s.pool, s.rank) for s in self.trainers + self.inference}
        seen: set[tuple[str, int]] = set()
        while seen != want:
            msg = self._next()
            if msg[0] == "registered":
                seen.add((msg[1], msg[2]))
        self.say(
            f"registered {len(seen)} workers (trainer tp=2,pp=2; infer-a tp=2; infer-b tp=1,dp=2)"
        )

    def _spawn(self, target: Callable, spec: WorkerSpec, arg: Any) -> None:
        p = self.ctx.Process(target=target, args=(spec, arg, self.out), daemon=True)
        p.start()
        self.procs.append(p)

    def _next(self) -> tuple:
        try:
            msg = self.out.get(timeout=self.timeout_s)
        except queue.Empty:
            raise DemoError(f"no progress from the workers in {self.timeout_s:.0f} s") from None
        if msg[0] == "error":
            raise DemoError(f"{msg[1]} rank {msg[2]} failed:\n{msg[3]}")
        if msg[0] == "event":
            raise DemoError(f"{msg[1]} rank {msg[2]}: {msg[3]} for version {msg[4]}: {msg[5]}")
        return msg

    def refit(self, version: int) -> RefitLine:
        """Step every trainer rank to `version`, wait for it to be committed and checked."""
        for q in self.trainer_queues:
            q.put(("step", version, "committed"))
        results, checks = {}, {}
        while len(results) < len(self.trainers) or len(checks) < len(self.inference):
            msg = self._next()
            if msg[0] == "refit" and msg[3] == version:
                if msg[4] != "committed":
                    raise DemoError(f"trainer rank {msg[2]}: version {version} ended {msg[4]}")
                results[msg[2]] = msg
            elif msg[0] == "verified" and msg[3] == version:
                if not msg[4]:
                    raise DemoError(f"{msg[1]} rank {msg[2]} version {version}: {msg[5]}")
                checks[(msg[1], msg[2])] = msg
        r0 = results[0]
        seconds = r0[5] or r0[8]
        return RefitLine(
            version=version,
            seconds=seconds,
            bytes=r0[6] or self.destination_bytes,
            step_s=max(r[7] for r in results.values()),
            verify_s=max(c[6] for c in checks.values()),
        )

    def close(self) -> None:
        for q in self.trainer_queues:
            q.put(("stop",))
        self.stop_event.set()
        for p in self.procs:
            p.join(timeout=15)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)


def run_demo(
    refits: int = 5,
    model_mb: float = 384,
    keep_running: bool = False,
    say: Callable[[str], None] = print,
    serve_args: list[str] | None = None,
) -> list[RefitLine]:
    """Start everything, run `refits` verified refits, print a line per phase and refit."""
    t0 = time.perf_counter()
    config = GptConfig.for_megabytes(model_mb)
    say(
        f"model {MODEL}: {config.layers} layers, hidden {config.hidden}, ffn {config.ffn}, "
        f"vocab {config.vocab}: {config.nbytes / 1e6:.0f} MB of BF16 weights"
    )
    daemon = Daemon(extra_args=list(serve_args or []))
    demo: Demo | None = None
    lines: list[RefitLine] = []
    try:
        say(f"starting refitd serve --cpu-slots {daemon.cpu_slots} (controller + local agent)")
        daemon.start()
        say(f"refitd serve up: gRPC {daemon.address}, status page {daemon.status_url}")
        demo = Demo(daemon.address, config, say=say)
        say("starting 8 worker processes and registering their tensors")
        demo.start()
        for v in range(1, refits + 1):
            line = demo.refit(v)
            lines.append(line)
            say(
                f"refit v{v}: {line.seconds:.2f} s, {line.bytes / 1e9:.2f} GB, "
                f"{line.gbps:.2f} GB/s; verified bit for bit on 4 inference ranks "
                f"(step {line.step_s:.2f} s, check {line.verify_s:.2f} s)"
            )
        total = sum(x.bytes for x in lines)
        secs = sum(x.seconds for x in lines)
        say(
            f"done: {len(lines)} refits, {total / 1e9:.2f} GB in {secs:.2f} s "
            f"({total / secs / 1e9 if secs else 0:.2f} GB/s), wall {time.perf_counter() - t0:.1f} s; "
            f"status page {daemon.status_url}"
        )
        if keep_running:
            say(
                f"--keep-running: daemon and workers stay up at {daemon.status_url}; Ctrl-C to stop"
            )
            try:
                while daemon.process is not None and daemon.process.poll() is None:
                    time.sleep(1.0)
            except KeyboardInterrupt:
                pass
        return lines
    except DemoError:
        say(f"daemon log (tail):\n{daemon.log_tail()}")
        raise
    finally:
        if demo is not None:
            demo.close()
        daemon.stop()
