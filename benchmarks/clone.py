"""Decode rows at a long context without prefilling each one (issue #20 item 2): one prompt is prefilled, then
its paged state is copied to more sequences, each with KV blocks and a state slot of its own.

A decode step of B rows at 128k positions needs B x 128k prompt tokens prefilled first: for the slice at batch
64 that is 8.4M tokens, over 15 minutes at its prefill rate, while the step it sets up takes milliseconds. A
clone reads what a prefilled row reads (its own blocks, its own slot: the same bytes, at the same addresses a
prefill would have given it), so a decode step over clones costs what one over prefilled rows costs, with two
differences that a benchmark states: every row's context is the source's, so their index lists are alike; and
their first decode inputs are the source's first token at the same position, so the rows start identical (the
same routed experts) and part only after their first samples, each by its own seed. The warm-up steps cover
that: time the steps after them.

Benchmarks only: the engine has no such request (a clone was never prefilled, so no trace could replay it).
"""
from __future__ import annotations

import contextlib
import time

import torch

from engine.llm_engine import LLMEngine
from engine.sequence import SamplingParams, Sequence, SequenceStatus


def clone_prefilled(engine: LLMEngine, source_id: int, seeds: list[int]) -> list[int]:
    """New running sequences, one per seed, each a copy of sequence `source_id` after its prefill: the same
    tokens (prompt and first sample), its compressed entries and index keys copied block by block into blocks of
    its own, its window rings, compressor tails and Engram history copied into a state slot of its own. Its first
    decode input is its last token, known on the host, so the next-token buffer is not needed. The source must
    be running with nothing in flight (ZOS off, or the engine drained of it). Returns the new sequence ids."""
    sched = engine.scheduler
    source = sched.seqs.get(source_id)
    if source is None or source.status != SequenceStatus.RUNNING or source.num_inflight:
        raise ValueError(f"sequence {source_id} is not running with its tokens processed; clone it after its prefill.")
    if engine.in_flight is not None:
        raise ValueError("a step is in flight; process it (engine.step() with ZOS off) before cloning.")
    model, runner = engine.runner.model, engine.runner
    ids = []
    for seed in seeds:
        params = SamplingParams(temperature=source.params.temperature, seed=seed,
                                max_tokens=source.params.max_tokens, ignore_eos=source.params.ignore_eos)
        seq_id, engine.next_id = engine.next_id, engine.next_id + engine.shard.world_size
        seq = Sequence(seq_id, source.token_ids[:source.num_prompt_tokens], params, seed)
        seq.token_ids = list(source.token_ids)
        seq.num_cached_tokens = source.num_cached_tokens
        if not (sched.blocks.can_allocate(seq, seq.num_cached_tokens) and sched.states.can_allocate(seq)):
            raise ValueError(f"no KV blocks or state slot left for clone {len(ids) + 1} of {len(seeds)}; "
                             f"raise num_kv_blocks or num_state_slots.")
        sched.blocks.allocate(seq, seq.num_cached_tokens)
        sched.states.allocate(seq)
        engine.tracer.request_added(seq_id, seq.token_ids[:seq.num_prompt_tokens], params, seed, None)
        seq.status = SequenceStatus.RUNNING
        sched.seqs[seq_id] = seq
        sched.running.append(seq)
        copy_state(model, runner, source, seq)
        ids.append(seq_id)
    return ids


def copy_state(model, runner, source: Sequence, seq: Sequence) -> None:
    """The device half of a clone: every paged tensor of `source` into `seq`'s blocks and slot."""
    dev = runner.device
    with torch.cuda.stream(runner.stream) if dev.type == "cuda" else contextlib.nullcontext():  # after the steps
        _copy(model, runner, source, seq, dev)


def _copy(model, runner, source: Sequence, seq: Sequence, dev: torch.device) -> None:
    src_blocks = torch.tensor(source.block_table, dtype=torch.long, device=dev)
    dst_blocks = torch.tensor(seq.block_table, dtype=torch.long, device=dev)
    for pool in (t for pair in model.entries.values() for t in pair):
        pool[dst_blocks] = pool[src_blocks]
    src, dst = source.state_slot, seq.state_slot
    model.ring[:, dst] = model.ring[:, src]
    for pool in (t for pair in model.tails.values() for t in pair):
        pool[dst] = pool[src]
    model.history[dst] = model.history[src]


def cloned_decode_run(engine: LLMEngine, batch: int, context: int, warmup: int, steps: int, seed: int,
                      probe=None) -> dict:
    """bench_decode.decode_run's numbers for `batch` rows at `context` positions, over one prefilled prompt and
    batch - 1 clones of it: the prompt's prefill time, then `warmup` decode steps (the rows part, a graph is
    captured), then `steps` timed decode steps of all rows, ZOS on (and `probe`'s values: `timed_decode`).
    The engine's tracer is a SpanTracer."""
    from bench_decode import timed_decode

    tracer, sync = engine.tracer, torch.cuda.synchronize if engine.runner.device.type == "cuda" else (lambda: None)
    zos, engine.enable_zos = engine.enable_zos, False
    prompt = [3 + (seed * 7919 + j * 104729) % (engine.vocab_size - 3) for j in range(context)]
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=warmup + steps + 4, ignore_eos=True)
    source = engine.add_request(prompt, params)
    sync()
    t0 = time.perf_counter()
    while engine.scheduler.seqs[source].num_output_tokens == 0:
        engine.step()
    sync()
    prefill_s = time.perf_counter() - t0
    clone_prefilled(engine, source, [seed * 1000 + i for i in range(1, batch)])
    engine.enable_zos = zos
    first = engine.scheduler.step
    for _ in range(warmup):
        engine.step()
    assert all(tracer.kinds[s] == ("decode", batch) for s in range(first, engine.scheduler.step)), \
        "a warm-up step was not a decode step of every row"
    sync()
    timed = timed_decode(engine, batch, steps, probe)
    return {**timed, "prefill_s": prefill_s, "prefill_tokens_per_s": context / prefill_s}
