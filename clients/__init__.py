"""Framework adapters and examples built on refitd.client (never imported by refitd itself).

- clients.megatron_adapter: Megatron-Core modules (TP/PP/EP attributes) to registrations.
- clients.dtensor_adapter: modules with DTensor parameters (FSDP2, TP plans).
- clients.hf_names: Megatron -> Hugging Face name maps (Llama/Qwen2, DeepSeek-V3/Kimi-K2).
- clients.engine_example: a vLLM/SGLang-style worker extension with pause/resume.
- clients.ray_example: trainer and inference workers as Ray actors.
"""
