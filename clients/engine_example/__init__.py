"""Inference-engine integration example: a toy engine with pause/resume, and the worker
extension that links engine workers (vLLM `collective_rpc`, SGLang) to refitd."""

from clients.engine_example.engine import Answer, TinyEngine
from clients.engine_example.extension import RefitdWorker, RefitdWorkerExtension

__all__ = ["Answer", "RefitdWorker", "RefitdWorkerExtension", "TinyEngine"]
