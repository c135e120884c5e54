"""benchmarks/portable.py: the engine's Triton kernels as compiled, recorded and compiled again for other GPUs (the
users' B200 is sm_100), off the GPU. Triton's compiler runs without one, but not under the interpreter that
tests/conftest.py sets: every step runs in a child process without TRITON_INTERPRET."""
import inspect
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# compiles kernels/head.py's kernel for sm_90 three times under portable.recording (as JITFunction would on an H100):
# a tile of 20-30 KB of shared memory, one of 4 stages of 144-192 KB (more than sm_120's 99 KB a block, within the
# others') and one whose vocab block is no power of two (tl.arange refuses it: it does not build anywhere); then
# kernels/fp8_gemm.py's dequantisation with the hardware e4m3 conversion an H100 picks; then writes the record
RECORD = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
sys.path.insert(0, "benchmarks")
import portable
from kernels import head
seen = []
portable.recording(seen)
signature = dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*fp32", M="i32", V="i32", K="i32", zero="fp32",
                 BF16="constexpr", BV="constexpr", BM="constexpr", BK="constexpr", PARTS="constexpr")
for tiles, stages in ((dict(BV=64, BM=16, BK=64), 3), (dict(BV=128, BM=64, BK=128), 4), (dict(BV=48, BM=16, BK=64), 3)):
    src = ASTSource(head._head_kernel, signature, constexprs=dict(BF16=True, PARTS=1, **tiles),
                    attrs={(i,): [["tt.divisibility", 16]] for i in range(6)})
    try:
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=stages))
    except Exception:
        pass  # recorded before it compiled, as a kernel a GPU run met would be
from kernels import fp8_gemm
src = ASTSource(fp8_gemm._dequant_kernel, dict(w_ptr="*u8", s_ptr="*u8", out_ptr="*bf16", N="i32", K="i32",
                HW_FP8="constexpr", BK="constexpr"), constexprs=dict(HW_FP8=True, BK=128), attrs={})
triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
json.dump({"hardware": "NVIDIA H100 80GB HBM3", "triton": triton.__version__, "kernels": seen}, open(sys.argv[1], "w"))
"""


# the sampler's launch as the engine makes it at 64 rows of the released vocab (kernels/sampling.py: its tile is by
# the shape alone), through its JITFunction, under a driver that can bind and compile but has nothing to launch on
LAUNCHED = """
import json, sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
sys.path.insert(0, "benchmarks")
import portable
from kernels import sampling


class NoGPU:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


driver.set_active(NoGPU())
seen = []
portable.recording(seen)
rows = torch.zeros(64, dtype=torch.int64)
try:
    sampling._sample_triton(torch.zeros(64, 129280), torch.ones(64), rows, rows)
except AttributeError as e:  # compiled, then the launch: NoGPU has no launcher
    assert "launcher" in str(e), e
json.dump({"hardware": "none", "triton": triton.__version__, "kernels": seen}, open(sys.argv[1], "w"))
"""


def child(*args: str, script: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT
    command = [sys.executable, "-c", script, *args] if script else [sys.executable, "benchmarks/portable.py", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    pytest.importorskip("triton")
    path = tmp_path_factory.mktemp("portable") / "kernels.json"
    made = child(str(path), script=RECORD)
    assert made.returncode == 0, made.stderr[-2000:]
    return path


def test_the_recorder_keeps_each_kernel_as_it_was_compiled(recorded):
    """portable.recording: every compile Triton makes is kept with its function, signature, constexprs (by argument
    index), attributes and launch options, the failed compile too."""
    kernels = json.loads(recorded.read_text())["kernels"]
    assert [k["fn"] for k in kernels] == ["kernels.head:_head_kernel"] * 3 + ["kernels.fp8_gemm:_dequant_kernel"]
    first = kernels[0]
    assert first["signature"]["x_ptr"] == "*bf16" and first["signature"]["BV"] == "constexpr"
    assert sorted(v for _, v in first["constexprs"] if not isinstance(v, bool)) == [1, 16, 64, 64]
    assert first["attrs"][0] == [[0], [["tt.divisibility", 16]]]
    assert first["options"] == {"num_warps": 4, "num_stages": 3} and kernels[1]["options"]["num_stages"] == 4


def test_recorded_kernels_compile_for_each_target_and_what_does_not_build_is_named(recorded):
    """Each recorded kernel compiled for sm_80, sm_90, sm_100 and sm_120: a row of registers / local / shared KB per
    target; the 4-stage tile fails on sm_120 alone (its shared memory a block), the vocab block of 48 everywhere with
    the compiler's own words; a count per target, and exit status 1."""
    run = child(str(recorded), "--targets", "80,90,100,120")
    assert run.returncode == 1, run.stderr[-2000:]
    out = run.stdout
    assert "compiled with triton" in out
    row = next(line for line in out.splitlines() if "BV=64, BM=16, BK=64; 4 warps)" in line)  # builds everywhere
    assert row.count(" / 0 / ") == 4 and "FAILED" not in row  # registers / no local memory / shared KB, per target
    assert "does not build for sm_120: _head_kernel (BF16=True, PARTS=1, BV=128, BM=64, BK=128; 4 warps): needs " in out
    assert "sm_120 has 101,376" in out and "sm_100 has" not in out and "sm_90 has" not in out
    power = "BV=48, BM=16, BK=64; 4 warps): ValueError: arange's range must be a power of 2 (in _head_kernel, 3:33)"
    for c in (80, 90, 100, 120):
        assert f"does not build for sm_{c}: _head_kernel (BF16=True, PARTS=1, {power}" in out
    assert out.count("does not build for") == 5 and out.count("FAILED (below)") == 5
    # the engine's one choice by the device (portable.BY_DEVICE): an A100 has no e4m3 conversion instruction, and
    # there the engine decodes the bits in integer arithmetic (kernels/fp8_gemm.py hw_fp8): it builds on all four
    row = next(line for line in out.splitlines() if "_dequant_kernel (" in line)
    assert row.count(" / 0 / ") == 4 and "FAILED" not in row
    assert "sm_80: 3 of 4 kernels build, 1 do not" in out
    assert "sm_100: 3 of 4 kernels build, 1 do not" in out
    assert "sm_120: 2 of 4 kernels build, 2 do not" in out


def test_portable_refuses_bad_input_with_one_sentence(tmp_path):
    """An unreadable record, a record of another shape, an unknown target, and --record without a GPU: one sentence
    and a non-zero exit status, no traceback."""
    pytest.importorskip("triton")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"kernels": [{"name": "x"}]}))
    for args in ((str(bad),), (str(other),), (str(tmp_path / "missing.json"),)):
        run = child(*args)
        assert run.returncode == 2 and run.stderr.startswith("cannot read recorded kernels from"), run.stderr
        assert "Traceback" not in run.stderr
    run = child(str(bad), "--targets", "75")
    assert run.returncode == 2 and "no shared-memory limit known for sm_75" in run.stderr
    run = child(str(tmp_path / "k.json"), "--record")
    if "needs a CUDA GPU" in run.stderr:  # this machine has none (CI); a GPU machine would record
        assert run.returncode == 2 and "Traceback" not in run.stderr


def test_the_recording_workload_runs_the_engine(monkeypatch):
    """The workload `--record` runs on a GPU, on the CPU at a few prompts: the engine serves them, greedy and
    sampled rows through chunked prefill and decode, each to its max_tokens (ignore_eos), in both modes."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import portable

    portable.workload("tiny-68m", False, device="cpu", prompts=3)
    portable.workload("tiny-68m", False, batch_invariant=True, device="cpu", prompts=2)


def test_the_recorder_sees_a_kernel_launched_through_its_jit_function(tmp_path):
    """`--record`'s hook on the path a launch takes (JITFunction binds the arguments and compiles through
    triton.compiler.compile), not only a direct compile: the sampler's launch at 64 rows is recorded with its tile
    and 16 warps, and builds for sm_80, sm_90 and sm_100."""
    pytest.importorskip("triton")
    path = tmp_path / "launched.json"
    made = child(str(path), script=LAUNCHED)
    assert made.returncode == 0, made.stderr[-2000:]
    (kernel,) = json.loads(path.read_text())["kernels"]
    assert kernel["fn"] == "kernels.sampling:_sample_kernel" and kernel["options"]["num_warps"] == 16
    assert kernel["signature"]["logits_ptr"] == "*fp32" and kernel["signature"]["seeds_ptr"] == "*i64"
    run = child(str(path), "--targets", "80,90,100")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "_sample_kernel (BLOCK=1024, SKIP=True; 16 warps)" in run.stdout
    assert all(f"sm_{c}: 1 of 1 kernels build" in run.stdout for c in (80, 90, 100))


def test_a_tile_too_big_for_a_target_is_compiled_as_the_launch_falls_back(tmp_path):
    """Sparse attention at the slice's widths (64 heads of 512 a program on 8 warps, a chunk's tile, as an H100
    records it) takes more shared memory on sm_100 and sm_120 than a block may have; the launch then takes its next
    smaller configuration (kernels/fit.py, kernels/attention.py `smaller`): 32 heads a program on sm_100, 16 on
    sm_120. The table compiles what the engine would run there, marks the row, says why, and every target builds."""
    pytest.importorskip("triton")
    from kernels import attention

    kernel = attention._sparse_attn_kernel  # in this process under the interpreter (tests/conftest.py)
    names = list(inspect.signature(getattr(kernel, "fn", kernel)).parameters)
    kinds = dict(q_ptr="*bf16", sink_ptr="*fp32", idx_ptr="*i64", out_ptr="*bf16", scale="fp32", kv_ptr="*bf16",
                 ring_delta="i64", pool_delta="i64", slots_ptr="*i64", tables_ptr="*i64", freqs_ptr="*bf16")
    tiles = dict(PER_BLOCK=64, D=512, BLOCK_H=64, BLOCK=64, HAS_RING=True, HAS_POOL=True, ROPE=0, BF16=True,
                 PREFETCH=False)
    record = {"fn": "kernels.attention:_sparse_attn_kernel",
              "signature": {n: "constexpr" if n in tiles else kinds.get(n, "i32") for n in names},
              "constexprs": [[[names.index(n)], v] for n, v in tiles.items()],
              "attrs": [[[i], [["tt.divisibility", 16]]] for i, n in enumerate(names)  # as the H100's launch had
                        if n not in tiles and n not in ("scale", "slots_ptr")],
              "options": {"num_warps": 8, "num_stages": 2}}
    path = tmp_path / "attention.json"
    path.write_text(json.dumps({"hardware": "NVIDIA H100 80GB HBM3", "kernels": [record]}))
    run = child(str(path), "--targets", "90,100,120")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    out = run.stdout
    row = next(line for line in out.splitlines() if "_sparse_attn_kernel (" in line)
    assert row.count(" *") == 2  # sm_100 and sm_120 run a smaller tile; sm_90 the recorded one
    assert "sm_100 has 232,448; the launch takes BLOCK_H=32" in out
    assert "sm_120 has 101,376; the launch takes BLOCK_H=16" in out
    assert all(f"sm_{c}: 1 of 1 kernels build" in out for c in (90, 100, 120))
