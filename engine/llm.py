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

from engine.llm_engine import LLMEngine
from engine.scheduler import SchedulerConfig
from engine.sequence import SamplingParams
from engine.tokenizer import load_tokenizer
from model.config import BLOCK_SIZE, cdiv
from model.load import load_model
from model.parallel import Shard, gather_objects, setup


@dataclass(slots=True)
class RequestOutput:
    seq_id: int                 # the request's id: its Sequence's seq_id (add_request returns it)
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str


class LLM:
    def __init__(self, model: str = "tiny-68m", device: str = "cpu", enable_zos: bool = True,
                 max_num_batched_tokens: int = 2048, max_num_seqs: int = 64, num_kv_blocks: int | None = None,
                 num_state_slots: int | None = None, tracer=None, seed: int = 0, cpu_threads: int | None = 1,
                 shard: Shard | None = None, batch_invariant: bool = False):
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device cuda needs a CUDA GPU and none is visible; use the cpu device.")
        if batch_invariant and device == "cpu" and cpu_threads != 1:  # model/invariant.py: one intra-op thread
            raise ValueError("batch_invariant=True on device='cpu' needs cpu_threads=1: the mode's CPU bits "
                             "are proven with one intra-op thread (model/invariant.py).")
        self.shard = shard or setup(device)  # from a torchrun-style environment; one process without one
        weights, self.digest = load_model(model, device, self.shard)
        blocks_per_seq = cdiv(weights.args.max_seq_len, BLOCK_SIZE)
        config = SchedulerConfig(max_num_seqs, max_num_batched_tokens,
                                 num_kv_blocks or max_num_seqs * blocks_per_seq, num_state_slots or max_num_seqs)
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
