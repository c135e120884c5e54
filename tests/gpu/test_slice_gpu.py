"""The full-width slice on the GPU (issue #20 item 1): `mdi-trace record --model v41-slice --device cuda` on a
few prompts long enough for the top-k (512 entries) to bind at every compressed layer, then `check` of that
trace re-executes to identical tokens. The weights (~57 GB: FP4 experts, FP8 dense) are made on the GPU from
seed 0 at each load (model/slice.py), so record and check each build them and must agree on the digest.
Needs an 80 GB card (an H100's 79.2 GiB is enough); tests/test_slice.py runs the same path at narrow widths on
the CPU."""
import gc
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GIB = 1 << 30
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_properties(0).total_memory < 75 * GIB,
                       reason="the v41-slice weights take ~57 GB of GPU memory: an 80 GB card (79.2 GiB) or more"),
]

# 4 prompts of 1100-1300 tokens (ratio-2 layers: 550+ entries, ratio-1: 1100+, top-k 512), 8 tokens each; the
# first prefill step takes 4,096 tokens of them, a chunk large enough for the prefill forms of the handoff and
# the gate (kernels/hc.py CHUNK_ROWS, kernels/moe.py TC_ROWS), the second the rest
CHUNK = 4096
WORKLOAD = ["--num-prompts", "4", "--input-len", "1100:1300", "--output-len", "8:8", "--cancel-rate", "0",
            "--max-num-seqs", "4", "--max-num-batched-tokens", str(CHUNK), "--num-kv-blocks", "48"]


def test_a_slice_trace_recorded_on_cuda_checks_to_identical_tokens(tmp_path, capsys):
    from kernels.hc import CHUNK_ROWS
    from kernels.moe import TC_ROWS
    from tracing.execute import check_tokens
    from tracing.reader import open_trace
    from tracing.verify import verify
    from tui.cli import main

    assert CHUNK >= max(CHUNK_ROWS, TC_ROWS)

    trace = tmp_path / "slice.mdt"
    assert main(["record", "-o", str(trace), "--model", "v41-slice", "--device", "cuda", *WORKLOAD]) == 0
    gc.collect()
    torch.cuda.empty_cache()  # the recording's weights are gone before check builds them again
    t = open_trace(trace)
    assert t.header["model_source"] == "v41-slice" and len(t.header["checkpoint_digest"]) == 64
    assert verify(t) == []
    r = check_tokens(t, device="cuda")
    with capsys.disabled():
        print(f"\nv41-slice digest {t.header['checkpoint_digest']}: {r.steps} steps re-executed, {r.tokens} tokens "
              f"compared, mismatch {r.mismatch}, same platform {r.same_platform}")
    assert r.mismatch is None and r.same_platform and r.tokens == 32
