"""mini-DeepInfer's engine: LLM, LLMEngine, Scheduler, block and slot managers, model runner, tracer protocol."""
from engine.llm import LLM, RequestOutput
from engine.sequence import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
