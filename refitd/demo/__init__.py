"""The demo model: a small GPT-style model in Megatron naming with reproducible weights."""
