"""The engine side of an engine-driven refit: weights land only while the engine waits for
them, so no forward pass ever reads a half-written tensor.

refitd's controller drives a refit (PAUSE, write in place, COMMIT) when the trainer asks
for a version; vLLM and SGLang drive their weight updates from the engine (vLLM's
`update_weights`, SGLang's `update_weights_from_tensor`), each running on the thread that
also runs the model's forward passes. The receiver joins the two:

- `receive(v)` (the engine's thread, inside its update call) opens the gate and waits until
  version v (or a newer one) is committed into this rank, or the refit fails;
- the PAUSE hook (the client's event thread) acks only while the gate is open: it waits up
  to `pause_wait_s` for the engine to call its update, else refuses the PAUSE, and the
  refit ends with ABORT with the weights untouched;
- COMMIT, ABORT and INCOMPLETE end the wait (ABORT and INCOMPLETE as a RefitError).

Every wait is bounded: the PAUSE hook by `pause_wait_s` (below the controller's
pause_timeout_s), `receive` by `update_timeout_s` until a PAUSE arrives and then by
`landing_timeout_s` for the refit's outcome, which the controller's own transfer and commit
timeouts bound earlier. Neither side waits for the other without one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from clients.engine_layouts import EngineLayout, register_engine
from refitd.client import InferenceClient, RefitError, VersionEvent

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReceiverOptions:
    """Timeouts (seconds) of the engine side, and whether the pool is staged."""

    pause_wait_s: float = 20.0  # a PAUSE waits this long for the engine's update call
    update_timeout_s: float = 300.0  # an update waits this long for its refit's PAUSE
    landing_timeout_s: float = 600.0  # once paused, the longest wait for COMMIT / ABORT
    subscribe_timeout_s: float = 30.0  # registration: the event stream opens
    catchup_wait_s: float = 5.0  # registration: a catch-up of the committed version starts
    staged: bool = False  # InferenceClient(staged=True): bytes land in staging first

    def __post_init__(self) -> None:
        for name in ("pause_wait_s", "update_timeout_s", "landing_timeout_s",
                     "subscribe_timeout_s", "catchup_wait_s"):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")


class RefitdReceiver:
    """One engine rank's link to refitd: its parameters registered in place through an
    engine layout, and the gate that lets refits land only inside `receive`."""

    def __init__(
        self,
        controller: str,
        model: str,
        pool: str,
        rank: int,
        pool_size: int,
        device: str,
        options: ReceiverOptions | None = None,
    ) -> None:
        self.options = options or ReceiverOptions()
        self._cond = threading.Condition()
        self._receiving: int | None = None  # version the engine waits for (gate open)
        self._paused: int | None = None  # version of the PAUSE acked, until its outcome
        self._paused_at = 0.0
        self._landed: int | None = None  # committed version the weights hold
        self._failure: str | None = None  # how the refit awaited ended, if not committed
        self._hello: int | None = None  # committed version when the subscription opened
        self.client = InferenceClient(
            controller, model, pool, rank=rank, pool_size=pool_size, device=device,
            pause=self._on_pause, staged=self.options.staged,
        )  # fmt: skip

    @property
    def served_version(self) -> int | None:
        """The refitd version the registered weights hold (None: none landed yet, or a
        failed refit left them torn)."""
        with self._cond:
            return self._landed

    def register(self, params: Mapping[str, torch.Tensor], layout: EngineLayout) -> None:
        """Register the engine's own parameters (in place) and follow the pool's events.
        Catches up to the committed version when the controller sends it at once."""
        register_engine(self.client, params, layout)
        self.client.on_update(self._on_event)
        with self._cond:
            if not self._cond.wait_for(
                lambda: self._hello is not None, self.options.subscribe_timeout_s
            ):
                raise TimeoutError(
                    f"{self._who()}: no event stream from the controller within "
                    f"{self.options.subscribe_timeout_s:.0f} s"
                )
            committed = self._hello or 0
        if committed:
            # A rank that registers after a commit is caught up from a replica that serves
            # it, when one covers it; otherwise it gets the next version.
            self.receive(committed, self.options.catchup_wait_s, missing_ok=True)

    def receive(
        self, version: int, timeout_s: float | None = None, missing_ok: bool = False
    ) -> int | None:
        """Open the gate and wait until `version` (or a newer one) is committed into this
        rank; returns the version landed. Raises RefitError when the refit ends without a
        commit, TimeoutError when no refit paused this rank within the timeout (None with
        `missing_ok`). Call it from the thread that runs the engine's forward passes."""
        wait = self.options.update_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait
        with self._cond:
            if self._receiving is not None:
                raise RuntimeError(f"{self._who()}: already waiting for a version")
            self._receiving, self._failure = version, None
            self._cond.notify_all()
            try:
                return self._wait_landed(version, deadline, wait, missing_ok)
            finally:
                self._receiving = None

    def _wait_landed(
        self, version: int, deadline: float, wait: float, missing_ok: bool
    ) -> int | None:
        while True:
            if self._paused is None:
                if self._landed is not None and self._landed >= version:
                    return self._landed
                if self._failure is not None:
                    raise RefitError(f"{self._who()}: {self._failure}")
            now = time.monotonic()
            if self._paused is not None:
                until = max(deadline, self._paused_at + self.options.landing_timeout_s)
                if now >= until:
                    self._landed = None  # the refit may still be writing: untrusted
                    raise TimeoutError(
                        f"{self._who()}: paused for version {self._paused} for "
                        f"{now - self._paused_at:.0f} s without a commit or abort; the "
                        "weights may be partly written"
                    )
            elif now >= deadline:
                if missing_ok:
                    return None
                raise TimeoutError(
                    f"{self._who()}: version {version} did not land within {wait:.0f} s: no "
                    "refit paused this rank (did every trainer rank call refit for it?)"
                )
            else:
                until = deadline
            self._cond.wait(until - now)

    def close(self) -> None:
        """Unregister and release the shared memory (the weights stay as they are)."""
        self.client.close()

    # ------------------------------------------------------------------ client hooks
    def _on_pause(self, version: int) -> None:
        """Ack a PAUSE only while the engine waits in `receive`: it reads no weights then."""
        with self._cond:
            if not self._cond.wait_for(
                lambda: self._receiving is not None, self.options.pause_wait_s
            ):
                raise TimeoutError(
                    f"PAUSE for version {version} refused: the engine did not call its weight "
                    f"update within {self.options.pause_wait_s:.0f} s, so it may be reading "
                    "the weights; they stay untouched"
                )
            self._paused, self._paused_at = version, time.monotonic()

    def _on_event(self, event: VersionEvent) -> None:
        with self._cond:
            if event.kind == "hello":
                self._hello = event.version
            elif event.kind == "commit":
                self._landed, self._paused = event.version, None
            elif event.kind in ("abort", "incomplete"):
                self._paused = None
                if event.kind == "incomplete":
                    self._landed = None
                waiting = self._receiving
                if waiting is not None and event.version >= waiting:
                    what = "aborted" if event.kind == "abort" else "failed after writing"
                    self._failure = f"refit of version {event.version} {what}: {event.reason}"
            self._cond.notify_all()

    def _who(self) -> str:
        c = self.client
        return f"model {c.model!r} pool {c.pool!r} rank {c.rank}"
