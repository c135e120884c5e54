"""The reading path of the seed and its size in code lines (issue #18 item 5; STYLE.md "a line budget").

The reading path is what a newcomer reads to follow one request through a decode step of the seed (one
process, the default mode): engine/ (the API, the step contract, scheduler, block and slot managers, model
runner) and the forward of model/ and kernels/ that such a step runs, in its torch form. The budget is about
2,000 code lines (the size of the write-up the project grew from). Everything else, named in OFF_PATH with its
reason, serves other readers: checkpoint loading, the reference model, EP x DP over several processes, the
batch-invariant mode, the Triton fast paths (each matches a torch function of model/ that is on the path, as
tests/test_kernels.py and tests/gpu/ prove), the launcher and the platform record. tracing/ (the recorder,
replay, check and the comparison rules in tracing/compare.py) and tui/ are the debugger, not the engine.

A code line is a physical line holding code: not blank, not a comment alone, not part of a docstring (a
string expression statement: a module's, class's or function's first statement, or a bare string).

    python benchmarks/reading_path.py          # a table per file, then the total; exit 0 whatever the count
"""
from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUDGET = 2000  # STYLE.md: "about 2,000 lines"
CEILING = 2050  # the test's hard stop: "about" leaves room for the CUDA fast paths' one-line dispatches, no more

# module -> why it is on the path of a decode step
ON_PATH = {
    "engine/llm.py": "LLM.generate: the user's entry point",
    "engine/llm_engine.py": "LLMEngine: add_request, step (the ZOS contract), process",
    "engine/scheduler.py": "Scheduler: schedule, reservations, preemption, cancellation, process",
    "engine/step.py": "the step record: ScheduledRow, ScheduledBatch, packed columns, digest",
    "engine/block_manager.py": "KV blocks and state slots, one owner each",
    "engine/sequence.py": "Sequence and SamplingParams: a request's state",
    "engine/model_runner.py": "ModelRunner: packed inputs, remap, forward, sampling, StepHandle",
    "engine/tracer.py": "the tracer protocol the engine calls at every transition",
    "engine/tokenizer.py": "the byte tokenizer generate encodes and decodes with",
    "model/config.py": "ModelArgs: the shapes every layer reads",
    "model/transformer.py": "the weights and the layer stack (Block, hyper-connections around each layer)",
    "model/paged.py": "the paged batched forward a step runs",
    "model/attention.py": "attention: window ring, compressor, indexer, sparse attention with sink",
    "model/moe.py": "the mixture of experts",
    "model/hc.py": "hyper-connections",
    "model/engram.py": "Engram: hashed n-gram memory",
    "model/rope.py": "rotary embeddings",
    "model/quant.py": "FP8 / FP4 activation quantisation the forward simulates",
    "kernels/sampling.py": "the sampler: Gumbel-max with Philox noise keyed by seed and position",
}

# module -> why it is not on the path (it is read for something else)
OFF_PATH = {
    "engine/launch.py": "starts N ranks for EP x DP; a decode step never runs it",
    "engine/platform.py": "what decides the bits, written in a trace header; no step reads it",
    "engine/kv_budget.py": "sizes the default KV pool from a memory budget, at start-up; no step reads it",
    "engine/host.py": "the CPU allocator's settings, set once at start-up; no step reads it",
    "engine/async_llm.py": "the engine in its own thread for `mdi-trace serve`; a step is the same step()",
    "kernels/fp8_gemm.py": "the FP8 GEMM of the released format on CUDA; the torch form is model/quant.py's",
    "kernels/fp4_moe.py": "the grouped MoE over FP4 experts on CUDA; the torch form is model/moe.py's",
    "kernels/head.py": "the fp32 head of a wide model on bf16 tensor-core dots (CUDA); the torch form is "
                       "model/transformer.py's F.linear",
    "model/checkpoint.py": "random init, safetensors save and load: start-up, not a step",
    "model/released.py": "the released checkpoint's names and formats: start-up, not a step",
    "model/load.py": "load_model: a preset or a folder to a Transformer, at start-up",
    "model/slice.py": "the v41-slice preset's weights, drawn in the released format on the device at start-up",
    "model/reference.py": "the plain reference model: the checker's side, not the engine's",
    "model/parallel.py": "EP x DP over several processes: the layers call it only when world_size > 1",
    "model/invariant.py": "the batch-invariant mode (off by default): off, each hook is the torch op it names",
    "kernels/gemm.py": "the batch-invariant mode's GEMM on CUDA",
    "kernels/attention.py": "Triton fast path of model/attention.py's sparse attention (CUDA)",
    "kernels/indexer.py": "Triton fast path of model/attention.py's indexer scores and attention list (CUDA)",
    "kernels/norm.py": "Triton fast path of model/attention.py's RMSNorm (CUDA)",
    "kernels/hc.py": "Triton fast path of model/hc.py (CUDA)",
    "kernels/moe.py": "Triton fast path of model/moe.py's routing, SwiGLU and combine (CUDA)",
    "kernels/rope.py": "Triton fast path of model/rope.py (CUDA)",
    "kernels/quant.py": "Triton fast path of model/quant.py (CUDA)",
    "kernels/engram.py": "Triton fast path of model/engram.py's hashes, table lookup and gate (CUDA)",
    "kernels/latent.py": "Triton fast path of model/attention.py's norm, RoPE and quantisation of a latent (CUDA)",
    "kernels/paged.py": "Triton fast path of the runner's step inputs and model/paged.py's addresses (CUDA)",
    "kernels/compressor.py": "Triton fast path of model/paged.py's compressor step at decode (CUDA)",
    "kernels/output.py": "Triton fast path of model/attention.py's inverse RoPE and grouped wo_a (CUDA)",
    "kernels/fit.py": "a CUDA launch's smaller tiles where the GPU cannot hold a kernel's shared memory",
}


def code_lines(path: Path) -> int:
    """Physical lines holding a token other than a comment, outside docstrings."""
    text = path.read_text()
    docstring_lines: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            docstring_lines.update(range(node.lineno, node.end_lineno + 1))
    lines: set[int] = set()
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER, tokenize.ENCODING)
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in skip:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines - docstring_lines)


def unlisted() -> list[str]:
    """Modules of engine/, model/ and kernels/ named in neither table (a new module must say where it is)."""
    listed = set(ON_PATH) | set(OFF_PATH)
    found = {str(p.relative_to(ROOT)) for d in ("engine", "model", "kernels") for p in (ROOT / d).glob("*.py")
             if p.name != "__init__.py"}
    return sorted(found - listed)


def main() -> int:
    missing = [m for m in [*ON_PATH, *OFF_PATH] if not (ROOT / m).exists()]
    if missing or unlisted():
        print(f"reading_path.py: modules listed but missing {missing}, present but unlisted {unlisted()}; "
              "update ON_PATH / OFF_PATH.", file=sys.stderr)
        return 1
    total = 0
    print(f"{'reading path (a decode step)':<28} {'code lines':>10}  why")
    for module, why in ON_PATH.items():
        n = code_lines(ROOT / module)
        total += n
        print(f"{module:<28} {n:>10}  {why}")
    print(f"{'total':<28} {total:>10}  (budget about {BUDGET})")
    print(f"\n{'off the path':<28} {'code lines':>10}  why")
    for module, why in OFF_PATH.items():
        print(f"{module:<28} {code_lines(ROOT / module):>10}  {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
