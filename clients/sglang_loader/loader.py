"""refitd as SGLang's custom weight loader: `--custom-weight-loader
clients.sglang_loader.load_refitd_version`, then `update_weights_from_tensor(named_tensors,
load_format="clients.sglang_loader.load_refitd_version")`.

SGLang calls the loader as `loader(model, named_tensors)` on every TP rank's scheduler
thread (no forward pass runs meanwhile). The named tensors are requests, not weights:
- `init_request(controller, model, pool, ...)`: `("refitd.init", uint8 JSON)` registers the
  rank's own parameters with refitd in place, through the SGLang engine layout of its TP
  rank (from SGLang's parallel context, or `tp_rank` / `tp_size` in the request);
- `version_request(v)`: `("refitd.version", int64 [v])` returns once refitd version v
  (which every trainer rank refits) landed in this rank's parameters.
The request's `weight_version=str(v)` (or `update_weight_version`) then reports it.
`register_model_runner` does the registration for code holding SGLang's ModelRunner.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from clients.engine_layouts import EngineParallel
from clients.engine_receiver import ReceiverOptions, RefitdReceiver, covering_layout

LOADER = "clients.sglang_loader.load_refitd_version"
INIT = "refitd.init"
VERSION = "refitd.version"
_ATTR = "_refitd_receiver"  # where the rank's receiver lives: on the model it writes


@dataclass(frozen=True)
class SglangInit:
    """What each TP rank needs to join refitd (see RefitdInitInfo in clients.vllm_backend:
    the same fields). tp_rank / tp_size / ep_size: default SGLang's parallel context."""

    controller: str
    model: str
    pool: str = "infer"
    source_naming: str = "hf"
    device: str | None = None
    tp_rank: int | None = None
    tp_size: int | None = None
    ep_size: int | None = None
    pause_wait_s: float = 20.0
    update_timeout_s: float = 300.0
    landing_timeout_s: float = 600.0
    subscribe_timeout_s: float = 30.0
    catchup_wait_s: float = 5.0
    staged: bool = False

    def receiver_options(self) -> ReceiverOptions:
        names = {f.name for f in fields(ReceiverOptions)}
        return ReceiverOptions(**{n: getattr(self, n) for n in names})


def init_request(controller: str, model: str, **options: Any) -> list[tuple[str, torch.Tensor]]:
    """The named tensors that register every TP rank with refitd (SglangInit's fields)."""
    payload = json.dumps(asdict(SglangInit(controller, model, **options))).encode()
    return [(INIT, torch.frombuffer(bytearray(payload), dtype=torch.uint8))]


def version_request(version: int) -> list[tuple[str, torch.Tensor]]:
    """The named tensors that land refitd version `version` in every TP rank."""
    return [(VERSION, torch.tensor([int(version)], dtype=torch.int64))]


def load_refitd_version(model: torch.nn.Module, named_tensors: Sequence[tuple[str, Any]]) -> None:
    """SGLang's custom weight loader: apply the refitd requests in `named_tensors`."""
    for name, tensor in named_tensors:
        if name == INIT:
            raw = bytes(tensor.detach().cpu().to(torch.uint8).numpy().tobytes())
            try:
                init = SglangInit(**json.loads(raw))
            except (ValueError, TypeError) as exc:
                raise ValueError(f"refitd loader: bad {INIT} request: {exc}") from exc
            _attach(model, init, _tp_coords(init))
        elif name == VERSION:
            receiver = getattr(model, _ATTR, None)
            if receiver is None:
                raise RuntimeError(
                    f"refitd loader: {VERSION} before {INIT}: register the ranks first "
                    "(update_weights_from_tensor(init_request(...), load_format=...))"
                )
            receiver.receive(int(tensor.reshape(-1)[0]))
        else:
            raise ValueError(
                f"refitd loader: unknown entry {name!r} (expected {INIT!r} or {VERSION!r}); "
                "weights reach the model through refitd, not through this request"
            )


def register_model_runner(model_runner: Any, init: SglangInit) -> RefitdReceiver:
    """Register an SGLang ModelRunner's parameters (its tp_rank, tp_size, model) with
    refitd; later `version_request`s through the loader land versions into them."""
    tp = init.tp_size or model_runner.tp_size
    rank = init.tp_rank if init.tp_rank is not None else model_runner.tp_rank
    ep = init.ep_size or getattr(model_runner, "moe_ep_size", 1) or 1
    return _attach(model_runner.model, init, (rank, tp, ep))


def served_version(model: torch.nn.Module) -> int | None:
    """The refitd version the model's registered weights hold (None: none, or torn)."""
    receiver = getattr(model, _ATTR, None)
    return receiver.served_version if receiver is not None else None


def detach(model: torch.nn.Module) -> None:
    """Unregister the model's rank from refitd (its weights stay as they are)."""
    receiver = getattr(model, _ATTR, None)
    if receiver is not None:
        object.__delattr__(model, _ATTR)
        receiver.close()


def _attach(
    model: torch.nn.Module, init: SglangInit, coords: tuple[int, int, int]
) -> RefitdReceiver:
    """Register the model's parameters (once per model; a repeated init is a no-op)."""
    existing = getattr(model, _ATTR, None)
    if existing is not None:
        return existing
    rank, tp, ep = coords
    params = dict(model.named_parameters())
    hf_config = getattr(model, "config", None)
    if hf_config is None:
        raise ValueError(f"refitd loader: {type(model).__name__} has no `config` (its HF config)")
    layout = covering_layout(
        hf_config, params, EngineParallel(tp, rank, ep), "sglang", init.source_naming
    )
    receiver = RefitdReceiver(
        init.controller, init.model, init.pool, rank, tp,
        init.device or _slot(params, rank), init.receiver_options(),
    )  # fmt: skip
    try:
        receiver.register(params, layout)
    except BaseException:
        receiver.close()
        raise
    object.__setattr__(model, _ATTR, receiver)
    return receiver


def _tp_coords(init: SglangInit) -> tuple[int, int, int]:
    """(tp_rank, tp_size, ep_size): the request's, else SGLang's parallel context."""
    if init.tp_rank is not None and init.tp_size is not None:
        return init.tp_rank, init.tp_size, init.ep_size or 1
    from sglang.srt.runtime_context import get_parallel  # only inside an SGLang process

    par = get_parallel()
    return par.tp_rank, par.tp_size, init.ep_size or getattr(par, "moe_ep_size", 1) or 1


def _slot(params: dict[str, torch.Tensor], rank: int) -> str:
    first = next(iter(params.values()), None)
    if first is not None and first.is_cuda:
        return f"cuda:{first.device.index or 0}"
    return f"cpu:{rank}"
