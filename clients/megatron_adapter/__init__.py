"""Megatron-Core adapter: register a Megatron rank's module (TP/PP/EP/ETP) with refitd.

state = ParallelState(tp_rank=..., tp_size=..., pp_rank=..., pp_size=..., ep_rank=...)
trainer = TrainerClient(controller, "gpt", rank=global_rank, pool_size=world)
register_megatron(trainer, model, state)     # then trainer.refit(step) after each step
"""

from clients.megatron_adapter.adapter import (
    ParallelState,
    canonical_megatron_name,
    megatron_tensors,
    register_megatron,
)

__all__ = ["ParallelState", "canonical_megatron_name", "megatron_tensors", "register_megatron"]
