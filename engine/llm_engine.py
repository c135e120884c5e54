"""The engine loop (DeepInfer's, as nano-vllm's engine/llm_engine.py): one step at a time (ARCHITECTURE.md §3).

With ZOS on, step N is
scheduled and enqueued before step N-1's result is read:

    schedule(N)  ->  execute(N)  ->  process(N-1)      (the device runs N-1 while the CPU schedules N)

With ZOS off the same step is schedule(N), execute(N), process(N). Cancellations requested between
steps are applied at the start of the next step, before it is scheduled.

Under EP x DP (ARCHITECTURE.md §8, model/parallel.py) each rank runs its own engine on its own requests
(ids rank, rank + world_size, ...), and the ranks step in lockstep: `has_unfinished()` is true on every rank
while any rank has work, and a rank with nothing scheduled runs the forward's collectives with zero rows.
"""
from __future__ import annotations

import dataclasses
import gc
import time

import numpy
import torch

from engine.model_runner import ModelRunner, StepHandle, device_name
from engine.platform import platform_of
from engine import scheduler as scheduler_rules
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import SamplingParams, Sequence
from engine.tracer import NullTracer
from kernels.sampling import mix_seed
from model.config import BLOCK_SIZE, cdiv
from model.parallel import any_rank, run_id
from model.transformer import Transformer


def freeze_heap() -> None:
    """Collect, then move every object alive (the model, torch's and the libraries' own) out of the cyclic
    garbage collector's scans, as vLLM does after start-up. A step allocates thousands of small objects, and
    every full collection scanned the whole heap: at batch 256 those pauses were a third of the host's mean
    step (benchmarks/bench_host_step.py). Objects made later, requests and steps, are collected as before."""
    gc.collect()
    gc.freeze()


class LLMEngine:
    def __init__(self, weights: Transformer, config: SchedulerConfig, enable_zos: bool = True, seed: int = 0,
                 tracer=None, cpu_threads: int | None = None, checkpoint_digest: str = "", model_source: str = "",
                 batch_invariant: bool = False):
        self.tracer = tracer or NullTracer()
        self.config, self.enable_zos, self.seed = config, enable_zos, seed
        self.batch_invariant = batch_invariant  # model/invariant.py (issue #11)
        # the longest request: the engine's max_model_len, the positions the model was built to cover
        self.max_model_len, self.vocab_size = weights.args.max_seq_len, weights.args.vocab_size
        self.scheduler = Scheduler(config, self.tracer)
        self.runner = ModelRunner(weights, config.num_kv_blocks, config.num_state_slots, cpu_threads, batch_invariant)
        self.shard = weights.shard  # this rank's place under EP x DP; one process by default
        if self.shard.world_size > 1:
            self.runner.use_cuda_graphs = False  # the sharded layers read every rank's row count on the host
        self.in_flight: StepHandle | None = None  # under ZOS: the step whose result is not processed yet
        self.pending_aborts: list[tuple[int, str]] = []  # (seq_id, cause), applied at the next step
        self.next_id = self.shard.rank  # request ids rank, rank + world_size, ...: unique across ranks
        self.tracer.start({**self._header(weights, checkpoint_digest), "model_source": model_source})
        freeze_heap()

    def _header(self, weights: Transformer, checkpoint_digest: str) -> dict:
        """What a trace needs to rebuild this engine: configs, weights digest, device and versions."""
        device = self.runner.device
        try:
            import triton
            triton_version = triton.__version__
        except ImportError:
            triton_version = None
        return {"engine": {**dataclasses.asdict(self.config), "enable_zos": self.enable_zos, "block_size": BLOCK_SIZE,
                           "batch_invariant": self.batch_invariant,
                           "scheduler_version": scheduler_rules.SCHEDULER_VERSION},
                "model": weights.args.to_dict(), "checkpoint_digest": checkpoint_digest,
                "device": device_name(device),
                "torch": torch.__version__, "triton": triton_version,
                "dtype": str(weights.embed.weight.dtype).removeprefix("torch."), "seed": self.seed,
                "intra_op_threads": torch.get_num_threads(),  # CPU kernels' bits depend on it
                "platform": platform_of(device),  # everything else that decides the bits (engine/platform.py)
                "rank": self.shard.rank, "world_size": self.shard.world_size, "run_id": run_id(self.shard)}

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    arrival_ns: int | None = None) -> int:
        """Queue a request; its id. `arrival_ns` (time.perf_counter_ns) is when it reached the front door (an
        HTTP request, a replayed arrival), if earlier than now."""
        arrival_ns = time.perf_counter_ns() if arrival_ns is None else arrival_ns
        params = self.check_request(prompt_token_ids, params)
        seq_id, self.next_id = self.next_id, self.next_id + self.shard.world_size
        seed = params.seed if params.seed is not None else mix_seed(self.seed, seq_id)
        self.scheduler.add(Sequence(seq_id, prompt_token_ids, params, seed))
        self.tracer.request_added(seq_id, list(prompt_token_ids), params, seed, arrival_ns)
        return seq_id

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None) -> SamplingParams:
        """The request's checked params; ValueError in one sentence when it cannot run. Ranks check every
        request of a run, not only their own, so that all of them refuse it together."""
        params = (params or SamplingParams()).check()
        total = len(prompt_token_ids) + params.max_tokens
        if not prompt_token_ids:
            raise ValueError("a request needs at least one prompt token.")
        vocab = self.vocab_size
        bad = next((t for t in prompt_token_ids if isinstance(t, bool) or not isinstance(t, (int, numpy.integer))
                    or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is not in the model's vocabulary (ids 0 to {vocab - 1}).")
        if total > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt_token_ids)}) plus max_tokens ({params.max_tokens}) exceeds "
                             f"max_model_len {self.max_model_len}; raise max_model_len.")
        if cdiv(total, BLOCK_SIZE) > self.config.num_kv_blocks:
            raise ValueError(f"a request of {total} tokens needs {cdiv(total, BLOCK_SIZE)} KV blocks, more than the "
                             f"{self.config.num_kv_blocks} in the pool; raise num_kv_blocks.")
        return params

    def abort(self, seq_id: int, cause: str = "abort") -> None:
        """Cancel a request; it finishes with reason "abort" at the start of the next step. `cause` says why
        (tracing/schema.py CANCEL_CAUSES): "abort" (the caller's), "disconnect" (its client went away) or
        "shutdown" (the engine stops)."""
        self.pending_aborts.append((seq_id, cause))

    def has_unfinished(self) -> bool:
        """Work left here, or under EP x DP on any rank (every rank keeps stepping until all are done)."""
        return any_rank(self.scheduler.has_unfinished() or self.in_flight is not None, self.shard)

    def step(self) -> list[Sequence]:
        """One step of the contract. Returns the sequences that finished in it (aborted ones included)."""
        finished = [s for s in (self.scheduler.abort(*a) for a in self.pending_aborts) if s is not None]
        self.pending_aborts = []
        t0 = time.perf_counter_ns()
        batch = self.scheduler.schedule()
        t1 = time.perf_counter_ns()
        handle = self.runner.execute(batch) if batch is not None and batch.rows else None
        if handle is None and self.shard.world_size > 1:
            self.runner.idle()  # EP x DP: this rank's share of the step's collectives, with zero rows
        t2 = time.perf_counter_ns()
        if batch is not None:
            self.tracer.cpu_span(batch.step, "schedule", t0, t1)
            self.tracer.cpu_span(batch.step, "execute", t1, t2)
        if self.enable_zos:
            done, self.in_flight = self.in_flight, handle
        else:
            done = handle
        if done is not None:
            finished += self.process(done)
        elif batch is None and self.scheduler.has_unfinished():
            raise RuntimeError("the scheduler can make no progress: no request fits the KV blocks and "
                               "state slots that are free.")
        self.tracer.step_end(batch.step if batch is not None else done.batch.step if done else -1)
        return finished

    def process(self, handle: StepHandle) -> list[Sequence]:
        result = handle.wait()
        t0 = time.perf_counter_ns()
        self.tracer.device_span(handle.batch.step, *result.device_span)
        finished = self.scheduler.process(handle.batch, result.tokens)
        if self.tracer.enabled:
            self.tracer.step_digest(handle.batch.step, self.scheduler.digest())
        self.tracer.cpu_span(handle.batch.step, "process", t0, time.perf_counter_ns())
        return finished

    def shutdown(self) -> None:
        """Finish the step in flight, stop the device worker and close the tracer (its footer)."""
        if self.in_flight is not None:
            self.process(self.in_flight)
            self.in_flight = None
        self.runner.shutdown()
        self.tracer.close()

    @property
    def max_seq_len(self) -> int:
        """The former name of max_model_len (the model's max_seq_len as built), for callers that read it."""
        return self.max_model_len
