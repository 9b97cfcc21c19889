"""The worker library: what trainer and inference processes link to talk to refitd.

trainer = TrainerClient("127.0.0.1:50151", "gpt", rank=r, pool_size=4, device="cpu:0")
trainer.register(model)          # parameters + persistent buffers, in place in shared memory
trainer.refit(version)           # after each optimizer step

engine = InferenceClient("127.0.0.1:50151", "gpt", pool="infer", rank=r, pool_size=2,
                         pause=stop_reading, resume=serve)
engine.register(weights)
for event in engine.subscribe(): ...
"""

from refitd.client.inference import InferenceClient, VersionEvent
from refitd.client.tensors import MegatronCoords, Placed
from refitd.client.trainer import RefitResult, TrainerClient
from refitd.rpc.connection import RefitError

__all__ = [
    "InferenceClient",
    "MegatronCoords",
    "Placed",
    "RefitError",
    "RefitResult",
    "TrainerClient",
    "VersionEvent",
]
