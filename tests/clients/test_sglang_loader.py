"""refitd as SGLang's custom weight loader, against SGLang 0.5.23's own request class and
loader call: `UpdateWeightsFromTensorReqInput` carries the per-rank serialized refitd
requests (SGLang's MultiprocessingSerializer), each TP rank deserializes its own and calls
the loader SGLang's `dynamic_import` resolves from `load_format`, as `loader(model,
named_tensors)`. A version refitted by an HF-named trainer lands bit for bit in both
ranks' parameters (SGLang layout, Qwen3 with tied embeddings and a padded vocabulary)."""

from __future__ import annotations

import pytest
import torch
from _backend_workers import on_all, require_sglang
from _engine_models import EngineModel, loaded_buffers
from _hf_models import QWEN3, config, model

from clients.engine_layouts import EngineParallel, engine_layout_for, engine_module
from clients.sglang_loader import (
    LOADER,
    detach,
    init_request,
    load_refitd_version,
    served_version,
    version_request,
)
from refitd.client import TrainerClient
from refitd.demo.run import Daemon


def engine_ranks(tp: int = 2) -> tuple[EngineModel, list[torch.nn.Module]]:
    """Qwen3 held as SGLang TP ranks, each rank's tensors the parameters of a module whose
    `config` is the HF config (as SGLang's model classes keep it)."""
    cfg = config(QWEN3)
    lays = [
        engine_layout_for(cfg, EngineParallel(tp, r), "sglang", source_naming="hf")
        for r in range(tp)
    ]
    shapes = [{t.name: t.local_shape for t in lay.tensors} for lay in lays]
    eng = EngineModel(model(QWEN3, 0), tp, 1, "sglang", lambda r: shapes[r])
    modules = []
    for r in range(tp):
        module = engine_module(eng.ranks[r])
        module.config = cfg
        eng.ranks[r] = dict(module.named_parameters())
        modules.append(module)
    return eng, modules


def test_a_version_request_before_init_or_an_unknown_entry_is_refused() -> None:
    _, (module, _) = engine_ranks()
    with pytest.raises(RuntimeError, match=r"refitd\.version before refitd\.init"):
        load_refitd_version(module, version_request(1))
    with pytest.raises(ValueError, match=r"unknown entry 'model\.norm\.weight'"):
        load_refitd_version(module, [("model.norm.weight", torch.zeros(64))])


@pytest.mark.slow
def test_the_loader_applies_a_version_through_sglangs_request(daemon: Daemon) -> None:
    require_sglang()
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
    from sglang.srt.utils import MultiprocessingSerializer, dynamic_import

    eng, modules = engine_ranks()
    ref = model(QWEN3, 51)
    trainer = TrainerClient(daemon.address, "sglang-loader", rank=0, pool_size=1, device="cpu:0")

    def apply(per_rank: list[list[tuple[str, torch.Tensor]]], weight_version: str | None) -> None:
        req = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[MultiprocessingSerializer.serialize(n) for n in per_rank],
            load_format=LOADER,
            weight_version=weight_version,
        )
        loader = dynamic_import(req.load_format)
        on_all([
            lambda r=r: loader(modules[r], MultiprocessingSerializer.deserialize(req.serialized_named_tensors[r]))
            for r in range(len(modules))
        ])  # fmt: skip

    try:
        trainer.register(dict(ref.state_dict()))
        inits = [init_request(daemon.address, "sglang-loader", tp_rank=r, tp_size=2, device=f"cpu:{r + 1}")
                 for r in range(2)]  # fmt: skip
        apply(inits, None)
        update = on_all([lambda: apply([version_request(1)] * 2, "1"),
                         lambda: trainer.refit(1, wait="committed", timeout=120)])  # fmt: skip
        assert update[1].state == "committed"
        want = ref.state_dict()
        bad = [(r, n) for r in (0, 1) for n, t in loaded_buffers(eng, r, want).items()
               if not torch.equal(eng.ranks[r][n], t)]  # fmt: skip
        assert bad == []
        assert [served_version(m) for m in modules] == [1, 1]
    finally:
        trainer.close()
        for m in modules:
            detach(m)
