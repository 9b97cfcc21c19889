"""`refitd` as a vLLM weight-transfer backend, engine side (`--weight-transfer-config
'{"backend": "refitd"}'`); vLLM builds one per worker in `load_model`.

- `init_transfer_engine({"controller", "model", "pool", ...})` registers the worker's own
  parameters with refitd's controller, in place, through the vLLM engine layout of its TP
  rank (shared memory on CPU, CUDA IPC handles on GPU); a parameter no layout covers fails
  here, named with the model family.
- `start_weight_update()` opens a session; nothing lands yet (vLLM may still run forward
  passes between calls).
- `update_weights({"version": v})` waits, on the worker's thread, until refitd's controller
  has paused this rank (the PAUSE ack: the worker runs no forward pass while it waits),
  written version v in place and committed it; it returns once v landed in this rank.
- `finish_weight_update()` closes the session; the worker now serves `served_version`, the
  refitd version, which `LLM.finish_weight_update(weight_version=str(v))` publishes at
  `/weight_info`.

Out-of-order calls raise RuntimeError with vLLM's own messages. docs/engines/vllm.md has the
launch flags, calls and timeouts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from clients.engine_layouts import EngineParallel
from clients.engine_receiver import ReceiverOptions, RefitdReceiver, covering_layout

if TYPE_CHECKING:
    from vllm.config import VllmConfig

NOT_INITIALIZED = "refitd weight transfer not initialized. Call init_transfer_engine() first."
UPDATE_BEFORE_START = "start_weight_update must be called before update_weights."
FINISH_WITHOUT_START = "finish_weight_update called without a matching start_weight_update."
START_WHILE_ACTIVE = (
    "start_weight_update called while a weight update is already active. "
    "Call finish_weight_update first."
)


@dataclass
class RefitdInitInfo(WeightTransferInitInfo):
    """What every worker needs to join refitd (JSON-serializable: the HTTP route takes it).

    pool: the inference pool's name (a DP replica i of several registers as `{pool}-dp{i}`);
    source_naming: how the trainer names its tensors ("hf", "megatron", "hf-checkpoint");
    device: the refitd slot of this worker (default: its CUDA device, or cpu:{rank});
    ep_size: expert parallel size (default: TP with enable_expert_parallel, else 1); the
    rest are ReceiverOptions (clients.engine_receiver).
    """

    controller: str
    model: str
    pool: str = "infer"
    source_naming: str = "hf"
    device: str | None = None
    ep_size: int | None = None
    pause_wait_s: float = 20.0
    update_timeout_s: float = 300.0
    landing_timeout_s: float = 600.0
    subscribe_timeout_s: float = 30.0
    catchup_wait_s: float = 5.0
    staged: bool = False

    def receiver_options(self) -> ReceiverOptions:
        names = {f.name for f in dataclasses.fields(ReceiverOptions)}
        return ReceiverOptions(**{n: getattr(self, n) for n in names})


@dataclass
class RefitdUpdateInfo(WeightTransferUpdateInfo):
    """One update: the refitd version to land (every trainer rank refits it), and how long
    to wait for its refit to pause this rank (default: the init info's update_timeout_s)."""

    version: int
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.version, bool) or not isinstance(self.version, int):
            raise ValueError(f"`version` must be an integer refitd version, got {self.version!r}")
        if self.version < 1:
            raise ValueError(f"`version` must be at least 1, got {self.version}")


class RefitdWeightTransferEngine(WeightTransferEngine[RefitdInitInfo, RefitdUpdateInfo]):
    """vLLM worker side of refitd: weights written in place by refitd's node agent while
    the worker waits in `update_weights` (see the module docstring)."""

    init_info_cls = RefitdInitInfo
    update_info_cls = RefitdUpdateInfo
    supports_draft_weight_update = False  # the layout describes the target model only

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: VllmConfig,
        device: torch.device,
        model: torch.nn.Module,
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self._receiver: RefitdReceiver | None = None
        self._active = False

    @property
    def served_version(self) -> int | None:
        """The refitd version this worker's weights hold (None before the first)."""
        return self._receiver.served_version if self._receiver else None

    def init_transfer_engine(self, init_info: RefitdInitInfo) -> None:
        if self._receiver is not None:
            raise RuntimeError(
                "refitd weight transfer is already initialized; call "
                "shutdown_weight_transfer_engine() before initializing again"
            )
        pc = self.parallel_config
        if pc.pipeline_parallel_size > 1:
            raise ValueError(
                "refitd's vLLM backend lays out tensor-parallel ranks only; pipeline parallel "
                f"size is {pc.pipeline_parallel_size}"
            )
        tp, rank = pc.tensor_parallel_size, pc.rank
        ep = init_info.ep_size or (tp if getattr(pc, "enable_expert_parallel", False) else 1)
        params = dict(self.model.named_parameters())
        layout = covering_layout(
            self.model_config.hf_config,
            params,
            EngineParallel(tp, rank, ep),
            "vllm",
            init_info.source_naming,
        )
        pool = init_info.pool
        if pc.data_parallel_size > 1:
            pool = f"{pool}-dp{pc.data_parallel_index}"
        receiver = RefitdReceiver(
            init_info.controller,
            init_info.model,
            pool,
            rank,
            tp,
            init_info.device or self._slot(rank),
            init_info.receiver_options(),
        )
        try:
            receiver.register(params, layout)
        except BaseException:
            receiver.close()
            raise
        self._receiver = receiver

    def start_weight_update(self) -> None:
        self._require_receiver()
        if self._active:
            raise RuntimeError(START_WHILE_ACTIVE)
        self._active = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu" and torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: RefitdUpdateInfo) -> None:
        receiver = self._require_receiver()
        if not self._active:
            raise RuntimeError(UPDATE_BEFORE_START)
        try:
            receiver.receive(update_info.version, update_info.timeout_s)
        except BaseException:
            self._active = False  # as vLLM's worker does: a failed update ends the session
            raise

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Close the session. `weight_version`, when given, must name the refitd version
        this worker serves (vLLM's worker passes none; its LLM sets /weight_info)."""
        receiver = self._require_receiver()
        if not self._active:
            raise RuntimeError(FINISH_WITHOUT_START)
        self._active = False
        served = receiver.served_version
        if weight_version is not None and weight_version != str(served):
            raise ValueError(
                f"finish_weight_update names weight version {weight_version!r}, but this "
                f"worker serves refitd version {served}"
            )

    def shutdown(self) -> None:
        receiver, self._receiver = self._receiver, None
        self._active = False
        if receiver is not None:
            receiver.close()

    def _require_receiver(self) -> RefitdReceiver:
        if self._receiver is None:
            raise RuntimeError(NOT_INITIALIZED)
        return self._receiver

    def _slot(self, rank: int) -> str:
        if self.device.type == "cuda":
            index = self.device.index if self.device.index is not None else 0
            return f"cuda:{index}"
        return f"cpu:{rank}"
