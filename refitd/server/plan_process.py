"""Plans and slot programs built in a forked planning process, off the controller's GIL.

A plan of 1,000 ranks and its slot programs are over a second of NumPy and Python. Built
in the controller's own interpreter, they would take the interpreter lock from the gRPC
handlers that answer heartbeats and Refit calls meanwhile. So the controller forks one
planning process per plan (`build_forked`): the child reads the kept SpecTables where they
are (the fork shares the parent's pages copy-on-write: nothing is serialized), builds the
plan with `build_plan_from_table` and every slot's program in one index pass, and writes
the result into an anonymous shared-memory file (memfd): a small header (digest, slots,
statistics, per-slot loads, readers, holders) and two columns, every program's bytes end to
end and every program's tensor indices end to end, with their offsets. The parent maps the
file and hands out each slot's program as a slice of the mapping: nothing is copied per
slot, and the plan's transient memory lives and dies in the child.

Every wait has a timeout: the parent waits on the child's pidfd for `timeout_s`, then kills
it. A child that dies (killed, out of memory, a crash) is reported with an error naming its
pid and signal; the caller (planning.make_plan) then builds the plan in its own process, so a
planning process never fails a refit, and the next plan forks a fresh one. A PlanError in the child comes
back as its message.
"""

from __future__ import annotations

import contextlib
import gc
import mmap
import os
import pickle
import resource
import select
import signal
import struct
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from refitd.plan.errors import PlanError
from refitd.plan.planner import Plan, PlanConfig, PlanStats, build_plan_from_table
from refitd.plan.program import encode_program
from refitd.plan.table import SpecTable
from refitd.server.errors import ControlError, ErrorKind
from refitd.server.heap import keep_freed_heap

WorkerKey = tuple[str, int]  # (pool, rank)

FORK_SUPPORT_VAR = "GRPC_ENABLE_FORK_SUPPORT"
_HEAD = struct.Struct("<QQQ")  # status, header offset, header length
_OK, _PLAN_ERROR, _CRASH = 0, 1, 2
_EXIT_OK, _EXIT_FAILED = 0, 3


def fork_safe() -> bool:
    """Whether this process may fork planning processes: gRPC's fork handlers are off. On,
    they restart gRPC's threads in the child, which then share the parent's pollers and
    eventfds (stealing its wake-ups) or die on them. gRPC reads GRPC_ENABLE_FORK_SUPPORT
    when imported; the `refitd` command sets it to 0 first."""
    return os.environ.get(FORK_SUPPORT_VAR, "").strip().lower() in ("0", "false")


@dataclass(frozen=True)
class ForkedPlan:
    """What the planning process hands back: the plan's facts the controller uses and
    every slot's program as columns over one shared mapping."""

    digest: str
    slots: list[int]
    stats: PlanStats
    send_bytes: dict[int, int]
    recv_bytes: dict[int, int]
    readers: dict[WorkerKey, list[int]]
    holders: dict[int, tuple[WorkerKey, ...]]
    programs: memoryview  # every slot's encoded program, end to end, in `slots` order
    program_offsets: np.ndarray  # int64 [slots + 1]
    tensors: np.ndarray  # int64: every slot's program tensors (plan indices), end to end
    tensor_offsets: np.ndarray  # int64 [slots + 1]
    timings: dict[str, float]  # the child's own (_timings)
    links: dict[str, object]  # messages and bytes per path (Plan.link_summary)

    def program(self, i: int) -> memoryview:
        """The i-th slot's encoded program (a slice of the mapping)."""
        return self.programs[int(self.program_offsets[i]) : int(self.program_offsets[i + 1])]

    def tensor_index(self, i: int) -> np.ndarray:
        """Plan indices of the tensors held on the i-th slot (a view)."""
        return self.tensors[int(self.tensor_offsets[i]) : int(self.tensor_offsets[i + 1])]


def build_forked(
    model: str,
    epoch: int,
    sources: SpecTable,
    destinations: SpecTable,
    config: PlanConfig,
    digest: str | None,
    timeout_s: float,
    on_start: Callable[[int], None] | None = None,
) -> ForkedPlan:
    """The plan and every slot's program, built in a forked child (module docstring).
    Raises PlanError as the planner would, and ControlError (UNAVAILABLE) naming the child
    when it dies or overruns `timeout_s`. `on_start(pid)` is called once it runs."""
    fd = os.memfd_create(f"refitd-plan-{model}", os.MFD_CLOEXEC)
    try:
        with warnings.catch_warnings():  # the child runs no thread of the parent's
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child: never returns
            _child(fd, model, epoch, sources, destinations, config, digest)
        if on_start is not None:
            on_start(pid)
        status = _wait(pid, timeout_s, model)
        return _read(fd, pid, status, model)
    finally:
        os.close(fd)


def _wait(pid: int, timeout_s: float, model: str) -> int:
    """The child's wait status, within `timeout_s` (then it is killed and reaped)."""
    pidfd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([pidfd], [], [], max(timeout_s, 0.0))
    finally:
        os.close(pidfd)
    if not ready:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise ControlError(
            ErrorKind.UNAVAILABLE,
            f"the planning process (pid {pid}) of model {model!r} did not finish within "
            f"{timeout_s:g} s and was killed; the next plan starts a new one",
        )
    return os.waitpid(pid, 0)[1]


def _read(fd: int, pid: int, status: int, model: str) -> ForkedPlan:
    """The child's result from the memfd, or the error its exit says."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        raise ControlError(
            ErrorKind.UNAVAILABLE,
            f"the planning process (pid {pid}) of model {model!r} died of signal {sig} "
            f"({signal.Signals(sig).name}) before its plan was built; the next plan starts "
            "a new one",
        )
    # the preamble is written last: short or zero, the child wrote no result
    preamble = os.pread(fd, _HEAD.size, 0).ljust(_HEAD.size, b"\0")
    kind, head_at, head_len = _HEAD.unpack(preamble)
    if not head_len:
        raise ControlError(
            ErrorKind.UNAVAILABLE,
            f"the planning process (pid {pid}) of model {model!r} exited with status "
            f"{os.waitstatus_to_exitcode(status)} without a result",
        )
    view = memoryview(mmap.mmap(fd, 0, prot=mmap.PROT_READ))
    head = pickle.loads(view[head_at : head_at + head_len])
    if kind == _PLAN_ERROR:
        raise PlanError(head)
    if kind != _OK:
        raise ControlError(
            ErrorKind.UNAVAILABLE,
            f"the planning process (pid {pid}) of model {model!r} failed: {head}",
        )
    n_prog, n_tens = head.pop("program_bytes"), head.pop("tensor_count")
    programs = view[_HEAD.size : _HEAD.size + n_prog]
    tensors = np.frombuffer(view, np.int64, n_tens, head.pop("tensors_at"))
    return ForkedPlan(programs=programs, tensors=tensors, **head)


def _child(
    fd: int,
    model: str,
    epoch: int,
    sources: SpecTable,
    destinations: SpecTable,
    config: PlanConfig,
    digest: str | None,
) -> None:
    """Build, write the result into `fd`, and leave with os._exit (no handler of the
    parent's runs here: its threads, gRPC and atexit hooks stay the parent's)."""
    code = _EXIT_FAILED
    try:
        gc.disable()  # a plan's objects are acyclic; the collector only slows it
        keep_freed_heap()  # freed pages reused, not given back and faulted in again
        for sig in (signal.SIGINT, signal.SIGTERM):  # not the parent's handlers: just end
            signal.signal(sig, signal.SIG_DFL)
        with contextlib.suppress(OSError):
            os.closerange(3, fd)  # the parent's sockets and pipes are not ours to hold
            os.closerange(fd + 1, 1 << 16)
        start = _Clock.now()
        try:
            plan = build_plan_from_table(model, epoch, sources, destinations, config, digest)
        except PlanError as e:
            _write(fd, _PLAN_ERROR, str(e))
            os._exit(_EXIT_OK)
        _write_plan(fd, plan, start, _Clock.now())
        code = _EXIT_OK
    except BaseException:  # reported to the parent, which fails the plan with it
        with contextlib.suppress(BaseException):
            _write(fd, _CRASH, traceback.format_exc(limit=8))
    finally:
        os._exit(code)


@dataclass(frozen=True)
class _Clock:
    """Wall and CPU time and page faults of this process so far (the child's timings)."""

    wall: float
    cpu: float
    faults: int

    @classmethod
    def now(cls) -> _Clock:
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        return cls(time.perf_counter(), time.process_time(), faults)


def _write_plan(fd: int, plan: Plan, start: _Clock, planned: _Clock) -> None:
    """Every slot's program from one index pass, each encoded and written as it is built
    (none is kept: at 4,096 ranks they are 0.4 GB of fresh pages), then every slot's
    held tensors and the plan's facts, into fd. start, planned: the clocks before and
    after the plan."""
    slots = plan.slots()
    index = plan.program_index()
    with _Result(fd) as out:
        sizes = [out.write(encode_program(p)) for p in index.programs()]
        tensors, tensor_offsets = index.held_tensors()
        out.align()
        tensors_at = out.write_array(tensors.astype(np.int64, copy=False))
        # from the tensors' columns: a pass over the TensorSpec objects would write to
        # every page of the controller's registrations this process shares (copy-on-write)
        readers = {k: plan.source_slots_of(*k) for k in plan.source_workers()}
        holders = plan.holders()
        plan.release_index()
        head = {
            "digest": plan.digest,
            "slots": slots,
            "stats": plan.stats,
            "send_bytes": plan.send_bytes(),
            "recv_bytes": plan.recv_bytes(),
            "readers": readers,
            "holders": holders,
            "links": plan.link_summary(),
            "program_offsets": np.cumsum([0, *sizes], dtype=np.int64),
            "tensor_offsets": tensor_offsets,
            "program_bytes": sum(sizes),
            "tensor_count": int(tensors.size),
            "tensors_at": tensors_at,
            "timings": _timings(start, planned, _Clock.now()),
        }
        out.finish(_OK, head)


def _timings(start: _Clock, planned: _Clock, done: _Clock) -> dict[str, float]:
    """The plan's and the programs' wall time, the CPU time and page faults of both and of
    the plan alone."""
    return {
        "plan_s": planned.wall - start.wall,
        "programs_s": done.wall - planned.wall,
        "cpu_s": done.cpu - start.cpu,
        "plan_cpu_s": planned.cpu - start.cpu,
        "faults": done.faults - start.faults,
        "plan_faults": planned.faults - start.faults,
    }


def _write(fd: int, kind: int, head: object) -> None:
    """A result of the header alone (an error)."""
    with _Result(fd) as out:
        out.finish(kind, head)


class _Result:
    """The result file as it is written: the preamble (status, where the header is) at
    its start, written last; the body's parts from there; the pickled header at the end."""

    def __init__(self, fd: int) -> None:
        self._file = os.fdopen(os.dup(fd), "wb", buffering=1 << 20)
        self._file.write(bytes(_HEAD.size))
        self.at = _HEAD.size

    def __enter__(self) -> _Result:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()

    def write(self, part: bytes) -> int:
        """Append `part`; its length."""
        self._file.write(part)
        self.at += len(part)
        return len(part)

    def align(self) -> None:
        """Zeros up to the next multiple of 8 bytes."""
        self.write(bytes(-self.at % 8))

    def write_array(self, a: np.ndarray) -> int:
        """Append an array's bytes; where they start."""
        at = self.at
        if a.size:
            self._file.write(memoryview(np.ascontiguousarray(a)).cast("B"))
            self.at += a.nbytes
        return at

    def finish(self, kind: int, head: object) -> None:
        """The pickled header after the body, then the preamble pointing at it."""
        raw = pickle.dumps(head, protocol=pickle.HIGHEST_PROTOCOL)
        at = self.at
        self.write(raw)
        self._file.flush()
        os.pwrite(self._file.fileno(), _HEAD.pack(kind, at, len(raw)), 0)


@dataclass
class PlanningProcess:
    """The controller's planning processes: their timeout, and counts of what they did
    (for the status document, tests and benchmarks). `on_start(pid)` runs as each starts."""

    timeout_s: float = 600.0
    on_start: Callable[[int], None] | None = None
    started: int = 0
    died: int = 0
    last_pid: int = 0
    last_timings: dict[str, float] = field(default_factory=dict)
    _running: int = 0  # children alive: the parent's collector stays frozen meanwhile
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def build(
        self,
        model: str,
        epoch: int,
        sources: SpecTable,
        destinations: SpecTable,
        config: PlanConfig,
        digest: str | None,
    ) -> ForkedPlan:
        """build_forked with this timeout, counted."""
        self.started += 1

        def started(pid: int) -> None:
            self.last_pid = pid
            if self.on_start is not None:
                self.on_start(pid)

        self._freeze()
        try:
            fp = build_forked(
                model, epoch, sources, destinations, config, digest, self.timeout_s, started
            )
        except ControlError:
            self.died += 1
            raise
        finally:
            self._thaw()
        self.last_timings = fp.timings
        return fp

    def _freeze(self) -> None:
        """While a child runs, the collector leaves the objects it shares with this process
        alone: a full collection writes to every tracked object's header, which would copy
        every shared page (a million faults at 4,096 ranks) and stall this process."""
        with self._lock:
            self._running += 1
            gc.freeze()

    def _thaw(self) -> None:
        with self._lock:
            self._running -= 1
            if not self._running:
                gc.unfreeze()
