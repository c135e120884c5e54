"""mini-DeepInfer's engine: LLM, LLMEngine, Scheduler, block and slot managers, model runner, tracer protocol.

`LLM` and `RequestOutput` load lazily (PEP 562), so `import engine.scheduler` (scheduler replay, verify)
does not import torch or the model.
"""
from engine.sequence import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name):
    if name in ("LLM", "RequestOutput"):
        from engine import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
