"""A process's identity on its host, and the registration that proves a rank's former
holder gone.

A rank is registered by one process at a time. When a process restarts on the host where
its rank's holder ran, the controller refuses its registration at once and names the holder
(`HOLDER_METADATA`); this process looks the holder up in its own /proc (the same boot and
pid namespace, so the pid means the same process) and, when no process of that pid and start
time runs, registers again naming it `predecessor`, which takes the rank over at once. A
holder that still runs keeps its rank; one this host cannot see (another host, boot or pid
namespace) is waited for by the controller, as for clients without an identity.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from refitd._proto import refitd_pb2 as pb

HOLDER_METADATA = "refitd-rank-holder-bin"  # a refusal's trailing metadata: the holder
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
DEAD_STATES = ("Z", "X")  # zombie (killed, not reaped yet), dead: its sockets are closed


def this_process() -> pb.ProcessIdentity | None:
    """This process's identity (None where /proc does not give one: not Linux)."""
    try:
        return pb.ProcessIdentity(
            boot_id=BOOT_ID.read_text().strip(),
            pid_namespace=os.readlink("/proc/self/ns/pid"),
            pid=os.getpid(),
            start_ticks=_stat(os.getpid())[1],
        )
    except (OSError, ValueError, IndexError):
        return None


def process_gone(p: pb.ProcessIdentity) -> bool | None:
    """Whether the process `p` no longer runs: True (no process of its pid, or one of a
    later start, or a zombie), False (it runs), None (this process cannot tell: another
    boot or pid namespace, or no /proc)."""
    me = this_process()
    if me is None or (me.boot_id, me.pid_namespace) != (p.boot_id, p.pid_namespace):
        return None
    try:
        state, start = _stat(p.pid)
    except FileNotFoundError:
        return True
    except (OSError, ValueError, IndexError):
        return None
    return start != p.start_ticks or state in DEAD_STATES


def holder(err: grpc.RpcError) -> pb.ProcessIdentity | None:
    """The holder a registration was refused for, when the controller named it."""
    metadata = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    for key, value in metadata or ():
        if key == HOLDER_METADATA and isinstance(value, bytes):
            return pb.ProcessIdentity.FromString(value)
    return None


def register_rank(call: Callable[..., Any], req: pb.RegisterWorkerRequest, **kw: Any) -> Any:
    """`call(req, **kw)` (RegisterWorker) with this process's identity; when the refusal
    names a holder on this host that no longer runs, once more naming it predecessor.
    gRPC errors propagate (a live holder's refusal among them)."""
    me = this_process()
    if me is not None:
        req.process.CopyFrom(me)
    try:
        return call(req, **kw)
    except grpc.RpcError as err:
        gone = holder(err)
        if gone is None or process_gone(gone) is not True:
            raise
    req.predecessor.CopyFrom(gone)
    return call(req, **kw)


def _stat(pid: int) -> tuple[str, int]:
    """(state, start time in clock ticks since boot) of `pid`, from /proc/PID/stat."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rindex(")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
    return fields[0], int(fields[19])
