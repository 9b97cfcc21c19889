"""Framework adapters and examples built on refitd.client (never imported by refitd itself).

- clients.megatron_adapter: Megatron-Core modules (TP/PP/EP attributes) to registrations.
- clients.dtensor_adapter: modules with DTensor parameters (FSDP2, TP plans).
- clients.hf_names: Megatron -> Hugging Face name maps (Llama/Qwen2, DeepSeek-V3/Kimi-K2).
- clients.engine_layouts: what vLLM / SGLang TP ranks hold, as boxes of the trainer's tensors.
- clients.engine_receiver: the engine side of an engine-driven refit (lands only in update).
- clients.vllm_backend: refitd as vLLM's `refitd` weight-transfer backend (both sides).
- clients.sglang_loader: refitd as SGLang's custom weight loader.
- clients.engine_example: a toy serving engine, and a worker extension for older engines.
- clients.ray_example: trainer and inference workers as Ray actors.
"""
