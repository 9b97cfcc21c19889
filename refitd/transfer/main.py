"""The transfer process's command loop: one OS process per device slot, serving typed
commands (refitd.slot_protocol) from its node agent over a multiprocessing Pipe.

Each `Request` is answered by a `Response` with the same rid; errors come back as `Failed`
and are raised in the parent. execute runs in its own thread (refit_command.py), so an abort
arriving meanwhile is served at once; at most one execute runs at a time.
"""

from __future__ import annotations

import contextlib
import ctypes
from multiprocessing.connection import Connection

import torch

from refitd.executor.errors import ExecutionError
from refitd.limits import raise_nofile_limit
from refitd.slot_protocol import (
    Abort,
    Ack,
    Apply,
    Close,
    Connect,
    Execute,
    Load,
    Ping,
    Pong,
    Probe,
    Reply,
    Request,
    Response,
    Unload,
    Unloaded,
)
from refitd.transfer.execute import failure, start_execute
from refitd.transfer.probe import probe
from refitd.transfer.slot import TransferSlot

PR_SET_NAME = 15  # prctl(2): the thread's name, which ps, top and psutil's name() show


def name_this_process(name: str) -> None:
    """Give the process a name operators and the fault suite can find (Linux; else a no-op).
    Forked transfer processes otherwise all look like their fork server."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def transfer_process_main(conn: Connection, slot: int, device: str | None, name: str) -> None:
    """Entry point of a transfer process: serve commands until close or the pipe closes."""
    name_this_process(name)
    raise_nofile_limit()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if device is not None and device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    state = TransferSlot(conn, slot)
    while True:
        try:
            req = conn.recv()
        except (EOFError, OSError):
            break
        if not isinstance(req, Request):
            state.reply(Response(-1, failure(ExecutionError(f"not a request: {req!r}"))))
            continue
        cmd, rid = req.command, req.rid
        if isinstance(cmd, Close):
            state.close()
            state.reply(Response(rid, Ack()))
            break
        if isinstance(cmd, Abort):
            state.abort_refit(cmd.refit_id)
            state.reply(Response(rid, Ack()))
        elif isinstance(cmd, Execute):
            if state.busy.is_set():
                err = ExecutionError("a refit is already running on this slot")
                state.reply(Response(rid, failure(err)))
            else:
                start_execute(state, rid, cmd)
        else:
            try:
                body = _answer(state, cmd)
            except BaseException as e:
                body = failure(e)
            state.reply(Response(rid, body))
    conn.close()


def _answer(state: TransferSlot, cmd: object) -> Reply:
    """The reply of a command answered on the loop's own thread."""
    match cmd:
        case Connect():
            state.connect(cmd)
            return Ack()
        case Load():
            return state.load(cmd)
        case Unload():
            return Unloaded(state.loaded.pop(cmd.digest, None) is not None)
        case Probe():
            return probe(state, cmd)
        case Apply():
            return state.apply(cmd)
        case Ping():
            return Pong(state.slot)
    raise ExecutionError(f"unknown transfer-process command {type(cmd).__name__}")
