"""`refitd` as a vLLM weight-transfer backend, trainer side: a trainer written against
vLLM's trainer API switches to refitd by its init info.

    from clients.vllm_backend import RefitdTrainerInitInfo
    engine = WeightTransferTrainerFactory.trainer_init(
        RefitdTrainerInitInfo("10.0.0.1:50151", "policy", rank=rank, pool_size=world),
        client=client,                      # vLLM's HTTP / Ray client, or any of the protocol
        source=ModuleSource(model),         # plain, FSDP2 or DTensor module
    )
    engine.send_weights()                   # every rank, after each optimizer step

`trainer_init` (every rank) registers this rank's pieces of the source with refitd's
controller (as `ParamMeta` placements describe them: nothing is gathered); the sender (rank
0) first initializes the workers' `refitd` engines with the controller, model and
inference pool. `send_weights` is one refit: the sender starts the workers' update and runs
their `update_weights({"version": v})` beside the refit every rank asks for, then finishes
it with `weight_version=str(v)`; the engines return from the update once v landed.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from clients.vllm_backend.plugin import register
from clients.vllm_backend.sources import SourceBuffers
from refitd.client import RefitResult, TrainerClient

log = logging.getLogger(__name__)

# beyond the refit's own timeout: how long the sender waits for the workers' update calls
UPDATE_MARGIN_S = 60.0


@dataclass
class RefitdTrainerInitInfo(TrainerInitInfo):
    """Trainer side of the `refitd` backend (`rank` is this trainer process's rank).

    pool / pool_size: the trainer pool (pool_size: every rank that calls send_weights;
    default the default process group's size, else 1); device: this rank's refitd slot
    (default cuda:{current device} for CUDA tensors, else cpu:{rank}); inference_pool and
    source_naming go to the workers' init info with `engine_options` (RefitdInitInfo's
    timeouts); wait / refit_timeout_s: TrainerClient.refit's.
    """

    backend: ClassVar[str] = "refitd"

    controller: str
    model: str
    pool: str = "trainer"
    pool_size: int | None = None
    device: str | None = None
    inference_pool: str = "infer"
    source_naming: str = "hf"
    wait: str = "committed"
    refit_timeout_s: float = 600.0
    engine_options: dict[str, Any] = field(default_factory=dict)

    def worker_init_info(self) -> dict[str, Any]:
        """What the sender passes to the workers' init_weight_transfer_engine."""
        return {
            "controller": self.controller,
            "model": self.model,
            "pool": self.inference_pool,
            "source_naming": self.source_naming,
            **self.engine_options,
        }


class RefitdTrainerWeightTransferEngine(TrainerWeightTransferEngine[RefitdTrainerInitInfo]):
    """One trainer rank: its registered pieces of the source and its refitd client."""

    init_info_cls = RefitdTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource,
        info: RefitdTrainerInitInfo,
        trainer: TrainerClient,
        buffers: SourceBuffers,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=info.is_sender, rank=info.rank)
        self.info = info
        self.trainer = trainer
        self.buffers = buffers
        self.version = trainer.registration.current_version

    @classmethod
    def trainer_init(
        cls,
        init_info: RefitdTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        if source is None:
            raise ValueError("refitd trainer weight transfer requires a WeightSource.")
        buffers = SourceBuffers.of(source, init_info.rank)
        if init_info.is_sender:
            client.init_weight_transfer_engine(init_info.worker_init_info())
        trainer = TrainerClient(
            init_info.controller,
            init_info.model,
            init_info.pool,
            rank=init_info.rank,
            pool_size=init_info.pool_size or _world_size(),
            device=init_info.device or _slot(buffers, init_info.rank),
        )
        try:
            trainer.register(buffers.placed)
        except BaseException:
            trainer.close()
            raise
        return cls(client=client, source=source, info=init_info, trainer=trainer, buffers=buffers)

    def send_weights(self, version: int | None = None) -> RefitResult:
        """Refit `version` (default: one past the last sent) on every rank; the sender drives
        the workers' start / update / finish around it. Returns the refit's result."""
        v = self.version + 1 if version is None else version
        self.buffers.refresh()
        update: Future[None] | None = None
        if self.is_sender:
            self.client.start_weight_update()
            update = _in_thread(self.client.update_weights, {"version": v})
        try:
            result = self.trainer.refit(v, wait=self.info.wait, timeout=self.info.refit_timeout_s)
        except BaseException:
            if update is not None:  # the workers' update ends with the refit's ABORT
                _settle(update, UPDATE_MARGIN_S)
            raise
        if update is not None:
            update.result(timeout=self.info.refit_timeout_s + UPDATE_MARGIN_S)
            self.client.finish_weight_update(weight_version=str(v))
        self.version = v
        return result

    def shutdown(self) -> None:
        self.trainer.close()


def _in_thread(fn: Any, *args: Any) -> Future[None]:
    """Run fn(*args) on a daemon thread (it blocks until the refit lands in the workers)."""
    fut: Future[None] = Future()

    def run() -> None:
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:
            fut.set_exception(exc)

    threading.Thread(target=run, name="refitd-update-weights", daemon=True).start()
    return fut


def _settle(fut: Future[None], timeout_s: float) -> None:
    """Wait (bounded) for a worker call whose refit failed; log how it ended."""
    try:
        fut.result(timeout=timeout_s)
    except Exception as exc:
        log.warning("workers' update_weights after the failed refit: %s", exc)


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _slot(buffers: SourceBuffers, rank: int) -> str:
    for placed in buffers.placed.values():
        if placed.tensor.is_cuda:
            return f"cuda:{placed.tensor.device.index or 0}"
    return f"cpu:{rank}"


register()  # so trainer_init finds `refitd` without vLLM's plugin loader (idempotent)
