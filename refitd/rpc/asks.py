"""A trainer rank's Refit calls on one stream kept open between refits (the Asks RPC).

An ask on an open stream costs the controller about half a new call, which counts when every
rank of a trainer asks at once after its optimizer step. Each ask is answered as its Refit
call would be (same response, same error status); an error ends the stream and the next ask
opens another. A controller without Asks is asked with Refit calls.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import grpc

from refitd._proto import refitd_pb2 as pb
from refitd.rpc.connection import ControllerConnection, RefitError

Answer = pb.RefitResponse | grpc.RpcError | None  # None: the stream ended without a status


class AskStream:
    """One worker's asks on one Asks stream, each with a deadline. An ask made while
    another waits on the stream (a newer version asked during a refit) is a Refit call."""

    def __init__(self, conn: ControllerConnection) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._requests: queue.SimpleQueue[pb.RefitRequest | None] = queue.SimpleQueue()
        self._answers: queue.SimpleQueue[Answer] = queue.SimpleQueue()
        self._call: Any = None
        self._unary = False  # the controller has no Asks: Refit calls

    def ask(self, request: pb.RefitRequest, what: str, timeout_s: float) -> pb.RefitResponse:
        """The controller's answer to `request`; RefitError as from a Refit call (a deadline
        of `timeout_s` seconds: DEADLINE_EXCEEDED)."""
        if not self._lock.acquire(blocking=False):  # another ask waits on the stream
            return self._conn.call(self._conn.refit.Refit, request, what, timeout_s)
        try:
            return self._ask(request, what, timeout_s)
        finally:
            self._lock.release()

    def _ask(self, request: pb.RefitRequest, what: str, timeout_s: float) -> pb.RefitResponse:
        if self._unary:
            return self._conn.call(self._conn.refit.Refit, request, what, timeout_s)
        if self._call is None or self._call.done():  # gone between asks: open another
            self._open()
        self._requests.put(request)
        try:
            answer = self._answers.get(timeout=timeout_s)
        except queue.Empty:
            self._close()
            raise RefitError(
                f"{what}: DEADLINE_EXCEEDED: no answer within {timeout_s:g} s",
                grpc.StatusCode.DEADLINE_EXCEEDED,
            ) from None
        if isinstance(answer, pb.RefitResponse):
            return answer
        self._close()
        if answer is None:
            raise RefitError(f"{what}: UNAVAILABLE: the stream ended", grpc.StatusCode.UNAVAILABLE)
        if answer.code() == grpc.StatusCode.UNIMPLEMENTED:
            self._unary = True
            return self._conn.call(self._conn.refit.Refit, request, what, timeout_s)
        raise RefitError.from_rpc(answer, what)

    def close(self) -> None:
        """End the stream (the controller sees the call cancelled); an ask waiting on it
        raises RefitError (CANCELLED). Does not wait for that ask."""
        self._close()

    def _open(self) -> None:
        self._close()
        self._requests, self._answers = queue.SimpleQueue(), queue.SimpleQueue()
        self._call = self._conn.refit.Asks(iter(self._requests.get, None))
        threading.Thread(
            target=_read, args=(self._call, self._answers), name="refitd-asks", daemon=True
        ).start()

    def _close(self) -> None:
        call, self._call = self._call, None
        if call is not None:
            self._requests.put(None)
            call.cancel()


def _read(call: Any, answers: queue.SimpleQueue[Answer]) -> None:
    """The stream's answers into `answers`, then how it ended."""
    try:
        for response in call:
            answers.put(response)
        answers.put(None)
    except grpc.RpcError as err:
        answers.put(err)
