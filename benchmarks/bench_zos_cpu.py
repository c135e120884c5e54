"""ZOS on the CPU device: decode time per step with ZOS on and off, side by side in one process.

On CPU the "device" is one worker thread, so ZOS overlaps the scheduler's Python with the forward only
as far as the GIL allows (ARCHITECTURE.md §3). This measures that honestly, for 1 and 2 intra-op
threads. Usage: python benchmarks/bench_zos_cpu.py [--model tiny-68m] [--batch 8] [--tokens 48]
Prints a rich table and the markdown row for benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from engine import LLM
from tracing.workload import random_requests


def decode_ms_per_step(model: str, zos: bool, threads: int, batch: int, tokens: int, prompt_len: int) -> float:
    llm = LLM(model, enable_zos=zos, cpu_threads=threads, max_num_seqs=batch)
    for request in random_requests(random.Random(0), batch, (prompt_len, prompt_len), (tokens, tokens),
                                   llm.engine.vocab_size, temperature=1.0):
        llm.engine.add_request(*request)
    for _ in range(3):  # warm-up: the prefill and the first decode steps
        llm.engine.step()
    steps, start = 0, time.perf_counter()
    while llm.engine.has_unfinished():
        llm.engine.step()
        steps += 1
    elapsed = time.perf_counter() - start
    llm.engine.shutdown()
    return 1e3 * elapsed / steps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny-68m")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    default_threads = torch.get_num_threads()
    table = Table(title=f"decode ms/step, {a.model}, batch {a.batch}, CPU ({platform.processor() or platform.machine()})")
    for col in ("intra-op threads", "ZOS off", "ZOS on", "on / off"):
        table.add_column(col)
    rows = []
    for threads in sorted({1, default_threads}):
        results = {True: [], False: []}
        for _ in range(a.repeats):  # alternate, so drift hits both alike
            for zos in (False, True):
                results[zos].append(decode_ms_per_step(a.model, zos, threads, a.batch, a.tokens, a.prompt_len))
        off, on = statistics.median(results[False]), statistics.median(results[True])
        table.add_row(str(threads), f"{off:.1f}", f"{on:.1f}", f"{on / off:.2f}")
        rows.append(f"| CPU {os.cpu_count()} cores, {threads} intra-op | {a.model} bf16 | batch {a.batch}, "
                    f"prompt {a.prompt_len}, {a.tokens} tokens | ZOS off {off:.1f} ms/step, on {on:.1f} ms/step, "
                    f"ratio {on / off:.2f} | 3 warm-up steps, median of {a.repeats} |")
    torch.set_num_threads(default_threads)
    Console().print(table)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
