"""The user's entry point (DeepInfer's, vLLM's and nano-vllm's API): `LLM(...).generate(prompts, sampling_params)`.

    from engine import LLM, SamplingParams
    llm = LLM("tiny-68m")                       # the embedded checkpoint, created on first use
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))

Under torchrun (or `mdi-trace record --nproc N`) the same script runs EP x DP (ARCHITECTURE.md §8): each rank
loads its shard, serves every world_size-th prompt, and `generate` returns every prompt's output on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from rich.console import Console
from rich.progress import Progress

from engine.kv_budget import DEFAULT_GPU_MEMORY_UTILIZATION, MAX_MODEL_LEN, memory_budget, size_pool
from engine.llm_engine import LLMEngine
from engine.scheduler import SchedulerConfig
from engine.sequence import SamplingParams
from engine.tokenizer import load_tokenizer
from model.load import load_model
from model.parallel import Shard, gather_objects, setup


@dataclass(slots=True)
class RequestOutput:
    seq_id: int                 # the request's id: its Sequence's seq_id (add_request returns it)
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str


def _whole(name: str, value, low: int = 1) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
        raise ValueError(f"{name} must be a whole number of at least {low}, not {value!r}.")


class LLM:
    """`max_model_len` (default: the checkpoint's max_seq_len, and may exceed it) is the longest request,
    prompt plus max_tokens; the model is built with max_seq_len = max_model_len (RoPE tables; no numeric
    effect, spec §8). `num_kv_blocks` defaults from a memory budget (engine/kv_budget.py): `kv_cache_memory`
    bytes, else on CUDA `gpu_memory_utilization` of the memory free after the weights load, on CPU
    min(4 GiB, half the available RAM); never more than max_num_seqs requests of max_model_len need.
    `self.kv_pool` says how the pool was sized (None for an explicit num_kv_blocks)."""

    def __init__(self, model: str = "tiny-68m", device: str = "cpu", enable_zos: bool = True,
                 max_num_batched_tokens: int = 2048, max_num_seqs: int = 64, num_kv_blocks: int | None = None,
                 num_state_slots: int | None = None, tracer=None, seed: int = 0, cpu_threads: int | None = 1,
                 shard: Shard | None = None, batch_invariant: bool = False, max_model_len: int | None = None,
                 gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION, kv_cache_memory: int | None = None):
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device cuda needs a CUDA GPU and none is visible; use the cpu device.")
        if batch_invariant and device == "cpu" and cpu_threads != 1:  # model/invariant.py: one intra-op thread
            raise ValueError("batch_invariant=True on device='cpu' needs cpu_threads=1: the mode's CPU bits "
                             "are proven with one intra-op thread (model/invariant.py).")
        for name, value in (("max_model_len", max_model_len), ("num_kv_blocks", num_kv_blocks),
                            ("num_state_slots", num_state_slots), ("kv_cache_memory", kv_cache_memory),
                            ("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            _whole(name, value)
        if num_kv_blocks is not None and kv_cache_memory is not None:
            raise ValueError("num_kv_blocks fixes the KV pool, so kv_cache_memory has no effect; drop one of the two.")
        if max_model_len is not None and max_model_len > MAX_MODEL_LEN:
            raise ValueError(f"max_model_len must be at most {MAX_MODEL_LEN:,} positions, not {max_model_len:,}.")
        if isinstance(gpu_memory_utilization, bool) or not isinstance(gpu_memory_utilization, (int, float)) \
                or not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be a fraction above 0 and at most 1, not "
                             f"{gpu_memory_utilization!r}.")
        self.shard = shard or setup(device)  # from a torchrun-style environment; one process without one
        weights, self.digest = load_model(model, device, self.shard, max_seq_len=max_model_len)
        self.max_model_len = weights.args.max_seq_len
        num_state_slots = num_state_slots or max_num_seqs
        self.kv_pool = None
        if num_kv_blocks is None:
            budget, source = memory_budget(weights.head.weight.device, gpu_memory_utilization, kv_cache_memory)
            self.kv_pool = size_pool(weights.args, weights.embed.weight.dtype, budget, source, num_state_slots,
                                     max_num_seqs, self.max_model_len)
            num_kv_blocks = self.kv_pool.num_kv_blocks
        config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, num_kv_blocks, num_state_slots)
        self.tokenizer = load_tokenizer(model)
        config.eos_token_id = self.tokenizer.eos_token_id
        # On CPU one intra-op thread decodes faster than two (benchmarks/RESULTS.md); torch's setting is
        # process-wide, so cpu_threads=None leaves it as it is.
        self.engine = LLMEngine(weights, config, enable_zos, seed, tracer, cpu_threads if device == "cpu" else None,
                                self.digest, model, batch_invariant)

    def generate(self, prompts: list[str] | list[list[int]], sampling_params=None,
                 progress: bool = True) -> list[RequestOutput]:
        """Run every prompt (text or token ids) to completion; one SamplingParams or one per prompt."""
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params.")
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        for t, p in zip(ids, params):  # every rank checks every request, so that they refuse it together
            self.engine.check_request(t, p)
        order = [self.engine.add_request(ids[i], params[i]) for i in self.shard.requests(len(prompts))]
        done = {}
        console = Console()  # no bar where stdout is not a terminal: a pipe gets the outputs alone
        with Progress(console=console, transient=True,
                      disable=not progress or self.shard.rank > 0 or not console.is_terminal) as bar:
            task = bar.add_task("generating", total=len(order))
            while self.engine.has_unfinished():
                for seq in self.engine.step():
                    done[seq.seq_id] = seq
                    bar.advance(task)
        outs = [RequestOutput(i, done[i].token_ids[:done[i].num_prompt_tokens], done[i].output_token_ids,
                              self.tokenizer.decode(done[i].output_token_ids), done[i].finish_reason)
                for i in order]
        if self.shard.world_size == 1:
            return outs
        by_rank = gather_objects(outs, self.shard)  # prompt i was served by rank i % world_size
        return [by_rank[i % self.shard.world_size][i // self.shard.world_size] for i in range(len(prompts))]
