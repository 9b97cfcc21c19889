"""refitd as a vLLM weight-transfer backend (vLLM 0.33's `vllm.distributed.weight_transfer`).

Inference: `vllm serve ... --weight-transfer-config '{"backend": "refitd"}'` (the refitd
package's `vllm.general_plugins` entry point registers the backend in every worker), then
`init_weight_transfer_engine({"controller": ..., "model": ..., "pool": ...})`. Trainer:
`WeightTransferTrainerFactory.trainer_init(RefitdTrainerInitInfo(...), client=, source=)`
and `send_weights()` after each step. docs/engines/vllm.md has the whole sequence.

Importing this package imports no vLLM module; its modules do.
"""

from clients.vllm_backend.plugin import BACKEND, register

__all__ = ["BACKEND", "register"]
