"""Trainer side: every trainer rank registers its shards once and calls refit(version)
after each optimizer step.

refit() returns as soon as this rank's weights have been read (wait="sources_read", the
default), so the trainer can run its next step while the bytes land; wait="committed"
returns once the version landed in full and is in the version log; wait="served" once, in
addition, every inference rank acked its COMMIT (it serves the version). docs/client.md
defines each precisely.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from refitd._proto import refitd_pb2 as pb
from refitd.client.worker import WorkerClient
from refitd.refit_states import state_name
from refitd.rpc.asks import AskStream
from refitd.rpc.connection import RefitError

log = logging.getLogger(__name__)

WAITS = {
    "sources_read": pb.WAIT_SOURCES_READ,
    "committed": pb.WAIT_COMMITTED,
    "accepted": pb.WAIT_ACCEPTED,
    "served": pb.WAIT_SERVED,
}
# Extra deadline on top of the refit's own timeout, so the controller's answer wins the race.
DEADLINE_MARGIN_S = 10.0


@dataclass(frozen=True, slots=True)
class RefitResult:
    """The controller's answer: state is a refit state's name (refitd.refit_states:
    "committed", "superseded"...).

    served: with wait="served", every inference rank acked the version's COMMIT (it serves
    it); when False on a committed version, message names the ranks that did not.
    """

    version: int
    state: str
    message: str
    seconds: float
    bytes: int
    served: bool = False

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class TrainerClient(WorkerClient):
    """A trainer rank: `register(module_or_tensors)`, then `refit(version)` after each step.

    on_move decides what refit() does when a registered tensor's storage moved since
    registration: "reregister" (default) registers the moved tensors again first; "error"
    raises RefitError naming them.

    snapshot=True (the same on every rank of the pool): each slot copies the bytes it reads
    into a snapshot first and releases the trainer then, so refit(wait="sources_read")
    returns after a local copy and the trainer may write its weights while they are sent.
    The snapshot is capped per slot (setting snapshot_bytes); a slot above the cap reads
    live memory as without snapshot, and the refit's record (/v1/status) says why.
    """

    ROLE = pb.ROLE_SOURCE

    def __init__(
        self,
        controller: str,
        model: str,
        pool: str = "trainer",
        rank: int = 0,
        pool_size: int = 1,
        device: str = "cpu:0",
        host: str | None = None,
        on_move: str = "reregister",
        rpc_timeout_s: float = 30.0,
        connect_timeout_s: float = 30.0,
        snapshot: bool = False,
    ) -> None:
        if on_move not in ("reregister", "error"):
            raise ValueError(f"on_move must be 'reregister' or 'error', got {on_move!r}")
        super().__init__(
            controller,
            model,
            pool,
            rank,
            pool_size,
            device,
            host,
            rpc_timeout_s,
            connect_timeout_s,
        )
        self.on_move = on_move
        self.snapshot = snapshot
        self._asks = AskStream(self._conn)  # refit() asks on one stream kept open

    def refit(
        self, version: int, wait: str = "sources_read", timeout: float | None = None
    ) -> RefitResult:
        """Ask for `version` to be refitted; returns per `wait`. Raises RefitError on failure.

        A result with state "superseded" means a newer version was asked for meanwhile and
        this one was coalesced into it (docs/refit.md).
        """
        if wait not in WAITS:
            raise ValueError(f"wait must be one of {sorted(WAITS)}, got {wait!r}")
        self._check_storage()
        req = pb.RefitRequest(
            worker_id=self.worker_id, version=version, wait=WAITS[wait], timeout_s=timeout or 0.0
        )
        deadline = (timeout or 600.0) + DEADLINE_MARGIN_S
        try:
            resp = self._asks.ask(req, f"refit {self._who()} version {version}", deadline)
        except RefitError as err:
            if err.code == grpc.StatusCode.NOT_FOUND:
                # The controller restarted and forgot us: register again, ask again once.
                self.reregister()
                req.worker_id = self.worker_id
                resp = self._asks.ask(req, f"refit {self._who()} version {version}", deadline)
            else:
                raise
        result = RefitResult(
            version=resp.version or version,
            state=state_name(resp.state),
            message=resp.message,
            seconds=resp.seconds,
            bytes=resp.bytes,
            served=resp.served,
        )
        if result.state == "failed":
            raise RefitError(f"refit of version {version} failed: {resp.message}")
        return result

    def _stop_streams(self) -> None:
        self._asks.close()

    def _check_storage(self) -> None:
        moved = self.moved_tensors()
        if not moved:
            return
        if self.on_move == "error":
            raise RefitError(
                f"{self._who()}: storage of {moved} moved since registration; call "
                "refresh() or register() again before refit"
            )
        self.refresh()
