"""A toy inference engine that behaves like vLLM/SGLang around a weight update.

A serving thread takes requests from a queue and answers each from the current weights
(y = W x applied over its layers, or a `forward` of the caller's). `pause()` stops it from
reading weights: it returns once the request in flight has finished, and new requests wait
in the queue; `resume(version)` serves again, now tagging answers with the new version.
`call(fn)` runs fn on the serving thread between two requests, as vLLM runs a worker RPC
(`update_weights`) between forward passes: the engine-driven path of clients.vllm_backend,
where `served()` (the backend's `served_version`) stamps each answer with the version the
weights held when it was computed. Every answer carries the version it was computed with,
so a test can check that no answer ever mixed two versions.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class Answer:
    """An answer and the weights version that produced it (None: before the first one)."""

    version: int | None
    output: torch.Tensor


class TinyEngine:
    """A serving loop over `weights` (name -> [n, n] matrices applied in name order), or
    answering `forward(x)` when given; answers are stamped with `served()` when given,
    else with the version of the last `resume`."""

    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        pause_timeout_s: float = 30.0,
        forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
        served: Callable[[], int | None] | None = None,
    ) -> None:
        self.weights = weights
        self.forward = forward or self._matmuls
        self.served = served
        self.version: int | None = None
        self.pause_timeout_s = pause_timeout_s
        self._requests: queue.Queue[tuple[Any, Future[Any]] | None] = queue.Queue()
        self._serving = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._loop, name="tiny-engine", daemon=True)

    def start(self, version: int | None = None) -> TinyEngine:
        self.version = version
        self._serving.set()
        self._thread.start()
        return self

    def submit(self, x: torch.Tensor) -> Future[Answer]:
        fut: Future[Answer] = Future()
        self._requests.put((x, fut))
        return fut

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run fn() on the serving thread between two requests (no forward meanwhile)."""
        fut: Future[Any] = Future()
        self._requests.put((fn, fut))
        return fut

    def pause(self, version: int | None = None) -> None:
        """Stop reading weights; returns when the request in flight has finished."""
        self._serving.clear()
        if not self._idle.wait(self.pause_timeout_s):
            raise TimeoutError(f"engine still busy {self.pause_timeout_s} s after pause")

    def resume(self, version: int | None) -> None:
        """Serve again, answers now computed with (and tagged as) `version`."""
        self.version = version
        self._serving.set()

    def stop(self) -> None:
        self._serving.set()
        self._requests.put(None)
        self._thread.join(10)

    def _loop(self) -> None:
        while True:
            item = self._requests.get()
            if item is None:
                return
            x, fut = item
            self._serving.wait()
            self._idle.clear()
            try:
                if not self._serving.is_set():  # paused between the wait and here
                    self._requests.put(item)
                    continue
                if callable(x):
                    fut.set_result(x())
                else:
                    version = self.served() if self.served else self.version
                    fut.set_result(Answer(version, self.forward(x)))
            except Exception as exc:
                fut.set_exception(exc)
            finally:
                self._idle.set()

    def _matmuls(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for name in sorted(self.weights):
            y = self.weights[name].float() @ y
        return y
