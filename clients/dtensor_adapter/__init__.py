"""DTensor / FSDP2 adapter: register a module whose parameters are DTensors.

model = fully_shard(model, mesh=mesh)        # or parallelize_module(...), distribute_tensor
trainer = TrainerClient(controller, "gpt", rank=dist.get_rank(), pool_size=world)
register_dtensor_module(trainer, model)      # then trainer.refit(step) after each step

An FSDP2 module may be registered at any point between steps (after fully_shard, an eval
forward or a training step): its FSDP2 modules are resharded first and their sharded
DTensors registered.
"""

from clients.dtensor_adapter.adapter import (
    canonical_dtensor_name,
    dtensor_tensors,
    register_dtensor_module,
)

__all__ = ["canonical_dtensor_name", "dtensor_tensors", "register_dtensor_module"]
