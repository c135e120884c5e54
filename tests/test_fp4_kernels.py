"""kernels/fp8_gemm.py and kernels/fp4_moe.py (issue #20 item 3) against their torch paths, under Triton's
CPU interpreter (conftest sets TRITON_INTERPRET=1 without CUDA) at tiny shapes; tests/gpu/test_fp4_gpu.py
runs them compiled at the v41-slice's shapes.

What may differ, and so the tolerances: both sides compute the same exact products (an e4m3 or e2m1 code
times a power-of-two scale is exact in bf16, and the product of two such values exact in fp32), summed in
fp32 in another order (the kernel's K blocks, or its split, against torch's GEMM), then rounded to bf16. An
fp32 sum of K terms in any order is within K·2^-24·Σ|terms| of the exact one (Higham's γ_K), and the bf16
rounding adds half an ulp (2^-9 relative). Under the interpreter the kernels also round to bf16 on the bits
(its cast truncates) and dot in fp32 (it has no bf16 matmul): the same values as the compiled bf16 MMA.
"""
import inspect
import os

import pytest
import torch

from kernels import fp4_moe, fp8_gemm
from model.quant import act_quant_fp8, dequantize_fp8_tiles, quantize_fp4_e8m0, quantize_fp8_tiles

needs_interpreter = pytest.mark.skipif(
    fp8_gemm.triton is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs Triton's interpreter (TRITON_INTERPRET=1, set by conftest without CUDA); tests/gpu covers CUDA")


def within_fp32_sum_and_bf16_rounding(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    """|got - x·wᵀ| <= 2^-8·|x·wᵀ| + K·2^-24·(|x|·|w|ᵀ), against the exact (fp64) product: one bf16 ulp
    (twice the half ulp of a correct rounding, room for the sum's own error crossing a rounding boundary)
    plus the worst-case error of an fp32 sum of K terms in any order."""
    exact = x.double() @ w.double().T
    bound = exact.abs() * 2**-8 + x.size(-1) * 2**-24 * (x.double().abs() @ w.double().abs().T)
    return bool(((got.double() - exact).abs() <= bound).all())


@needs_interpreter
@pytest.mark.parametrize("M,N,K", [(5, 80, 96), (3, 64, 256), (40, 80, 96)])  # a partial tile of rows and of K;
# a K split; 40 rows: the product transposed by `config`
@pytest.mark.parametrize("hw", [True, False])  # the e4m3 decode: hardware cast, or integer arithmetic (sm_80)
def test_fp8_gemm_matches_the_dequantise_then_bf16_path(M, N, K, hw):
    g = torch.Generator().manual_seed(M * N + K)
    codes, scale = quantize_fp8_tiles(torch.randn(N, K, generator=g) * 0.05)
    xq = act_quant_fp8(torch.randn(M, K, generator=g).bfloat16(), 32)  # as FP8Linear quantises it
    want = fp8_gemm.fp8_gemm_reference(xq, codes, scale)  # the torch path: dequantised to bf16, F.linear
    for split, cfg in [(None, None), (2, None), (None, (16, 32, 32, 4, True)), (2, (16, 32, 32, 4, True))]:
        got = fp8_gemm.fp8_gemm(xq, codes, scale, split=split, hw=hw, cfg=cfg)  # and the product transposed
        assert got.dtype == torch.bfloat16 and got.shape == (M, N)
        assert within_fp32_sum_and_bf16_rounding(got, xq, dequantize_fp8_tiles(codes, scale))
        # against the torch path: the two roundings of the same exact sum may differ by one bf16 ulp
        torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-6)


@needs_interpreter
@pytest.mark.parametrize("hw", [True, False])
def test_a_prefill_chunks_fp8_gemm_is_the_torch_paths_product(hw, monkeypatch):
    """From DEQUANT_ROWS rows fp8_gemm decodes the weight once (`dequantize`: model/quant.py's values, bit for
    bit, partial tiles of rows and columns included) and multiplies as the torch path does: its bits. Below,
    the kernel; `cfg` still forces it at any row count (benchmarks, the GPU tests)."""
    g = torch.Generator().manual_seed(7)
    N, K = 80, 96  # 2.5 tile rows, 3 tiles of K: the dequantisation's masked edges
    spread = torch.logspace(-3, 0, N)[:, None] * torch.logspace(0, 2, K)[None, :]  # every tile its own scale
    codes, scale = quantize_fp8_tiles(torch.randn(N, K, generator=g) * spread)
    assert scale.float().unique().numel() > 4
    assert torch.equal(fp8_gemm.dequantize(codes, scale, hw), dequantize_fp8_tiles(codes, scale).bfloat16())
    monkeypatch.setattr(fp8_gemm, "DEQUANT_ROWS", 12)
    seen = []
    real = fp8_gemm.dequantize
    monkeypatch.setattr(fp8_gemm, "dequantize", lambda *a: seen.append(a) or real(*a))
    xq = act_quant_fp8(torch.randn(2, 6, K, generator=g).bfloat16(), 32)  # 12 rows: the chunk's path
    assert torch.equal(fp8_gemm.fp8_gemm(xq, codes, scale, hw=hw), fp8_gemm.fp8_gemm_reference(xq, codes, scale))
    assert len(seen) == 1
    fp8_gemm.fp8_gemm(xq[:1], codes, scale, hw=hw)  # 6 rows: the kernel
    fp8_gemm.fp8_gemm(xq, codes, scale, hw=hw, cfg=(16, 32, 32, 4, False))
    assert len(seen) == 1


def fp4_experts(E: int, D: int, inter: int, seed: int):
    """Random experts in the released storage, stacked as kernels/fp4_moe.py fp4_stacked gives them."""
    g = torch.Generator().manual_seed(seed)
    q13 = [quantize_fp4_e8m0(torch.randn(2 * inter, D, generator=g) * 0.1) for _ in range(E)]
    q2 = [quantize_fp4_e8m0(torch.randn(D, inter, generator=g) * 0.1) for _ in range(E)]
    return tuple(torch.stack([q[i] for q in qs]) for qs in (q13, q2) for i in (0, 1))


def moe_inputs(N: int, k: int, E: int, D: int, seed: int):
    """x bf16 [N, D], routing weights [N, k], k distinct expert ids of E a row, a shared expert's output."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(N, D, generator=g) * 2).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    return x, torch.rand(N, k, generator=g), ids, torch.randn(N, D, generator=g).bfloat16()


@needs_interpreter
@pytest.mark.parametrize("N,k", [(1, 2), (9, 3)])  # decode-like (one row) and several rows per expert
def test_fp4_moe_matches_the_official_loop(N, k):
    """kernels/fp4_moe.py against its torch path (the per-expert loop, each FP4 weight dequantised to bf16).
    Tolerance: the GEMM outputs g, u and w2's are the same exact sums in another fp32 order, each rounded
    to bf16, so one may land an ulp away (2^-8); through SwiGLU and the hidden's FP8 act_quant an ulp can
    move one e4m3 code one step (2^-4 relative of that term): 2^-5 of the output's largest value covers a few
    such flips among an output's terms. At these sizes the sums agree and so do the bits (checked: most)."""
    E, D, inter = 8, 64, 96  # inter 96: 3 scale groups, which the decode tile's U = 2 does not divide
    w13, s13, w2, s2 = fp4_experts(E, D, inter, seed=N)
    x, weights, ids, shared = moe_inputs(N, k, E, D, seed=100 + N)
    want = fp4_moe.moe_reference(x, weights, ids, w13, s13, w2, s2, 10.0, shared)
    got = fp4_moe.moe(x, weights, ids, w13, s13, w2, s2, 10.0, shared, hw=N > 1)  # both decodes, one each
    assert got.dtype == torch.bfloat16 and got.shape == (N, D)
    torch.testing.assert_close(got, want, rtol=0, atol=2**-5 * want.abs().max().item())
    assert (got == want).float().mean() > 0.9


def test_the_plan_tiles_every_pair_once_by_expert():
    """plan (torch ops only): pairs sorted by expert, tiles of one expert each covering its pairs once,
    the bound's spare tiles dead; each row's slots in ascending expert id."""
    if fp4_moe.triton is None:
        pytest.skip("needs Triton")
    g = torch.Generator().manual_seed(0)
    E, k, BM = 16, 4, 16
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(40)])
    ids[:30, 0] = 3  # one expert with 30 rows: two tiles
    pairs, tiles, slots = fp4_moe.plan(ids, E, BM)
    flat = ids.reshape(-1)
    assert tiles.size(0) == -(-ids.numel() // BM) + E
    covered = torch.zeros(ids.numel(), dtype=torch.int64)
    for e, row0, end in tiles.tolist():
        if e < 0:
            continue
        assert 0 < end - row0 <= BM and (flat[pairs[row0:end]] == e).all()
        covered[row0:end] += 1
    assert (covered == 1).all()
    position = torch.empty_like(pairs).scatter_(0, pairs, torch.arange(pairs.numel()))
    assert torch.equal(flat[pairs[slots]], ids.sort(dim=-1).values)
    assert torch.equal(position[pairs], torch.arange(pairs.numel()))


def plan_case(N: int, E: int, k: int, seed: int, device: str = "cpu") -> torch.Tensor:
    """Top-k ids [N, k] over E experts with one expert in half the rows (several tiles of it) and the rest random."""
    g = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(N, E, device=device, generator=g)
    scores[: N // 2, 7 % E] = 2.0
    return scores.topk(k, dim=-1).indices


@needs_interpreter
@pytest.mark.parametrize("N,E,k,BM", [(1, 384, 6, 16), (64, 384, 6, 16), (341, 384, 6, 16), (40, 16, 4, 16),
                                      (300, 16, 4, 64), (0, 16, 4, 16)])  # 341 x 6 = 2,046 pairs: 32 programs
def test_the_plans_one_launch_gives_the_torch_ops_values(N, E, k, BM):
    """plan's one launch (`_plan_kernel`) against its torch ops: pairs, tiles (dead ones included) and slots equal."""
    ids = plan_case(N, E, k, seed=N + E)
    got = fp4_moe.plan(ids, E, BM, one_launch=True)
    want = fp4_moe.plan(ids, E, BM, one_launch=False)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


def fp8_shared_expert(dim: int, inter: int, seed: int, device: str = "cpu"):
    """model/moe.py Expert with FP8Linears (model/released.py) of random codes and block scales, limit 10."""
    from model.moe import Expert
    from model.released import FP8Linear

    g = torch.Generator(device=device).manual_seed(seed)
    expert = Expert(dim, inter, 10.0)
    for name, (n_in, n_out) in (("w1", (dim, inter)), ("w3", (dim, inter)), ("w2", (inter, dim))):
        lin = FP8Linear(n_in, n_out)
        lin.weight.data, lin.scale.data = quantize_fp8_tiles(torch.randn(n_out, n_in, device=device, generator=g)
                                                             * n_in ** -0.5)
        setattr(expert, name, lin)
    return expert


@needs_interpreter
@pytest.mark.parametrize("limit", [10.0, 0.0])
def test_the_shared_experts_swiglu_and_quant_launch_matches_the_torch_lines(limit):
    """`_swiglu_quant_kernel` against Expert.forward's lines and w2's act_quant (model/quant.py): the same values
    but where the interpreter's silu (an fp64 exp) and torch's CPU one differ by an fp32 ulp that the roundings
    keep (at most one e4m3 step: tests/gpu compares the compiled launch bit for bit)."""
    g = torch.Generator().manual_seed(3)
    gate, up = ((torch.randn(5, 96, generator=g) * 8).bfloat16() for _ in range(2))  # past the clamps
    got = fp4_moe.swiglu_quant(gate, up, limit)
    u, gf = up.float(), gate.float()
    if limit:
        u, gf = u.clamp(-limit, limit), gf.clamp(max=limit)
    want = act_quant_fp8((torch.nn.functional.silu(gf) * u).bfloat16(), 32)
    assert got.dtype == torch.bfloat16 and (got == want).float().mean() > 0.99
    torch.testing.assert_close(got, want, rtol=2 ** -3, atol=0)


@needs_interpreter
def test_the_shared_expert_in_fewer_launches_matches_expert_forward():
    """kernels/fp4_moe.py shared_expert (x quantised once, the SwiGLU and w2's act_quant in one launch) against
    Expert.forward's torch path (CPU): three FP8 products, so within a few percent overall (tests/gpu: the
    same bits as the CUDA FP8Linears); w1 and w3 swapped, or no clamp, are far outside it."""
    expert = fp8_shared_expert(64, 96, seed=5)
    x = (torch.randn(7, 64, generator=torch.Generator().manual_seed(6)) * 4).bfloat16()
    got, want = fp4_moe.shared_expert(expert, x).float(), expert(x).float()
    assert (got - want).norm() / want.norm() < 0.02


def test_stacking_fp4_experts_keeps_the_parameters_as_views():
    """kernels/fp4_moe.py fp4_stacked: the experts' parameters become views into the stacked bytes (no second
    copy), with their names, shapes, dtypes and values; an in-place change is seen through the stack."""
    from model.config import preset
    from model.released import FP4Linear, Storage, storage_model

    args = preset("micro")
    model = storage_model(args, Storage()).to_empty(device="cpu")
    moe = model.layers[0].ffn
    assert moe.grouped and fp4_moe.fp4_experts(moe)  # the grouped path now takes FP4 experts
    g = torch.Generator().manual_seed(0)
    before = {}
    for n, p in moe.experts.named_parameters():
        p.data = torch.randint(0, 120, p.shape, generator=g, dtype=torch.uint8).view(p.dtype)
        before[n] = (p.shape, p.dtype, p.view(torch.uint8).clone())
    w13, s13, w2, s2 = fp4_moe.fp4_stacked(moe)
    inter = args.moe_inter_dim
    assert w13.shape == (args.n_routed_experts, 2 * inter, args.dim // 2) and s2.shape == (8, args.dim, inter // 32)
    for n, p in moe.experts.named_parameters():
        shape, dtype, values = before[n]
        assert p.shape == shape and p.dtype == dtype and torch.equal(p.view(torch.uint8), values)
    e3 = moe.experts[3]
    assert isinstance(e3.w3, FP4Linear)
    assert e3.w3.weight.untyped_storage().data_ptr() == w13.untyped_storage().data_ptr()
    with torch.no_grad():
        e3.w3.scale.view(torch.uint8).add_(1)
    assert torch.equal(s13[3, inter:], e3.w3.scale.view(torch.uint8))
    assert fp4_moe.fp4_stacked(moe)[0] is w13  # cached while no parameter is replaced


@needs_interpreter
def test_scales_past_the_bit_decodes_range_take_the_e4m3_decode(monkeypatch):
    """moe_forward decodes the codes by bit patterns only while every scale byte is at most
    BIT_DECODE_MAX_SCALE (the multiplier 2^(s-1) a finite bf16), found once at stacking; one scale above it
    (a replaced parameter: restacked) sends the experts through the e4m3 decode, which still gives the official
    loop's outputs."""
    from model.config import preset
    from model.released import Storage, storage_model

    args = preset("micro")
    model = storage_model(args, Storage()).to_empty(device="cpu")
    moe = model.layers[0].ffn
    g = torch.Generator().manual_seed(1)
    for e in moe.experts:
        for lin in (e.w1, e.w3, e.w2):
            codes, scale = quantize_fp4_e8m0(torch.randn(lin.weight.size(0), 2 * lin.weight.size(1), generator=g))
            lin.weight.data, lin.scale.data = codes.view(lin.weight.dtype), scale.view(lin.scale.dtype)
    for p in moe.shared_experts.parameters():  # to_empty's memory: zero codes, so a zero shared output
        p.data.view(torch.uint8).zero_()
    seen = []
    real = fp4_moe.routed_experts
    cfg_of = lambda *a, **k: inspect.signature(real).bind(*a, **k).arguments.get("cfg")
    monkeypatch.setattr(fp4_moe, "routed_experts", lambda *a, **k: seen.append(cfg_of(*a, **k)) or real(*a, **k))
    x, weights, ids, _ = moe_inputs(5, args.n_activated_experts, args.n_routed_experts, args.dim, seed=3)
    x = x.bfloat16()
    fp4_moe.moe_forward(moe, x, weights, ids)
    assert moe._stacked[5] and seen[-1] is None  # in range: the default (bit decode)
    big = moe.experts[2].w2.scale.view(torch.uint8).clone()
    big[0, 0] = fp4_moe.BIT_DECODE_MAX_SCALE + 1
    moe.experts[2].w2.scale.data = big.view(moe.experts[2].w2.scale.dtype)
    got = fp4_moe.moe_forward(moe, x, weights, ids)
    assert not moe._stacked[5] and seen[-1] == dict(B=0)
    w13, s13, w2, s2 = fp4_moe.fp4_stacked(moe)
    want = fp4_moe.moe_reference(x, weights, ids, w13, s13, w2, s2, moe.shared_experts.limit, moe.shared_experts(x))
    torch.testing.assert_close(got, want, rtol=0, atol=2**-5 * want.abs().max().item())


@needs_interpreter
def test_fp4_moe_in_the_dots_slot_order_matches_the_official_loop():
    """cfg KS=1 walks each group's K in the dot's slot order (`_slot_k`, a permutation of the 32, x's rows read
    in the same order; decode's default): the official loop's outputs within the tolerance above, the K-order
    kernel's (KS=0) within its sums' order, and both decodes in that order give the same bits. A slot order that
    x did not follow would pair other products (checked: these fail)."""
    E, D, inter, N, k = 8, 64, 96, 9, 3
    from kernels.quant import act_quant_fp8

    assert sorted(fp4_moe._slot_k(torch.arange(32)).tolist()) == list(range(32))
    w13, s13, w2, s2 = fp4_experts(E, D, inter, seed=13)
    x, weights, ids, shared = moe_inputs(N, k, E, D, seed=213)
    xq = act_quant_fp8(x, 32)
    want = fp4_moe.moe_reference(x, weights, ids, w13, s13, w2, s2, 10.0, shared)
    k_order, slots = fp4_moe.routed_experts(xq, weights, ids, w13, s13, w2, s2, 10.0, cfg=dict(KS=0))  # K order
    slot_order, _ = fp4_moe.routed_experts(xq, weights, ids, w13, s13, w2, s2, 10.0, cfg=dict(KS=1))  # decode's default
    torch.testing.assert_close(fp4_moe.combine(slot_order, slots, shared), want, rtol=0,
                               atol=2**-5 * want.abs().max().item())
    torch.testing.assert_close(slot_order.float(), k_order.float(), rtol=2**-6, atol=2**-5 * k_order.abs().max().item())
    assert (slot_order == k_order).float().mean() > 0.9
    e4m3, _ = fp4_moe.routed_experts(xq, weights, ids, w13, s13, w2, s2, 10.0, cfg=dict(KS=1, B=0))
    assert torch.equal(e4m3, slot_order)


@needs_interpreter
@pytest.mark.parametrize("D,inter,U", [(128, 256, 4), (96, 160, 2)])
def test_fp4_moe_decodes_give_the_same_bits(D, inter, U):
    """The bit decode (the default) and the e4m3 decode (cfg B=0) give the same outputs bit for bit, and the
    default's are the official loop's within the tolerance above: with U = 4 groups an iteration (4 and 8
    groups: a word of four scales a row), and with U = 2 over 3 and 5 groups, which U does not divide, so an
    iteration takes one group. The scales differ from row to row and group to group, so a byte taken from the
    wrong group shows; every code occurs, both signs."""
    E, N, k = 4, 7, 2
    from kernels.quant import act_quant_fp8

    w13, s13, w2, s2 = fp4_experts(E, D, inter, seed=5)
    x, weights, ids, shared = moe_inputs(N, k, E, D, seed=205)
    xq = act_quant_fp8(x, 32)
    base, slots = fp4_moe.routed_experts(xq, weights, ids, w13, s13, w2, s2, 10.0, cfg=dict(BN=32, U=U))
    want = fp4_moe.moe_reference(x, weights, ids, w13, s13, w2, s2, 10.0, shared)
    torch.testing.assert_close(fp4_moe.combine(base, slots, shared), want, rtol=0, atol=2**-5 * want.abs().max().item())
    other, _ = fp4_moe.routed_experts(xq, weights, ids, w13, s13, w2, s2, 10.0, cfg=dict(BN=32, U=U, B=0))
    assert s13.view(torch.uint8).unique().numel() > 2 and s2.view(torch.uint8).unique().numel() > 2
    assert all(torch.unique(w.view(torch.uint8) & 15).numel() == 16 for w in (w13, w2))
    assert torch.equal(other, base)


@needs_interpreter
@pytest.mark.parametrize("KS", [0, 1])
def test_an_iterations_codes_in_one_load_give_the_same_bits(KS):
    """An iteration's U groups of codes are one load of a row's 16·U bytes, split in registers (`_code_groups`):
    U = 2 and U = 4 give U = 1's bits (one group a load; the dots and their fp32 sums are the same whatever U),
    in K order and in slot order. Every group's bytes and scales differ, so a split that handed a dot another
    group's codes would show (checked: swapping U = 2's two groups fails)."""
    E, D, inter, N, k = 4, 256, 128, 6, 2  # 8 and 4 scale groups: U = 4 divides both
    from kernels.quant import act_quant_fp8

    w13, s13, w2, s2 = fp4_experts(E, D, inter, seed=21)
    x, weights, ids, _ = moe_inputs(N, k, E, D, seed=221)
    xq = act_quant_fp8(x, 32)
    one, _ = fp4_moe.routed_experts(xq, weights, ids, w13, s13, w2, s2, 10.0, cfg=dict(BN=32, U=1, KS=KS))
    for U in (2, 4):
        got, _ = fp4_moe.routed_experts(xq, weights, ids, w13, s13, w2, s2, 10.0, cfg=dict(BN=32, U=U, KS=KS))
        assert torch.equal(got, one), U
    with pytest.raises(ValueError, match="U=8"):  # one load takes 1, 2 or 4 groups
        fp4_moe.routed_experts(xq, weights, ids, w13, s13, w2, s2, 10.0, cfg=dict(BN=32, U=8, KS=KS))
