"""Issue #20 item 3, compiled on the GPU: kernels/fp8_gemm.py at the v41-slice's dense shapes and
kernels/fp4_moe.py over 384 full-width FP4 experts, against their torch paths; and model/moe.py's grouped
path over FP4 experts against the masked one. Tolerances as tests/test_fp4_kernels.py explains (the same
exact products, summed in fp32 in another order, then the same roundings). Skipped without CUDA."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from test_fp4_kernels import fp8_shared_expert, plan_case, within_fp32_sum_and_bf16_rounding  # noqa: E402

from kernels import fp4_moe, fp8_gemm  # noqa: E402
from kernels.quant import act_quant_fp8  # noqa: E402
from model.quant import dequantize_fp8_tiles, quantize_fp4_e8m0, quantize_fp8_tiles  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# the slice's FP8 linears (out, in): wq_a, wq_b, wkv, wo_b, the shared expert's w1 and w2, the indexer's wq_b
DENSE = [(1280, 5120), (32768, 1280), (512, 5120), (5120, 8192), (2304, 5120), (5120, 2304), (4096, 1280)]


def report(name, got, want):
    diff = (got.float() - want.float()).abs()
    print(f"{name}: {(got != want).float().mean().item():.3%} of values differ, max {diff.max().item():.3g} "
          f"(largest value {want.float().abs().max().item():.3g})")


@pytest.mark.parametrize("M", [1, 16, 64, 2048])
@pytest.mark.parametrize("N,K", DENSE)
def test_compiled_fp8_gemm_matches_the_torch_path(M, N, K):
    g = torch.Generator(device="cuda").manual_seed(M + N + K)
    codes, scale = quantize_fp8_tiles(torch.randn(N, K, device="cuda", generator=g) * 0.03)
    xq = act_quant_fp8(torch.randn(M, K, device="cuda", generator=g).bfloat16(), 32)
    want = fp8_gemm.fp8_gemm_reference(xq, codes, scale)  # dequantise to bf16, cuBLAS
    w = dequantize_fp8_tiles(codes, scale)
    for hw, swap in [(True, False), (False, False), (True, True)]:  # the hardware e4m3 conversion and the integer
        # decode of sm_80; the product transposed (the weight the dot's first operand) and not
        got = fp8_gemm.fp8_gemm(xq, codes, scale, hw=hw, cfg=(*fp8_gemm.config(M, N, K)[:4], swap))  # at any M
        assert within_fp32_sum_and_bf16_rounding(got, xq, w)
        torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-5)
        if M >= fp8_gemm.DEQUANT_ROWS:  # a prefill chunk's path: the weight decoded once, the torch path's product
            assert torch.equal(fp8_gemm.fp8_gemm(xq, codes, scale, hw=hw), want)
    report(f"fp8_gemm M={M} N={N} K={K}", got, want)


@pytest.fixture(scope="module")
def experts():
    """384 experts of the slice's widths (dim 5120, inter 2304) in the released storage: ~6.8 GB."""
    g = torch.Generator(device="cuda").manual_seed(0)
    E, D, inter = 384, 5120, 2304
    w13 = torch.empty(E, 2 * inter, D // 2, dtype=torch.uint8, device="cuda")
    s13 = torch.empty(E, 2 * inter, D // 32, dtype=torch.uint8, device="cuda")
    w2 = torch.empty(E, D, inter // 2, dtype=torch.uint8, device="cuda")
    s2 = torch.empty(E, D, inter // 32, dtype=torch.uint8, device="cuda")
    for e in range(E):
        for codes, scales, shape in ((w13, s13, (2 * inter, D)), (w2, s2, (D, inter))):
            c, s = quantize_fp4_e8m0(torch.randn(shape, device="cuda", generator=g) * 0.02)
            codes[e], scales[e] = c, s.view(torch.uint8)
    return w13, s13, w2, s2


@pytest.mark.parametrize("N", [1, 16, 64, 2048])
def test_compiled_fp4_moe_matches_the_official_loop(N, experts):
    """Against the per-expert loop with each FP4 weight dequantised to bf16 (the torch path). Tolerance:
    tests/test_fp4_kernels.py (an ulp of g, u or w2's output, and an FP8 code of the hidden moved a step)."""
    g = torch.Generator(device="cuda").manual_seed(N)
    E = experts[0].size(0)
    x = torch.randn(N, 5120, device="cuda", generator=g).bfloat16()
    ids = torch.rand(N, E, device="cuda", generator=g).topk(6, dim=-1).indices
    weights = torch.rand(N, 6, device="cuda", generator=g) * 0.5
    shared = torch.randn(N, 5120, device="cuda", generator=g).bfloat16() * 0.1
    want = fp4_moe.moe_reference(x, weights, ids, *experts, 10.0, shared)
    for hw in (True, False):
        got = fp4_moe.moe(x, weights, ids, *experts, 10.0, shared, hw=hw)
        torch.testing.assert_close(got, want, rtol=0, atol=2**-5 * want.abs().max().item())
        assert (got == want).float().mean() > 0.5
    report(f"fp4 moe N={N}", got, want)


def routed_inputs(N: int, E: int, seed: int):
    """N rows of the slice's width act_quant'd, routing weights and top-6 ids among E experts: routed_experts's."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    xq = act_quant_fp8(torch.randn(N, 5120, device="cuda", generator=g).bfloat16(), 32)
    ids = torch.rand(N, E, device="cuda", generator=g).topk(6, dim=-1).indices
    return xq, torch.rand(N, 6, device="cuda", generator=g) * 0.5, ids


@pytest.mark.parametrize("N", [1, 64, 2048, 8192])  # the three tiers of fp4_moe.config
def test_compiled_fp4_decodes_give_the_same_bits(N, experts):
    """The bit decode (the default: a code's bf16 pattern times 2^(s-1) in a bf16 multiply, the subnormal
    pattern of code 1 included) and the e4m3 decode (cfg B=0) give the same outputs bit for bit at the slice's
    widths: the same weight values reach the same dots."""
    xq, weights, ids = routed_inputs(N, experts[0].size(0), seed=N + 1)
    want, _ = fp4_moe.routed_experts(xq, weights, ids, *experts, 10.0, cfg=dict(B=0))
    got, _ = fp4_moe.routed_experts(xq, weights, ids, *experts, 10.0)
    assert torch.equal(got, want)


@pytest.mark.parametrize("N", [1, 64, 2048, 8192])
def test_compiled_codes_in_one_load_give_the_same_bits(N, experts):
    """An iteration's U groups of codes one load (`_code_groups`), compiled at the slice's widths in each tier's
    tile: U = 2 (the default) and 4 give U = 1's outputs (a group a load) bit for bit."""
    xq, weights, ids = routed_inputs(N, experts[0].size(0), seed=N + 2)
    want, _ = fp4_moe.routed_experts(xq, weights, ids, *experts, 10.0, cfg=dict(U=1))
    for U in (2, 4):
        got, _ = fp4_moe.routed_experts(xq, weights, ids, *experts, 10.0, cfg=dict(U=U))
        assert torch.equal(got, want), U


@pytest.mark.parametrize("N,BM", [(1, 16), (64, 16), (256, 16), (682, 16), (64, 64)])  # 682 x 6: PLAN_PAIRS's
def test_the_plans_one_launch_gives_the_torch_ops_values(N, BM):
    """plan's one launch, compiled, against its torch ops at the slice's 384 experts: pairs, tiles and slots."""
    ids = plan_case(N, 384, 6, seed=N, device="cuda")
    for got, want in zip(fp4_moe.plan(ids, 384, BM, one_launch=True), fp4_moe.plan(ids, 384, BM, one_launch=False)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("N", [1, 64, 256, 2048])  # 2,048: a prefill chunk (fp8_gemm's dequantised product)
def test_the_shared_expert_in_fewer_launches_gives_the_fp8_linears_bits(N):
    """shared_expert at the slice's widths against Expert.forward through the FP8Linears' CUDA path, bit for bit."""
    expert = fp8_shared_expert(5120, 2304, seed=N, device="cuda")
    x = (torch.randn(N, 5120, device="cuda", generator=torch.Generator(device="cuda").manual_seed(N)) * 2).bfloat16()
    assert torch.equal(fp4_moe.shared_expert(expert, x), expert(x))


@pytest.mark.parametrize("N", [1, 64, 2048])
def test_moe_forward_quantising_x_once_gives_the_same_bits(N):
    """moe_forward (x quantised once for the routed and the shared experts, the shared expert in fewer launches)
    against `moe` with the shared expert through its own FP8Linears, on the micro model in the released storage."""
    from model.config import preset
    from model.slice import build_slice

    model, _ = build_slice(preset("micro"), seed=0, device="cuda")
    moe = model.layers[3].ffn
    x = (torch.randn(N, 64, device="cuda", generator=torch.Generator(device="cuda").manual_seed(N)) * 2).bfloat16()
    with torch.inference_mode():
        weights, ids = moe.gate(x)
        want = fp4_moe.moe(x, weights, ids, *fp4_moe.fp4_stacked(moe), moe.shared_experts.limit, moe.shared_experts(x))
        assert torch.equal(fp4_moe.moe_forward(moe, x, weights, ids), want)


def test_grouped_moe_over_fp4_experts_matches_the_masked_path():
    """model/moe.py on CUDA: the grouped path (kernels/fp4_moe.py, FP8 shared expert through fp8_gemm) against
    the masked one (every expert's FP4Linear dequantising, the torch FP8Linear), on a micro model in the
    released storage; and the grouped path replays from a CUDA graph with the same bits."""
    from model.config import preset
    from model.moe import MoE
    from model.slice import build_slice

    model, _ = build_slice(preset("micro"), seed=0, device="cuda")
    moe = model.layers[3].ffn
    assert moe.grouped and fp4_moe.fp4_experts(moe)
    x = (torch.randn(37, 64, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0)) * 2).bfloat16()
    with torch.inference_mode():
        got = moe(x)
        MoE.grouped = False
        try:
            import kernels.fp8_gemm as k
            applies, k.applies = k.applies, lambda x: False  # the shared expert's torch path too
            want = moe(x)
        finally:
            MoE.grouped, k.applies = True, applies
        torch.testing.assert_close(got, want, rtol=0, atol=2**-5 * want.abs().max().item())
        report("MoE grouped FP4 vs masked", got, want)
        graph, static_x = torch.cuda.CUDAGraph(), x.clone()
        moe(static_x)  # warm-up outside the capture
        with torch.cuda.graph(graph):
            static_y = moe(static_x)
        graph.replay()
        assert torch.equal(static_y, got)
