"""The engine side shared by the vLLM backend and the SGLang loader: a rank's parameters
registered in place through its engine layout (every parameter covered), and the gate that
lets a refit land only while the engine waits in its own weight-update call.

    layout = covering_layout(hf_config, params, EngineParallel(tp, rank), "vllm", "hf")
    receiver = RefitdReceiver(controller, "policy", "infer", rank, tp, "cuda:0")
    receiver.register(params, layout)
    receiver.receive(version)   # inside the engine's update call: returns once it landed
"""

from clients.engine_receiver.layout import covering_layout
from clients.engine_receiver.receiver import ReceiverOptions, RefitdReceiver

__all__ = ["ReceiverOptions", "RefitdReceiver", "covering_layout"]
