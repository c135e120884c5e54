"""Whether the engine's Triton kernels build for the GPUs its users run (issue #20: they record on B200, sm_100;
nothing here may be Hopper-only without a portable path), checked without those GPUs: Triton's compiler and the
ptxas in its wheel run wherever the wheel does.

Two steps:
1. `--record FILE`, on a CUDA machine: tiny-68m's engine serves a mix of prompts (chunked prefill, decode at
   several batch sizes under CUDA graphs, greedy and sampled rows), then again in the batch-invariant mode; with
   `--slice` the v41-slice too (a chunk of 8,192 tokens of one long prompt, then its last 2,048 with 63 short
   prompts in steps of 8,192, 8,192 and 4,564 tokens: the FP4 experts' two prefill tiers and the index scores' chunk
   form; then 64 rows decoding, fewer as they finish: the FP8 linears' tiles up to 16 rows and to 64). Every
   kernel Triton compiles on the way is kept as it was compiled: its function, signature, constexprs,
   specialisation attributes and launch options (num_warps, num_stages...), in FILE (JSON).
2. `FILE [--targets 80,90,100]`, anywhere (no GPU needed): each recorded kernel compiled for each target (sm_80
   A100, sm_90 H100/H200, sm_100 B200; 120 for the RTX 50 series) to a cubin, and a table of its registers, local
   memory (spills) and shared memory against the target's most a block may take. A kernel that does not build,
   or needs more shared memory than the target has, is named with the target and the compiler's words; the exit
   status is 1 if any did. The one choice the engine makes by the device (`BY_DEVICE`) is made for each target.
This proves that the kernels build and fit on those GPUs, not what they compute there: that takes the GPU
(tests/gpu).

Usage: python benchmarks/portable.py --record kernels.json [--slice]      (CUDA)
       python benchmarks/portable.py kernels.json [--targets 80,90,100]   (anywhere Triton's wheel runs)
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile

# shared memory a block may take, by compute capability (CUDA programming guide, "Technical Specifications")
MAX_SHARED = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}
# the constexprs the engine picks by the device it runs on, as it would pick them for a compute capability: the
# hardware e4m3 conversion from sm_89 (kernels/fp8_gemm.py hw_fp8); every other choice is by shape and mode alone
BY_DEVICE = {"HW_FP8": lambda capability: capability >= 89}
# the launch options that are the kernel's, not the machine's (the target's own are filled in by its backend)
OPTIONS = ("num_warps", "num_ctas", "num_stages", "maxnreg", "enable_fp_fusion", "launch_cooperative_grid", "debug")


def encode(value):
    """A constexpr's value as JSON: numbers, bools, None and strings as they are; a Triton dtype or a jitted
    function by name."""
    import triton
    import triton.language as tl

    if isinstance(value, tl.dtype):
        return {"dtype": str(value)}
    if isinstance(value, triton.runtime.jit.JITFunction):
        return {"jit": f"{value.fn.__module__}:{value.fn.__qualname__}"}
    if isinstance(value, tl.constexpr):
        return encode(value.value)
    return value


def decode(value):
    """`encode`'s JSON back to the constexpr's value."""
    import triton.language as tl

    if isinstance(value, dict) and "dtype" in value:
        return tl.dtype(value["dtype"])
    if isinstance(value, dict) and "jit" in value:
        return resolve(value["jit"])
    return value


def tuples(value):
    """JSON's lists back to the tuples a signature holds (a kernel's signature has no lists)."""
    return tuple(tuples(v) for v in value) if isinstance(value, list) else value


def entry(src, options: dict) -> dict:
    """A compiled kernel (triton.compiler.ASTSource and its options) as a JSON-able record."""
    constants = src.constants if hasattr(src, "constants") else src.constexprs  # by argument index (a path)
    return {"fn": f"{src.fn.fn.__module__}:{src.fn.fn.__qualname__}",
            "signature": dict(src.signature),
            "constexprs": [[list(path), encode(v)] for path, v in constants.items()],
            "attrs": [[list(path), v] for path, v in src.attrs.items()],
            "options": {k: v for k, v in (options or {}).items() if k in OPTIONS}}


def resolve(name: str):
    module, _, qualname = name.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def source(record: dict, capability: int):
    """The record back as the ASTSource Triton compiled, with the engine's choices by the device made for sm_
    `capability` (`BY_DEVICE`)."""
    from triton.compiler import ASTSource

    fn = resolve(record["fn"])
    names = [p.name for p in fn.params]
    constexprs = {tuple(path): decode(v) for path, v in record["constexprs"]}
    for path in constexprs:
        if len(path) == 1 and names[path[0]] in BY_DEVICE:
            constexprs[path] = BY_DEVICE[names[path[0]]](capability)
    return ASTSource(fn, {k: tuples(v) for k, v in record["signature"].items()}, constexprs,
                     {tuple(path): v for path, v in record["attrs"]})


def usage(cubin: bytes) -> tuple[int, int]:
    """(registers a thread, local memory bytes a thread) of a cubin's one function, by the wheel's cuobjdump."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    fields = dict(kv.split(":", 1) for kv in out.split() if ":" in kv and kv.split(":", 1)[1].isdigit())
    return int(fields.get("REG", 0)), int(fields.get("LOCAL", 0))


def compiler_words(error: Exception) -> str:
    """One line for a failed compile: the innermost error's last line (what is wrong) and the deepest place Triton
    names ("at L:C:" then the source from its function's def: a call inside a jitted helper nests one error a
    function)."""
    chain = []
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    text = lambda e: [line.strip() for line in str(e).splitlines() if line.strip()]  # noqa: E731
    inner = chain[-1]
    said = (text(inner) or [""])[-1][:200]
    for e in reversed(chain):
        lines = text(e)
        if len(lines) > 1 and lines[0].startswith("at ") and lines[1].startswith("def "):
            return f"{type(inner).__name__}: {said} (in {lines[1][4:].split('(')[0]}, {lines[0][3:].rstrip(':')})"
    return f"{type(inner).__name__}: {said}"


def build(record: dict, capability: int) -> dict:
    """One recorded kernel compiled for sm_`capability`: {"regs", "local", "shared"} or {"error": one line}. Where the
    target cannot hold its shared memory, what the launch runs there (kernels/fit.py): the kernel's next smaller
    configuration, and its next, with "fallback" (what changed) and "too_big" (the recorded tile's bytes)."""
    out, tried = compiled(record, capability), record
    while out.get("shared", 0) > MAX_SHARED[capability]:
        smaller = fallback(tried)
        if smaller is None:
            out["error"] = (f"needs {out['shared']:,} bytes of shared memory, sm_{capability} has "
                            f"{MAX_SHARED[capability]:,}" + (f" at {out['fallback']}, the launch's smallest"
                                                             if "fallback" in out else ""))
            break
        too_big = out.get("too_big", out["shared"])
        tried, out = smaller, compiled(smaller, capability)
        out.update(fallback=", ".join(f"{k}={v}" for k, v in smaller["changed"].items()), too_big=too_big)
    return out


def compiled(record: dict, capability: int) -> dict:
    """The record compiled for sm_`capability` as it is: {"regs", "local", "shared"} or {"error": one line}."""
    import triton
    from triton.backends.compiler import GPUTarget

    try:
        kernel = triton.compile(source(record, capability), target=GPUTarget("cuda", capability, 32),
                                options=record["options"])
        regs, local = usage(kernel.asm["cubin"])
    except Exception as e:  # the compiler's own words: what a user on that GPU would meet
        return {"error": compiler_words(e)}
    return {"regs": regs, "local": local, "shared": kernel.metadata.shared}


def fallback(record: dict) -> dict | None:
    """The record with its kernel's next smaller configuration (kernels/fit.py SMALLER, which the engine's launch
    takes where a device cannot hold a configuration's shared memory), "changed" naming what moved; None if the
    kernel has none."""
    from kernels import fit

    fn = resolve(record["fn"])
    if fn not in fit.SMALLER:
        return None
    names = [p.name for p in fn.params]
    index = {names[path[0]]: i for i, (path, _) in enumerate(record["constexprs"]) if len(path) == 1}
    cfg = {name: decode(record["constexprs"][i][1]) for name, i in index.items()} | record["options"]
    smaller = fit.SMALLER[fn](cfg)
    if smaller is None:
        return None
    changed = {k: v for k, v in smaller.items() if cfg.get(k) != v}
    out = {**record, "constexprs": [list(c) for c in record["constexprs"]], "options": dict(record["options"])}
    for k, v in changed.items():
        if k in index:
            out["constexprs"][index[k]] = [record["constexprs"][index[k]][0], encode(v)]
        else:
            out["options"][k] = v
    out["changed"] = {**record.get("changed", {}), **changed}
    return out


def name_of(record: dict) -> str:
    """The kernel and the constexprs that pick its tile (upper-case names), for the table."""
    fn = resolve(record["fn"])
    params = [p.name for p in fn.params]
    tiles = [f"{params[path[0]]}={v}" for path, v in record["constexprs"]
             if len(path) == 1 and params[path[0]].isupper() and not isinstance(v, dict)]
    return f"{record['fn'].rpartition(':')[2]} ({', '.join(tiles)}; {record['options'].get('num_warps', 4)} warps)"


# ---- step 1: record (CUDA) ------------------------------------------------------------------------------------
def recording(into: list) -> None:
    """From now on every Triton kernel this process compiles is appended to `into` (an entry) before it
    compiles: JITFunction takes triton.compiler.compile when it first runs on a device."""
    import triton
    import triton.compiler as compiler
    import triton.compiler.compiler as compiler_module
    import triton.runtime.jit as jit

    original = compiler.compile

    def compile(src, target=None, options=None, **kwargs):
        if isinstance(src, compiler.ASTSource):
            into.append(entry(src, options))
        return original(src, target=target, options=options, **kwargs)

    for module in (triton, compiler, compiler_module, jit):  # wherever a Triton version looks it up
        if getattr(module, "compile", None) is original:
            module.compile = compile


def workload(model: str, slice_model: bool, batch_invariant: bool = False, device: str = "cuda",
             prompts: int = 40) -> None:
    """Prompts through the engine that reach its kernels' forms: prefill chunks, decode at several batch sizes
    (CUDA graphs), greedy and sampled rows. `device` and `prompts` for a check of the workload itself on a CPU."""
    import random

    from engine import LLM, SamplingParams

    rng = random.Random(0)
    if slice_model:
        llm = LLM(model, device=device, max_num_batched_tokens=8192, max_num_seqs=64, max_model_len=16384)
        lengths = [10240] + [300] * 63  # steps of 8,192 x 3 and 4,564 tokens (kernels/fp4_moe.py config), then decode
    else:
        llm = LLM(model, device=device, max_num_batched_tokens=2048, batch_invariant=batch_invariant)
        lengths = [rng.randint(8, 900) for _ in range(prompts)]
    vocab = llm.engine.vocab_size
    ids = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    params = [SamplingParams(temperature=0.0 if i % 3 == 0 else 0.8, max_tokens=rng.randint(8, 24), ignore_eos=True)
              for i in range(len(ids))]
    outputs = llm.generate(ids, params, progress=False)
    assert all(len(o.token_ids) == p.max_tokens for o, p in zip(outputs, params))


def record(path: str, slice_model: bool) -> int:
    import torch
    import triton

    if not torch.cuda.is_available():
        print("--record needs a CUDA GPU and none is visible; run it on one, then compile its file anywhere.",
              file=sys.stderr)
        return 2
    kernels: list[dict] = []
    recording(kernels)
    workload("tiny-68m", False)
    workload("tiny-68m", False, batch_invariant=True)
    if slice_model:
        workload("v41-slice", True)
    unique = list({json.dumps(k, sort_keys=True): k for k in kernels}.values())
    if not unique:
        print(f"no kernel compile was seen: triton {triton.__version__} compiles by a path this script does not "
              "hook (benchmarks/portable.py `recording`).", file=sys.stderr)
        return 1
    with open(path, "w") as f:
        json.dump({"hardware": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "models": ["tiny-68m"] + (["v41-slice"] if slice_model else []), "kernels": unique}, f, indent=1)
    print(f"{len(unique)} kernels compiled for {torch.cuda.get_device_name()} written to {path}")
    return 0


# ---- step 2: compile for each target (anywhere) ---------------------------------------------------------------
def check(path: str, targets: list[int]) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    try:
        with open(path) as f:
            recorded = json.load(f)
        kernels = recorded["kernels"]
        assert isinstance(kernels, list) and all(isinstance(k, dict) and "fn" in k for k in kernels)
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as e:
        print(f"cannot read recorded kernels from {path}: {type(e).__name__}: {e}. Make it with --record.",
              file=sys.stderr)
        return 2
    results = []
    with Progress(transient=True) as bar:
        task = bar.add_task("compiling", total=len(kernels) * len(targets))
        for record_ in kernels:
            row = {}
            for capability in targets:
                row[capability] = build(record_, capability)
                bar.advance(task)
            results.append((record_, row))
    table = Table(title=f"{len(kernels)} kernels recorded on {recorded.get('hardware', '?')} (triton "
                        f"{recorded.get('triton', '?')}), compiled with triton {__import__('triton').__version__}")
    table.add_column("kernel (tile; warps)", no_wrap=True)
    for capability in targets:
        table.add_column(f"sm_{capability}: regs / local / shared KB")
    failures, fallbacks = [], []
    for record_, row in results:
        try:
            name = name_of(record_)
        except Exception:  # its function is gone: its row says so below
            name = record_["fn"]
        cells = []
        for capability in targets:
            r = row[capability]
            if "error" in r:
                failures.append(f"sm_{capability}: {name}: {r['error']}")
            elif "fallback" in r:
                fallbacks.append(f"sm_{capability}: {name}: needs {r['too_big']:,} bytes of shared memory, sm_"
                                 f"{capability} has {MAX_SHARED[capability]:,}; the launch takes {r['fallback']}")
            cells.append("FAILED (below)" if "error" in r else
                         f"{r['regs']} / {r['local']} / {r['shared'] / 1024:.0f}" + (" *" if "fallback" in r else ""))
        table.add_row(name, *cells)
    Console(width=200).print(table)
    for line in fallbacks:
        print(f"* builds smaller for {line}")
    for line in failures:
        print(f"does not build for {line}")
    for capability in targets:
        bad = sum("error" in row[capability] for _, row in results)
        print(f"sm_{capability}: {len(results) - bad} of {len(results)} kernels build"
              + (f", {bad} do not" if bad else ""))
    return 1 if failures else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file", help="the recorded kernels (JSON): written with --record, compiled without it")
    p.add_argument("--record", action="store_true", help="run the workload on this machine's GPU and record")
    p.add_argument("--slice", action="store_true", help="with --record: the v41-slice too (about 65 GB of GPU memory)")
    p.add_argument("--targets", default="80,90,100", help="compute capabilities to compile for, comma separated")
    a = p.parse_args()
    if a.record:
        return record(a.file, a.slice)
    try:
        targets = [int(t) for t in a.targets.split(",")]
    except ValueError:
        p.error(f"--targets takes compute capabilities like 80,90,100, not {a.targets!r}")
    unknown = [t for t in targets if t not in MAX_SHARED]
    if unknown:
        p.error(f"--targets: no shared-memory limit known for sm_{unknown[0]}; known: "
                f"{', '.join(map(str, MAX_SHARED))}")
    return check(a.file, targets)


if __name__ == "__main__":
    sys.exit(main())
