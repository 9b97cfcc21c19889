"""The asyncio loop the controller's gRPC server runs on, and the hand-offs between it and
the controller's threads.

The calls of every refit (Refit, Ack, Events, Report, heartbeats) and the streams run as
coroutines on one loop thread: a call costs no hand-off to a pool thread, and an open stream
no thread at all. Calls that may block (registrations, status, SQLite) run on the loop's
thread pool (`offload`). The controller's threads reach the loop through `soon`, which
wakes it once per burst however many callbacks the burst brings (a refit's 32 PAUSE events
are one wake-up), and coroutines wait for a thread's news on a `Signal`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
Soon = Callable[[Callable[[], None]], None]


class ServerLoop:
    """An event loop on a thread of its own, with a thread pool for the calls that block."""

    def __init__(self, workers: int, name: str = "grpc") -> None:
        self.loop = asyncio.new_event_loop()
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._thread = threading.Thread(target=self._run, name=f"{name}-loop", daemon=True)
        self._lock = threading.Lock()
        self._pending: list[Callable[[], None]] = []
        self._scheduled = False

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def start(self) -> ServerLoop:
        self._thread.start()
        return self

    @property
    def on_loop(self) -> bool:
        """Whether the caller runs on the loop's thread."""
        return threading.current_thread() is self._thread

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Run `coro` on the loop from another thread and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def soon(self, fn: Callable[[], None]) -> None:
        """Call `fn` on the loop (at once when the caller is the loop). Callbacks queued
        before the loop drains them share one wake-up."""
        if self.on_loop:
            fn()
            return
        with self._lock:
            self._pending.append(fn)
            first = not self._scheduled
            self._scheduled = True
        if first:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            todo, self._pending = self._pending, []
            self._scheduled = False
        for fn in todo:
            fn()

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a call that may block on the pool; the loop goes on meanwhile."""
        return await self.loop.run_in_executor(self.pool, functools.partial(fn, *args))

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the loop (its tasks are cancelled) and the pool."""
        if not self._thread.is_alive():
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            self.run(cancel_all(), timeout_s)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.loop.close()
        self.pool.shutdown(wait=False, cancel_futures=True)


class Signal(threading.Event):
    """A threading.Event that coroutines can await too (`wait_async`); `set` from any
    thread wakes both kinds of waiter."""

    def __init__(self) -> None:
        super().__init__()
        self._waiters: list[tuple[Soon, asyncio.Future[None]]] = []
        self._guard = threading.Lock()

    def set(self) -> None:
        super().set()
        with self._guard:
            waiters, self._waiters = self._waiters, []
        for soon, fut in waiters:
            soon(functools.partial(_resolve, fut))

    async def wait_async(self, soon: Soon, timeout_s: float) -> bool:
        """Wait on the running loop (reached through `soon`) until set, `timeout_s` at
        most: True when it is set."""
        if self.is_set():
            return True
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (soon, fut)
        with self._guard:
            self._waiters.append(entry)
        try:
            if self.is_set():  # set before the waiter was listed: nobody will wake it
                return True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(fut, max(0.0, timeout_s))
            return self.is_set()
        finally:
            with self._guard, contextlib.suppress(ValueError):
                self._waiters.remove(entry)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
