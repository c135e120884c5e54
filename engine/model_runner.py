"""The model runner (mirrors DeepInfer's deepinfer/worker/worker.py and the remap of csrc/engine/zos.cpp).

A ScheduledBatch in, a StepHandle out (ARCHITECTURE.md §3). `execute` only
enqueues: it builds the device inputs, gathers in-flight input tokens on the device from the
next-token buffer (indexed by state slot: "remap"), runs the forward and the sampler, writes each
sampled token back into that buffer and starts the copy to the host. `StepHandle.wait()` is the only
place that reads a device result.

The device is a CUDA stream with CUDA events around each step, or on CPU one worker thread that runs
the steps in FIFO order, so the same contract and code paths run in CI. The CPU overlap is partial:
the scheduler's Python and the forward's many small ops share the GIL (ARCHITECTURE.md §3).

On CUDA a decode step replays a CUDA graph (DeepInfer's and vLLM's decode graphs): the forward has fixed
shapes and no host sync (model/paged.py), so one capture per (padded batch size, context bucket) replays
every later step of that shape, and the step costs the host two input copies and one replay instead
of thousands of kernel launches. Padding rows write only to the trash slot and trash block. A wider
context only adds compressed entries no row can see, so the index lists, hence the tokens, are those of
the unpadded step; the GEMM shapes differ, so bits may differ within ARCHITECTURE.md §6 (the replay of a
recorded run uses the same runner, hence the same shapes and bits).
"""
from __future__ import annotations

import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from engine import step as layout
from engine.step import NCOL, ScheduledBatch
from kernels import paged as paged_kernel
from kernels.sampling import sample
from model import invariant
from model.config import BLOCK_SIZE, cdiv
from model.paged import ForwardBatch, PagedModel, use_fused
from model.parallel import idle_forward
from model.transformer import Transformer


@dataclass(slots=True)
class _HostInputs:
    """A step's inputs in two host tensors (pinned on CUDA: two asynchronous copies per step).

    ints [B, NCOL + S + nb] int64: the batch packed in engine/step.py's layout. Rows past `num_rows` pad a
    CUDA-graph batch (`step.padding_row`)."""
    ints: torch.Tensor
    temperatures: torch.Tensor   # [B] fp32
    num_rows: int                # the batch's real rows (the first num_rows)
    S: int                       # tokens per row (padded)
    context_len: int             # >= start + num_tokens of every row (bucketed for a graph)
    decode: bool
    graph: bool                  # replay a captured decode graph (padded rows, bucketed context)


def device_name(device: torch.device) -> str:
    """The device as traces record it: the GPU's name, or the CPU's architecture and core count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()}, {os.cpu_count()} cores)"


class StepResult(NamedTuple):
    """What a step gives back: one token per row (None where the row did not sample), and the step's device
    work as (start_ns, end_ns) on the host's perf_counter_ns axis."""
    tokens: list[int | None]
    device_span: tuple[int, int]


class _DeviceTokens(NamedTuple):
    """A step's sampled tokens on the host [num_rows] and its device span: what the device work resolves to."""
    tokens: torch.Tensor
    start_ns: int
    end_ns: int


@dataclass(slots=True)
class _CudaStep:
    """A step queued on the CUDA stream: its pinned host tokens and the events around it. `result()` waits
    for the end event (the Future interface of the CPU worker's steps)."""
    tokens: torch.Tensor        # pinned host copy, being written
    start: torch.cuda.Event
    end: torch.cuda.Event
    clock: "_CudaClock"
    inputs: _HostInputs         # the pinned inputs must outlive their copies

    def result(self) -> _DeviceTokens:
        self.end.synchronize()
        return _DeviceTokens(self.tokens, self.clock.to_host_ns(self.start), self.clock.to_host_ns(self.end))


class StepHandle:
    """One step in flight. `wait()` is the only place that reads a device result (ARCHITECTURE.md §3)."""

    def __init__(self, batch: ScheduledBatch, device_work):
        self.batch = batch
        self._device_work = device_work  # a Future (CPU worker) or a _CudaStep: .result() -> _DeviceTokens

    def wait(self) -> StepResult:
        tokens, start, end = self._device_work.result()
        values = tokens.tolist()
        return StepResult([t if row.sample else None for row, t in zip(self.batch.rows, values)], (start, end))


class _CudaClock:
    """Places CUDA events on the host's perf_counter_ns axis from one reference event."""

    def __init__(self, stream: torch.cuda.Stream):
        self.ref = torch.cuda.Event(enable_timing=True)
        self.ref.record(stream)
        self.ref.synchronize()
        self.ref_ns = time.perf_counter_ns()

    def to_host_ns(self, event: torch.cuda.Event) -> int:
        return self.ref_ns + int(self.ref.elapsed_time(event) * 1e6)


class _DecodeGraph:
    """One decode step captured as a CUDA graph for a padded batch size and a context bucket: remap,
    forward, sampling and the next-token write-back replay from static inputs (`ints`, `temperatures`)."""

    def __init__(self, runner: "ModelRunner", rows: int, blocks: int, context_len: int):
        dev = runner.device
        debug = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)  # building and capturing synchronise, once a graph; the replays never do
        try:
            # all-padding rows (one token at position 1 into the trash slot and trash blocks) for the warm-up
            padding = layout.padding_row(1, blocks, runner.trash_block, runner.trash_slot)
            self.ints = torch.tensor([padding] * rows, dtype=torch.long, device=dev)
            self.temperatures = torch.zeros(rows, dtype=torch.float32, device=dev)
            step = lambda: runner.device_step(self.ints, self.temperatures, 1, context_len, True)  # noqa: E731
            with torch.cuda.stream(runner.stream):
                step()  # warm-up: kernel compilation, library handles and caches stay out of the capture
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=runner.graph_pool, stream=runner.stream):
                self.tokens = step()  # [rows]: the static output
            self.logits = runner.last_logits  # [rows, vocab], rewritten by every replay
        finally:
            torch.cuda.set_sync_debug_mode(debug)


class ModelRunner:
    """Runs ScheduledBatches on the device. On CUDA a decode step replays a captured graph
    (`use_cuda_graphs`): its batch is padded to a size of GRAPH_BATCH_SIZES and its context to a
    multiple of GRAPH_CONTEXT_STEP, so a few graphs serve every step (prefill runs eagerly)."""

    use_cuda_graphs = True
    GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)
    GRAPH_CONTEXT_STEP = 256  # tokens; a wider bucket only adds entries no row can see (masked, same lists)
    MAX_GRAPHS = 64

    def __init__(self, weights: Transformer, num_kv_blocks: int, num_state_slots: int,
                 cpu_threads: int | None = None, batch_invariant: bool = False):
        self.device = weights.head.weight.device
        self.model = PagedModel(weights, num_kv_blocks, num_state_slots, batch_invariant)  # model/invariant.py
        self.trash_block, self.trash_slot = num_kv_blocks, num_state_slots
        self.next_tokens = torch.zeros(num_state_slots + 1, dtype=torch.long, device=self.device)
        self.graphs: dict[tuple[int, int], _DecodeGraph] = {}  # (rows, context bucket) -> graph
        self.last_logits: torch.Tensor | None = None  # the last step's logits [B, vocab] (checkers read them)
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device)
            self.clock = _CudaClock(self.stream)
            self.graph_pool = torch.cuda.graph_pool_handle()  # one memory pool shared by every graph
        else:
            if cpu_threads:  # intra-op threads (process-wide in torch); benchmarks/bench_zos_cpu.py measures it
                torch.set_num_threads(cpu_threads)
            self.worker = ThreadPoolExecutor(1, thread_name_prefix="mdi-device")

    # ---- the public entry points: the engine's step, and re-execution by the checkers (tracing/) ----------
    def execute(self, batch: ScheduledBatch) -> StepHandle:
        """Enqueue one step: inputs, remap, forward, sampling, next-token write-back, copy to the host. The
        engine's step and `mdi-trace check`'s replay of a recorded batch both run this."""
        inputs = self.prepare(batch)
        if self.device.type == "cuda":
            return StepHandle(batch, self._launch_cuda(inputs))
        return StepHandle(batch, self.worker.submit(self._run_cpu, inputs))

    def logits(self, batch: ScheduledBatch, capture=None) -> torch.Tensor:
        """Re-execute a batch eagerly and return the logits of every token [B, S, vocab] (not only the sampled
        rows' last ones), without sampling. Its inputs are built as `execute` builds them, and its forward
        writes the batch's KV blocks and state slots like a step. `capture` is PagedModel.forward's per-module
        hook (tracing/divergence.py localises a divergence with it)."""
        inputs = self.prepare(batch, eager=True)
        fb = self._unpack(inputs.ints.to(self.device), inputs.S, inputs.context_len, inputs.decode)[0]
        return self.model.forward(fb, all_logits=True, capture=capture)

    def graph_shape(self, batch: ScheduledBatch) -> tuple[int, int] | None:
        """(padded rows, context bucket) of a decode step that replays a graph, or None (eager)."""
        rows = batch.rows
        if not (self.device.type == "cuda" and self.use_cuda_graphs and batch.batch_kind == "decode"
                and all(r.num_tokens == 1 and r.start > 0 for r in rows)):
            return None
        size = next((b for b in self.GRAPH_BATCH_SIZES if b >= len(rows)), None)
        step = self.GRAPH_CONTEXT_STEP
        context = cdiv(max(r.start + 1 for r in rows), step) * step
        if size is None or ((size, context) not in self.graphs and len(self.graphs) >= self.MAX_GRAPHS):
            return None
        return size, context

    def prepare(self, batch: ScheduledBatch, eager: bool = False) -> _HostInputs:
        """The packed host inputs of a step (see _HostInputs), padded for a graph when one will run (never when
        `eager`)."""
        rows, shape = batch.rows, None if eager else self.graph_shape(batch)
        S = max(r.num_tokens for r in rows)
        if shape is None:
            size, context = len(rows), max(r.start + r.num_tokens for r in rows)
            nb = max(len(r.block_table) for r in rows)
        else:
            size, context = shape
            nb = context // BLOCK_SIZE
        ints = torch.from_numpy(layout.pack(batch, S, nb, size, self.trash_block, self.trash_slot))
        temperatures = torch.from_numpy(np.array([r.temperature for r in rows] + [0.0] * (size - len(rows)),
                                                 dtype=np.float32))
        if self.device.type == "cuda":
            ints, temperatures = ints.pin_memory(), temperatures.pin_memory()
        decode = all(r.num_tokens == 1 and r.start > 0 for r in rows)
        return _HostInputs(ints, temperatures, len(rows), S, context, decode, shape is not None)

    def device_step(self, ints: torch.Tensor, temperatures: torch.Tensor, S: int, context_len: int,
                    decode: bool) -> torch.Tensor:
        """Device work of one step from the packed inputs on the device: remap, forward, sample, write
        back. Returns the sampled tokens [B]. Fixed shapes for fixed (B, S, nb, context_len): capturable."""
        batch, sampled, seeds, positions = self._unpack(ints, S, context_len, decode)
        slots = batch.state_slots
        logits = self.model.forward(batch)
        self.last_logits = logits  # [B, vocab]: the step's logits, for a checker's margin (a graph's static output)
        tokens = sample(logits, temperatures, seeds, positions)
        self.next_tokens[torch.where(sampled.bool(), slots, self.trash_slot)] = tokens
        return tokens

    def _unpack(self, ints: torch.Tensor, S: int, context_len: int, decode: bool):
        """Packed inputs on the device -> (ForwardBatch with the in-flight input tokens remapped by state slot,
        sampled, seeds, output positions) [B] each. With the fused launches on (CUDA): one launch
        (kernels/paged.py unpack), which also gives the forward's per-token values."""
        if use_fused(ints):
            return paged_kernel.unpack(ints, S, self.next_tokens, context_len, decode)
        columns, ids, tables = layout.split(ints, S)
        remap, start, num_tokens, slots, sampled, seeds, positions = columns.contiguous()  # [B] each
        ids, tables = ids.contiguous(), tables.contiguous()  # [B, S], [B, nb]
        ids[:, 0] = torch.where(remap.bool(), self.next_tokens[slots], ids[:, 0])  # in-flight inputs
        return ForwardBatch(ids, start, num_tokens, tables, slots, context_len, decode), sampled, seeds, positions

    def forward(self, inputs: _HostInputs) -> torch.Tensor:
        """One eager step: copy the inputs to the device, run it. Returns the sampled tokens [num_rows]."""
        kw = dict(device=self.device, non_blocking=True)
        tokens = self.device_step(inputs.ints.to(**kw), inputs.temperatures.to(**kw), inputs.S, inputs.context_len,
                                  inputs.decode)
        return tokens[:inputs.num_rows]

    def _replay(self, inputs: _HostInputs) -> torch.Tensor:
        """A decode step through its graph (captured on first use): copy the inputs in, replay."""
        key = (inputs.ints.size(0), inputs.context_len)
        if key not in self.graphs:
            self.graphs[key] = _DecodeGraph(self, key[0], inputs.ints.size(1) - NCOL - 1, inputs.context_len)
        graph = self.graphs[key]
        graph.ints.copy_(inputs.ints, non_blocking=True)
        graph.temperatures.copy_(inputs.temperatures, non_blocking=True)
        graph.graph.replay()
        self.last_logits = graph.logits
        return graph.tokens[:inputs.num_rows]

    def _run_cpu(self, inputs: _HostInputs) -> _DeviceTokens:
        start = time.perf_counter_ns()
        tokens = self.forward(inputs)
        return _DeviceTokens(tokens, start, time.perf_counter_ns())

    def _launch_cuda(self, inputs: _HostInputs) -> _CudaStep:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            tokens = self._replay(inputs) if inputs.graph else self.forward(inputs)
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            end.record(self.stream)
        return _CudaStep(host, start, end, self.clock, inputs)

    def idle(self) -> None:
        """EP x DP with nothing scheduled on this rank: the forward's collectives with zero rows, queued on the
        device after the steps before it, so that the ranks with rows are not left waiting."""
        if self.device.type == "cuda":
            with torch.cuda.stream(self.stream):
                self._idle_forward()
        else:
            self.worker.submit(self._idle_forward)

    def _idle_forward(self) -> None:
        """The sharded layers run the other ranks' rows here too: in the batch-invariant mode, as they do."""
        with invariant.mode(self.model.batch_invariant):
            idle_forward(self.model.weights)

    def shutdown(self) -> None:
        if self.device.type != "cuda":
            self.worker.shutdown(wait=True)
