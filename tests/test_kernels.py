"""The CUDA compute paths of issue #7 against the torch paths they replace, on CPU tensors.

The HC split + Sinkhorn kernel runs here through Triton's interpreter (conftest sets TRITON_INTERPRET=1
without CUDA); the grouped MoE is plain torch and runs on CPU tensors as it does on CUDA. Both are
checked compiled on the GPU by tests/gpu/test_kernels_gpu.py. The CPU forward itself never takes these
paths, so the golden bits are untouched.
"""
import os

import pytest
import torch
import torch.nn.functional as F

from kernels import hc as hc_kernel
from model import hc
from model.checkpoint import init_weights
from model.config import preset
from model.transformer import Transformer

needs_interpreter = pytest.mark.skipif(
    hc_kernel.triton is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs Triton's interpreter (TRITON_INTERPRET=1, set by conftest without CUDA); tests/gpu covers CUDA")


def hc_inputs(n: int, hc_mult: int = 4, d: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hc_mult, d, generator=g).bfloat16()
    fn = torch.randn((2 + hc_mult) * hc_mult, hc_mult * d, generator=g) * 0.2
    return h, fn, torch.randn(3, generator=g), torch.randn((2 + hc_mult) * hc_mult, generator=g)


@needs_interpreter
@pytest.mark.parametrize("n", [1, 37, 130])
def test_hc_sinkhorn_kernel_matches_the_torch_path(n):
    """Same operations in the same order; only 4-term sums may associate differently: a few fp32 ulps."""
    h, fn, scale, base = hc_inputs(n, seed=n)
    want = hc.hc_mixes(h, fn, scale, base, 4, 20, 1e-6, 1e-20)
    x = h.flatten(-2).float()
    mixes = F.linear(x, fn) * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-20)
    got = hc_kernel.hc_split_sinkhorn(mixes, scale, base, 4, 20, 1e-6)
    for name, a, b in zip(("pre", "post", "comb"), want, got):
        assert a.shape == b.shape, name
        torch.testing.assert_close(b, a, rtol=4e-7, atol=4e-7, msg=name)
    comb = got[2]
    torch.testing.assert_close(comb.sum(-2), torch.ones(n, 4), rtol=0, atol=1e-4)  # doubly stochastic


@needs_interpreter
@pytest.mark.parametrize("n", [1, 20])
def test_hc_mixes_kernel_matches_the_torch_gemm_and_statistic(n):
    h, fn, _, _ = hc_inputs(n, d=64, seed=n + 100)
    x = h.flatten(-2).float()
    want = F.linear(x, fn) * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-20)
    torch.testing.assert_close(hc_kernel.hc_mixes(h, fn, 1e-20), want, rtol=1e-5, atol=1e-5)  # sum order


@pytest.fixture(scope="module")
def moe():
    m = Transformer(preset("micro"))
    init_weights(m.named_parameters(), seed=0)
    return m.layers[3].ffn


def reference_moe(moe, x):
    """The official per-expert loop (the CPU path of MoE.forward), routed sum in fp32 plus shared."""
    weights, ids = moe.gate(x)
    y = torch.zeros_like(x, dtype=torch.float32)
    for e in torch.unique(ids).tolist():
        rows, slot = torch.where(ids == e)
        y[rows] += moe.experts[e](x[rows], weights[rows, slot, None])
    return y + moe.shared_experts(x)


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_grouped_moe_matches_the_official_loop(moe, rows, monkeypatch):
    """Stacked weights, all experts on every row, each row keeping its own k in ascending expert id:
    the per-row arithmetic of the loop. On CPU the GEMMs of different shapes round alike here."""
    x = (torch.randn(rows, moe.gate.weight.size(1), generator=torch.Generator().manual_seed(rows)) * 2).bfloat16()
    weights, ids = moe.gate(x)
    want = reference_moe(moe, x)
    got = moe.grouped_forward(x, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    monkeypatch.setattr(type(moe), "GROUPED_ROWS", 2)  # passes of 2 rows give the same rows
    torch.testing.assert_close(moe.grouped_forward(x, weights, ids), got, rtol=0, atol=0)


def test_stacked_expert_weights_follow_a_weight_change(moe):
    w13, _ = moe.stacked_weights()
    before = w13.clone()
    with torch.no_grad():
        moe.experts[1].w3.weight.mul_(2)
    try:
        w13_after, _ = moe.stacked_weights()
        assert not torch.equal(w13_after, before)
        torch.testing.assert_close(w13_after.view(len(moe.experts) + 1, 2, -1, w13.size(-1))[1, 1],
                                   moe.experts[1].w3.weight)
    finally:
        with torch.no_grad():
            moe.experts[1].w3.weight.div_(2)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quant_kernels_give_the_bits_of_model_quant(dtype):
    """FP8 (ue8m0/32) and FP4 (ue8m0/32, e4m3/16) sims: every value, sign of zero included, over 11 decades,
    all-zero and tiny groups, and values on rounding boundaries."""
    from kernels import quant as quant_kernel
    from model import quant

    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 4, 128, generator=g) * torch.logspace(-9, 3, 128)
    x[0, 0, :32], x[0, 1, :32], x[0, 2, :32] = 0.0, -0.0, 1e-30
    x[1, 0, :16] = torch.tensor([448 * 2.0**-5, -0.75, 1.25, 2.5, 3.5, 5.0, 0.25, 1.75] * 2)
    x = x.to(dtype)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for want, got in ((quant.act_quant_fp8(x, 32), quant_kernel.act_quant_fp8(x, 32)),
                      (quant.act_quant_fp4(x, 32, "ue8m0"), quant_kernel.act_quant_fp4(x, 32, "ue8m0")),
                      (quant.act_quant_fp4(x, 16, "e4m3"), quant_kernel.act_quant_fp4(x, 16, "e4m3"))):
        assert torch.equal(got.view(bits), want.view(bits))


@needs_interpreter
def test_rms_norm_kernel_matches_the_torch_path():
    """fp32 in and out (the interpreter's bf16 casts truncate; tests/gpu checks bf16 compiled)."""
    from kernels.norm import rms_norm
    from model.attention import RMSNorm

    for n in (64, 96, 128):
        norm = RMSNorm(n, 1e-20)
        norm.weight.data = torch.randn(n, generator=torch.Generator().manual_seed(n))
        x = torch.randn(3, 7, n, generator=torch.Generator().manual_seed(n + 1)) * 3
        torch.testing.assert_close(rms_norm(x, norm.weight, 1e-20), norm(x), rtol=3e-7, atol=3e-7)


@needs_interpreter
@pytest.mark.parametrize("d", [64, 80])  # 80: a width that is no power of two, as V4.1's 5120
def test_hc_collapse_and_expand_kernels_match_the_torch_path(d):
    g = torch.Generator().manual_seed(2)
    h, y = torch.randn(3, 5, 4, d, generator=g), torch.randn(3, 5, d, generator=g)
    pre, post, comb = torch.rand(3, 5, 4, generator=g), torch.rand(3, 5, 4, generator=g), torch.rand(3, 5, 4, 4, generator=g)
    torch.testing.assert_close(hc_kernel.hc_pre(h, pre), hc.hc_pre(h, pre), rtol=3e-7, atol=3e-7)
    torch.testing.assert_close(hc_kernel.hc_post(y, h, post, comb), hc.hc_post(y, h, post, comb), rtol=3e-7, atol=3e-7)


@needs_interpreter
def test_swiglu_route_kernel_matches_the_grouped_torch_path(moe):
    """Within a bf16 ulp (the interpreter's bf16 cast truncates; tests/gpu checks the compiled kernel)."""
    from kernels.moe import swiglu_route

    x = (torch.randn(7, moe.gate.weight.size(1), generator=torch.Generator().manual_seed(7)) * 2).bfloat16()
    weights, ids = moe.gate(x)
    w13, _ = moe.stacked_weights()
    E = len(moe.experts)
    gu = F.linear(x, w13).unflatten(-1, (E + 1, 2, -1))
    g, u = gu[:, :, 0].float(), gu[:, :, 1].float().clamp(-10, 10)
    route = torch.zeros(7, E + 1).scatter_(1, ids, weights)
    route[:, E] = 1.0
    want = (route.unsqueeze(-1) * F.silu(g.clamp(max=10)) * u).transpose(0, 1)
    torch.testing.assert_close(swiglu_route(gu, ids, weights, 10.0).float(), want, rtol=2 ** -7, atol=1e-6)


@needs_interpreter
@pytest.mark.parametrize("S", [1, 7])
def test_paged_sparse_attention_addresses_ring_chunk_and_blocks(S):
    """The paged kernel reads a row's window ring (by state slot), its chunk's latents and its compressed
    entries (through the block table) where they lie: the same result as the plain kernel over their
    gathered copy. (The interpreter's bf16 dot is not faithful, so the numerics against the torch path are
    checked compiled, in tests/gpu; here both sides run the same interpreted arithmetic.)"""
    from kernels.attention import paged_sparse_attn, sparse_attn

    B, H, D, W, per_block, n_blocks, L = 3, 2, 16, 8, 4, 12, 24
    g = torch.Generator().manual_seed(S)
    q = torch.randn(B, S, H, D, generator=g).bfloat16()
    ring, kv = torch.randn(5, W, D, generator=g).bfloat16(), torch.randn(B, S, D, generator=g).bfloat16()
    pool = torch.randn(n_blocks, per_block, D, generator=g).bfloat16()
    slots, tables = torch.randperm(5, generator=g)[:B], torch.randperm(n_blocks, generator=g)[:B * 3].view(B, 3)
    sink = torch.randn(H, generator=g)
    idx = torch.randint(-1, W + S + 3 * per_block, (B, S, L), generator=g)
    gathered = torch.cat([ring[slots], kv, pool[tables].flatten(1, 2)], dim=1)
    assert torch.equal(paged_sparse_attn(q, ring, slots, kv, pool, tables, sink, idx, D ** -0.5),
                       sparse_attn(q, gathered, sink, idx, D ** -0.5))


@needs_interpreter
def test_sparse_attention_splits_heads_over_programs():
    """Heads in blocks of 16 over programs: each block addresses its own heads (program_id(1), not always the
    first), a last block part padding included: under the interpreter, whose dot sums each row alike whatever
    the block, every head's output is the one the single block of all heads gives (compiled, another MMA
    shape may move a value within tolerance: tests/gpu)."""
    from kernels.attention import sparse_attn

    B, S, H, D, N, L = 2, 1, 40, 32, 50, 70
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, S, H, D, generator=g).bfloat16()
    kv = torch.randn(B, N, D, generator=g).bfloat16()
    sink = torch.randn(H, generator=g)
    idx = torch.randint(-1, N, (B, S, L), generator=g)
    whole = sparse_attn(q, kv, sink, idx, D ** -0.5, dict(BLOCK_H=64, num_warps=4))
    split = sparse_attn(q, kv, sink, idx, D ** -0.5, dict(BLOCK_H=16, num_warps=4))
    assert not whole.isnan().any() and (whole != 0).any()
    assert torch.equal(split, whole)


@needs_interpreter
@pytest.mark.parametrize("heads", [None, 4])
def test_rope_kernel_rotates_like_the_torch_path(heads):
    """In place on the last R dims of a larger tensor, the head dim broadcast, and the inverse rotation."""
    from kernels import rope as rope_kernel
    from model.rope import apply_rope

    g = torch.Generator().manual_seed(3)
    shape = (2, 5) + ((heads,) if heads else ()) + (64,)
    x = torch.randn(shape, generator=g)
    freqs = torch.polar(torch.ones(2, 5, 16), torch.rand(2, 5, 16, generator=g) * 6)
    for inverse in (False, True):
        want, got = x.clone(), x.clone()
        apply_rope(want[..., -32:], freqs, inverse)
        assert rope_kernel._row_stride(got[..., -32:]) == 64
        rope_kernel.apply_rope(got[..., -32:], freqs, inverse)
        torch.testing.assert_close(got, want, rtol=2e-7, atol=2e-7)
        assert torch.equal(got[..., :-32], x[..., :-32])  # the other dims untouched


@needs_interpreter
def test_invariant_gemm_matches_torch_and_gives_a_row_the_same_bits_alone():
    """kernels/gemm.py (the batch-invariant mode's GEMM on CUDA) on fp32, strided operands included; the
    K tail (40 = 32 + 8) and the edge tiles are masked. tests/gpu checks it compiled, in bf16 and fp32."""
    from kernels.gemm import gemm_nt

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 70, 40, generator=g), torch.randn(2, 40, 50, generator=g).transpose(1, 2)  # b strided
    c = gemm_nt(a, b)
    torch.testing.assert_close(c, a @ b.transpose(1, 2), rtol=1e-5, atol=1e-5)
    assert torch.equal(gemm_nt(a[:, 37:38], b), c[:, 37:38])
    assert torch.equal(gemm_nt(a[1:], b[1:]), c[1:])


@needs_interpreter
def test_moe_combine_kernel_gives_the_bits_of_the_grouped_torch_lines(moe, monkeypatch):
    """kernels/moe.py `combine` against the torch lines it replaces (MoE._grouped_pass with the fused
    path off): the same fp32 adds in ascending expert id, the shared expert last, so the same bits."""
    from kernels.moe import combine

    x = (torch.randn(9, moe.gate.weight.size(1), generator=torch.Generator().manual_seed(9)) * 2).bfloat16()
    weights, ids = moe.gate(x)
    E, g = len(moe.experts), torch.Generator().manual_seed(1)
    # [E+1, N, d] bf16 w2 outputs with magnitudes spread over 8 decades, so that another order of the adds
    # (the shared expert first, say) rounds otherwise
    out = (torch.randn(E + 1, 9, x.size(1), generator=g) * 10 ** (8 * torch.rand(E + 1, 9, 1, generator=g) - 4))
    out = out.bfloat16()
    want = torch.zeros(9, x.size(1))
    picked = out[ids.sort(dim=-1).values, torch.arange(9)[:, None]]
    for j in range(ids.size(1)):
        want += picked[:, j]
    want = want + out[E]
    assert torch.equal(combine(out, ids, torch.float32), want)
    assert torch.equal(combine(out, ids.flip(-1), torch.float32), want), "the order of ids must not matter"


@needs_interpreter
@pytest.mark.parametrize("k,norm", [(2, True), (1, True), (2, False)])
def test_gate_route_kernel_gives_the_bits_of_the_torch_gate(moe, k, norm):
    """kernels/moe.py `route` (everything after the gate's softplus) against model/moe.py's torch lines: the
    same ids in the same order and the same weights, bit for bit (k = 2: the sum is one add). The square
    root is the correctly rounded one (CUDA's sqrtf, the kernel's sqrt_rn); torch's vectorised CPU sqrt is
    an ulp off for some inputs, so here it is taken through fp64. tests/gpu compares with torch on CUDA."""
    from kernels.moe import route

    g = torch.Generator().manual_seed(k)
    softplus = F.softplus(torch.randn(37, 16, generator=g) * 3)
    bias = torch.randn(16, generator=g) * 0.1
    scores = softplus.double().sqrt().float()
    ids = (scores + bias).topk(k, dim=-1).indices
    w = scores.gather(1, ids)
    if norm and k > 1:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    got_w, got_ids = route(softplus, bias, k, norm, 1.5)
    assert torch.equal(got_ids, ids)
    assert torch.equal(got_w, w * 1.5)


@needs_interpreter
@pytest.mark.parametrize("full_window,K", [(False, 5), (True, 5), (False, 0)])
def test_attention_list_kernel_gives_the_list_of_the_torch_path(full_window, K):
    """kernels/indexer.py `attention_list` (integers only) against model/attention.py's, exactly: window
    entries with -1 among them, top-k entries -1 padded at the end, rows ending before and past W."""
    from kernels.indexer import attention_list as kernel_list
    from model.attention import attention_list

    g = torch.Generator().manual_seed(K)
    B, S, W, offset, r, max_c = 3, 4, 8, 8 + 4, 2, 4
    window = torch.randint(-1, 20, (B, S, W), generator=g)
    topk = torch.randint(0, 9, (B, S, K), generator=g).sort(-1).values
    topk[..., K - 2:] = -1 if K else topk[..., K - 2:]
    end = torch.tensor([3, 9, 30])
    window_len = torch.full_like(end, W) if full_window else end.clamp(max=W)
    want = attention_list(window, window_len, torch.where(topk >= 0, topk + offset, -1), (end // r).clamp(max=max_c))
    assert torch.equal(kernel_list(window, topk, end, offset, r, max_c, full_window), want)


@needs_interpreter
def test_index_scores_kernel_gives_the_scores_of_the_torch_path():
    """kernels/indexer.py `index_scores` against model/attention.py's torch lines, on values whose every
    product and sum is exact in bf16 (so the order of the adds cannot show; tests/gpu compares rounding),
    with strided keys (as the paged stream gives them), an entry block edge and the -inf mask; both kernels:
    a program per query under 16 queries a row (decode), a block of 16 queries from 16 on."""
    from kernels.indexer import index_scores as kernel_scores
    from model import attention

    g = torch.Generator().manual_seed(0)
    B, H, D, E = 2, 4, 16, 70
    for S in (3, 17):
        q = torch.randint(-1, 2, (B, S, H, D), generator=g).bfloat16()
        w = (2 ** torch.randint(0, 2, (B, S, H), generator=g)).bfloat16()
        keys = torch.randint(-1, 2, (B, E + 5, D), generator=g).bfloat16()[:, :E]
        visible = torch.randint(0, E + 1, (B, S), generator=g)
        want = attention.index_scores(q, w, keys, visible)
        assert torch.equal(kernel_scores(q, w, keys, visible), want), S
