"""The model runner: a ScheduledBatch in, a StepHandle out (ARCHITECTURE.md §3).

Mirrors DeepInfer's deepinfer/worker/worker.py and the remap of csrc/engine/zos.cpp. `execute` only
enqueues: it builds the device inputs, gathers in-flight input tokens on the device from the
next-token buffer (indexed by state slot: "remap"), runs the forward and the sampler, writes each
sampled token back into that buffer and starts the copy to the host. `StepHandle.wait()` is the only
place that reads a device result.

The device is a CUDA stream with CUDA events around each step, or on CPU one worker thread that runs
the steps in FIFO order, so the same contract and code paths run in CI. The CPU overlap is partial:
the scheduler's Python and the forward's many small ops share the GIL (ARCHITECTURE.md §3).
"""
from __future__ import annotations

import os
import platform
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine.scheduler import ScheduledBatch
from kernels.sampling import sample
from model.paged import ForwardBatch, PagedModel
from model.transformer import Transformer


@dataclass(slots=True)
class _HostInputs:
    ids: torch.Tensor            # [B, S] int64, 0 where a token is padding or in flight
    remap: torch.Tensor          # [B] bool: the row's input token is in flight (take next_tokens[slot])
    start: torch.Tensor          # [B]
    num_tokens: torch.Tensor     # [B]
    block_tables: torch.Tensor   # [B, nb], padded with the trash block
    slots: torch.Tensor          # [B]
    sample: torch.Tensor         # [B] bool
    temperatures: torch.Tensor   # [B] fp32
    seeds: torch.Tensor          # [B] int64
    positions: torch.Tensor      # [B] int64: the output position each row draws
    context_len: int
    decode: bool


def device_name(device: torch.device) -> str:
    """The device as traces record it: the GPU's name, or the CPU's architecture and core count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()}, {os.cpu_count()} cores)"


class StepHandle:
    """One step in flight. `wait()` returns its sampled tokens per row (None where a row did not sample)
    and sets `device_span` to the (start_ns, end_ns) of the step's device work."""

    def __init__(self, batch: ScheduledBatch, result: Future | tuple):
        self.batch, self._result = batch, result
        self.device_span: tuple[int, int] | None = None

    def wait(self) -> list[int | None]:
        if isinstance(self._result, Future):  # CPU worker: (host tokens, start_ns, end_ns)
            tokens, start, end = self._result.result()
        else:  # CUDA: (pinned host tokens, start event, end event, clock, the pinned inputs kept alive)
            tokens, start_ev, end_ev, clock, _ = self._result
            end_ev.synchronize()
            start, end = clock.to_host_ns(start_ev), clock.to_host_ns(end_ev)
        self.device_span = (start, end)
        values = tokens.tolist()
        return [t if row.sample else None for row, t in zip(self.batch.rows, values)]


class _CudaClock:
    """Places CUDA events on the host's perf_counter_ns axis from one reference event."""

    def __init__(self, stream: torch.cuda.Stream):
        self.ref = torch.cuda.Event(enable_timing=True)
        self.ref.record(stream)
        self.ref.synchronize()
        self.ref_ns = time.perf_counter_ns()

    def to_host_ns(self, event: torch.cuda.Event) -> int:
        return self.ref_ns + int(self.ref.elapsed_time(event) * 1e6)


class ModelRunner:
    def __init__(self, weights: Transformer, num_kv_blocks: int, num_state_slots: int,
                 cpu_threads: int | None = None):
        self.device = weights.head.weight.device
        self.model = PagedModel(weights, num_kv_blocks, num_state_slots)
        self.trash_block, self.trash_slot = num_kv_blocks, num_state_slots
        self.next_tokens = torch.zeros(num_state_slots + 1, dtype=torch.long, device=self.device)
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device)
            self.clock = _CudaClock(self.stream)
        else:
            if cpu_threads:  # intra-op threads (process-wide in torch); benchmarks/bench_zos_cpu.py measures it
                torch.set_num_threads(cpu_threads)
            self.worker = ThreadPoolExecutor(1, thread_name_prefix="mdi-device")

    def execute(self, batch: ScheduledBatch) -> StepHandle:
        inputs = self.prepare(batch)
        if self.device.type == "cuda":
            return StepHandle(batch, self._launch_cuda(inputs))
        return StepHandle(batch, self.worker.submit(self._run_cpu, inputs))

    def prepare(self, batch: ScheduledBatch) -> _HostInputs:
        """Host tensors of the step (pinned on CUDA, so the copies are asynchronous)."""
        rows, B = batch.rows, len(batch.rows)
        S = max(r.num_tokens for r in rows)
        nb = max(len(r.block_table) for r in rows)
        ids = torch.zeros(B, S, dtype=torch.long)
        tables = torch.full((B, nb), self.trash_block, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :r.num_tokens] = torch.tensor([t or 0 for t in r.token_ids])
            tables[i, :len(r.block_table)] = torch.tensor(r.block_table)
        col = lambda f, dtype=torch.long: torch.tensor([f(r) for r in rows], dtype=dtype)  # noqa: E731
        inputs = _HostInputs(
            ids, col(lambda r: r.token_ids[0] is None, torch.bool), col(lambda r: r.start),
            col(lambda r: r.num_tokens), tables, col(lambda r: r.state_slot), col(lambda r: r.sample, torch.bool),
            col(lambda r: r.temperature, torch.float32), col(lambda r: r.seed), col(lambda r: r.output_position),
            max(r.start + r.num_tokens for r in rows),
            all(r.num_tokens == 1 and r.start > 0 for r in rows))
        if self.device.type == "cuda":
            for f in _TENSOR_FIELDS:
                setattr(inputs, f, getattr(inputs, f).pin_memory())
        return inputs

    def forward(self, inputs: _HostInputs) -> torch.Tensor:
        """Device work of one step: remap, forward, sample, write back. Returns sampled tokens [B]."""
        dev, kw = self.device, dict(non_blocking=True)
        d = {f: getattr(inputs, f).to(dev, **kw) for f in _TENSOR_FIELDS}
        ids = d["ids"]
        ids[:, 0] = torch.where(d["remap"], self.next_tokens[d["slots"]], ids[:, 0])  # in-flight inputs
        logits = self.model.forward(ForwardBatch(ids, d["start"], d["num_tokens"], d["block_tables"], d["slots"],
                                                 inputs.context_len, inputs.decode))
        tokens = sample(logits, d["temperatures"], d["seeds"], d["positions"])
        self.next_tokens[torch.where(d["sample"], d["slots"], self.trash_slot)] = tokens
        return tokens

    def _run_cpu(self, inputs: _HostInputs):
        start = time.perf_counter_ns()
        tokens = self.forward(inputs)
        return tokens, start, time.perf_counter_ns()

    def _launch_cuda(self, inputs: _HostInputs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            tokens = self.forward(inputs)
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            end.record(self.stream)
        return host, start, end, self.clock, inputs  # pinned inputs must outlive their copies

    def shutdown(self) -> None:
        if self.device.type != "cuda":
            self.worker.shutdown(wait=True)


_TENSOR_FIELDS = ("ids", "remap", "start", "num_tokens", "block_tables", "slots", "sample", "temperatures",
                  "seeds", "positions")
