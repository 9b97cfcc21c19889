"""The `vllm.general_plugins` entry point of the refitd package: registers `refitd` with
vLLM's weight-transfer factories (worker and trainer side) in every process vLLM starts.

vLLM may run a plugin several times (each process, and again where the trainer registers),
while its factories refuse a second registration of a name: a second call here finds
refitd's own classes registered and does nothing; another class under the name is an error.
"""

from __future__ import annotations

from typing import Any

BACKEND = "refitd"
ENGINE = ("clients.vllm_backend.engine", "RefitdWeightTransferEngine")
TRAINER = ("clients.vllm_backend.trainer", "RefitdTrainerWeightTransferEngine")


def register() -> None:
    """Register `refitd` with vLLM's WeightTransferEngineFactory and
    WeightTransferTrainerFactory (lazily: nothing is imported until a backend is built)."""
    from vllm.distributed.weight_transfer import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    _register_once(WeightTransferEngineFactory, *ENGINE)
    _register_once(WeightTransferTrainerFactory, *TRAINER)


def _register_once(factory: Any, module: str, class_name: str) -> None:
    try:
        factory.register_engine(BACKEND, module, class_name)
    except ValueError:
        # Already registered: accept refitd's own class only (the registry maps a name to
        # a loader of the class; vLLM exposes no other way to look it up).
        cls = factory._registry[BACKEND]()
        if (cls.__module__, cls.__name__) != (module, class_name):
            raise ValueError(
                f"weight transfer backend {BACKEND!r} is registered with "
                f"{cls.__module__}.{cls.__name__}, not refitd's {module}.{class_name}"
            ) from None
