"""Tracing overhead: tokens/s with the Recorder on and off (NullTracer), side by side in one process,
alternating runs on the same workload; and the Recorder's writer alone, fed a synthetic event stream
through its hooks (no engine), in events/s and bytes/event.

Usage: python benchmarks/bench_trace.py [--model micro] [--num-prompts 8] [--prompt-len 128] [--tokens 32]
Prints a rich table and the markdown row for benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from rich.console import Console
from rich.table import Table

from engine import LLM
from tracing import Recorder
from tracing.workload import random_requests


def tokens_per_s(a, trace_path: Path | None) -> float:
    """Prompt plus output tokens per second of one run, tracing to `trace_path` (None: off)."""
    llm = LLM(a.model, device=a.device, max_num_seqs=a.num_prompts,
              tracer=Recorder(trace_path, argv=[]) if trace_path else None)
    requests = list(random_requests(random.Random(0), a.num_prompts, (a.prompt_len, a.prompt_len),
                                    (a.tokens, a.tokens), llm.engine.vocab_size, temperature=1.0))
    start = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in requests], [r.params for r in requests], progress=False)
    llm.engine.shutdown()  # the footer is part of tracing's cost
    elapsed = time.perf_counter() - start
    return sum(len(o.prompt_token_ids) + len(o.token_ids) for o in outs) / elapsed


def writer_throughput(path: Path, steps: int, batch: int) -> tuple[float, float]:
    """(events/s, bytes/event) of the Recorder alone: decode steps of `batch` rows through every hook a
    step calls (schedule, reservation, token, spans, digest, step end), with a block alloc every 16 steps."""
    rec = Recorder(path, argv=[])
    rec.start({"engine": {}, "model": {}})
    params = SimpleNamespace(temperature=1.0, max_tokens=steps, ignore_eos=True, stop_token_ids=[])
    for seq in range(batch):
        rec.request_added(seq, list(range(128)), params, seq)
    start = time.perf_counter()
    for step in range(steps):
        rows = [SimpleNamespace(seq_id=s, epoch=0, start=128 + step, token_ids=[None], block_table=[s, batch + s],
                                state_slot=s, sample=True, seed=s, temperature=1.0, output_position=step)
                for s in range(batch)]
        rec.schedule(SimpleNamespace(step=step, batch_kind="decode", rows=rows, preempted=[]))
        for s in range(batch):
            rec.reservation(step, s, 0, step)
            if step % 16 == 0:
                rec.block_alloc(s, [step + s])
        t = time.perf_counter_ns()
        rec.cpu_span(step, "schedule", t, t + 1000)
        rec.cpu_span(step, "execute", t + 1000, t + 2000)
        rec.device_span(step, t + 1500, t + 9000)
        for s in range(batch):
            rec.token(step, s, 0, 129 + step, 1000 + s, True)
        rec.step_digest(step, "0123456789abcdef")
        rec.cpu_span(step, "process", t + 9000, t + 9500)
        rec.step_end(step)
    rec.close()
    elapsed = time.perf_counter() - start
    events = sum(rec.counts.values())
    return events / elapsed, path.stat().st_size / events


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="micro")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--writer-steps", type=int, default=20000)
    a = p.parse_args()
    results = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        tokens_per_s(a, None)  # warm-up: checkpoint load, allocator, caches
        for i in range(a.repeats):  # alternate, so drift hits both alike
            for traced in (False, True):
                results[traced].append(tokens_per_s(a, Path(tmp, f"run{i}.mdt") if traced else None))
        trace_bytes = Path(tmp, "run0.mdt").stat().st_size
        events_per_s, bytes_per_event = writer_throughput(Path(tmp, "writer.mdt"), a.writer_steps, 8)
    off, on = statistics.median(results[False]), statistics.median(results[True])
    hw = (torch.cuda.get_device_name() if a.device == "cuda"
          else f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    table = Table(title=f"tracing overhead, {a.model}, {a.num_prompts} x ({a.prompt_len} + {a.tokens}) tokens, "
                        f"{hw}, median of {a.repeats}")
    for col in ("tokens/s off", "tokens/s on", "on / off", "trace KiB", "writer events/s", "bytes/event"):
        table.add_column(col)
    row = (f"{off:,.0f}", f"{on:,.0f}", f"{on / off:.3f}", f"{trace_bytes / 1024:,.0f}", f"{events_per_s:,.0f}",
           f"{bytes_per_event:.1f}")
    table.add_row(*row)
    Console().print(table)
    print(f"| tracing overhead, {a.model}, {a.num_prompts}x({a.prompt_len}+{a.tokens}), {hw} | "
          + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
