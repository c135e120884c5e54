"""Issue #7's CUDA paths, compiled, against the torch paths they replace: the HC split + Sinkhorn kernel,
the grouped MoE, and decode steps replayed from CUDA graphs. Skipped without CUDA (not a pass)."""
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from test_engine import SAMPLED, assert_same_tokens, prompts  # noqa: E402

import model.hc as hc  # noqa: E402
from engine import LLM  # noqa: E402
from kernels.hc import hc_split_sinkhorn  # noqa: E402
from model.checkpoint import init_checkpoint, init_weights  # noqa: E402
from model.config import preset  # noqa: E402
from model.moe import MoE  # noqa: E402
from model.transformer import Transformer  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("n", [1, 64, 1000])
def test_compiled_hc_sinkhorn_matches_the_torch_path(n):
    g = torch.Generator(device="cuda").manual_seed(n)
    h = torch.randn(n, 4, 128, device="cuda", generator=g).bfloat16()
    fn = torch.randn(24, 512, device="cuda", generator=g) * 0.1
    scale, base = torch.randn(3, device="cuda", generator=g), torch.randn(24, device="cuda", generator=g)
    x = h.flatten(-2).float()
    mixes = F.linear(x, fn) * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-20)
    got = hc_split_sinkhorn(mixes, scale, base, 4, 20, 1e-6)
    hc.USE_KERNEL = False
    try:
        want = hc.hc_mixes(h, fn, scale, base, 4, 20, 1e-6, 1e-20)
    finally:
        hc.USE_KERNEL = True
    for name, a, b in zip(("pre", "post", "comb"), want, got):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6, msg=name)
        print(f"{name}: {(a != b).float().mean().item():.2%} of values differ, max {(a - b).abs().max().item():.3g}")


@pytest.mark.parametrize("shape", [(64, 1, 4, 128, 700, 192), (2, 300, 4, 128, 500, 192), (3, 5, 2, 64, 90, 130)])
def test_compiled_sparse_attention_matches_the_torch_path(shape):
    """Within fp32 rounding before the bf16 output, on rows with no index (0), on -1 padding anywhere in
    the list, and on lists that are not a multiple of 64 long. A probability an fp32 ulp either side of a
    bf16 rounding boundary moves P·V by a bf16 ulp of p (the absolute tolerance)."""
    import model.attention as attention
    from kernels.attention import sparse_attn

    B, S, H, D, N, L = shape
    g = torch.Generator(device="cuda").manual_seed(B * S)
    q = torch.randn(B, S, H, D, device="cuda", generator=g).bfloat16()
    kv = torch.randn(B, N, D, device="cuda", generator=g).bfloat16()
    sink = torch.randn(H, device="cuda", generator=g)
    idx = torch.randint(-1, N, (B, S, L), device="cuda", generator=g)
    idx[0, 0] = -1
    idx[-1, -1, L // 2:] = -1
    out = torch.full((B, S, H, D), float("nan"), device="cuda").bfloat16()
    out.copy_(sparse_attn(q, kv, sink, idx, D ** -0.5))
    attention.USE_KERNELS = False
    try:
        want = attention.sparse_attn(q, kv, sink, idx, D ** -0.5)
    finally:
        attention.USE_KERNELS = True
    assert not out.isnan().any() and torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))
    torch.testing.assert_close(out, want, rtol=2 ** -7, atol=2 ** -10)
    print(f"{shape}: {(out != want).float().mean().item():.2%} of outputs differ")


@pytest.mark.parametrize("S", [1, 33])
def test_compiled_sparse_attention_config_keeps_the_one_block_bits(S):
    """At the slice's widths (64 heads of 512, 640 indices), compiled: the configuration `config` picks
    (benchmarks/bench_attention.py --sweep) gives the bits of one block of all heads on 4 warps, the kernel's
    earlier form; blocks of 16 or 32 heads move a few values within the torch path's tolerance (another
    MMA shape accumulates the 512-wide dot in another order)."""
    import model.attention as attention
    from kernels.attention import config, sparse_attn

    B, H, D, N, L = 3, 64, 512, 1000, 640
    g = torch.Generator(device="cuda").manual_seed(S)
    q = torch.randn(B, S, H, D, device="cuda", generator=g).bfloat16()
    kv = torch.randn(B, N, D, device="cuda", generator=g).bfloat16()
    sink = torch.randn(H, device="cuda", generator=g)
    idx = torch.randint(-1, N, (B, S, L), device="cuda", generator=g)
    one_block = sparse_attn(q, kv, sink, idx, D ** -0.5, dict(BLOCK_H=64, num_warps=4, num_stages=3))
    assert config(H, D)["BLOCK_H"] == 64
    assert torch.equal(sparse_attn(q, kv, sink, idx, D ** -0.5), one_block)
    attention.USE_KERNELS = False
    try:
        want = attention.sparse_attn(q, kv, sink, idx, D ** -0.5)
    finally:
        attention.USE_KERNELS = True
    for bh in (16, 32):
        torch.testing.assert_close(sparse_attn(q, kv, sink, idx, D ** -0.5, dict(BLOCK_H=bh, num_warps=4, num_stages=2)),
                                   want, rtol=2 ** -7, atol=2 ** -10)


@pytest.mark.parametrize("S", [1, 150])
def test_paged_sparse_attention_reads_ring_chunk_and_blocks_in_place(S):
    """The paged form (window ring by state slot, this chunk's latents, compressed entries through the block
    table) gives the bits of the plain kernel over the gathered, concatenated copy of the same rows."""
    from kernels.attention import paged_sparse_attn, sparse_attn

    B, H, D, W, per_block, n_blocks, L = 5, 4, 128, 128, 64, 40, 192
    g = torch.Generator(device="cuda").manual_seed(S)
    q = torch.randn(B, S, H, D, device="cuda", generator=g).bfloat16()
    ring = torch.randn(9, W, D, device="cuda", generator=g).bfloat16()
    kv = torch.randn(B, S, D, device="cuda", generator=g).bfloat16()
    pool = torch.randn(n_blocks, per_block, D, device="cuda", generator=g).bfloat16()
    slots = torch.randperm(9, device="cuda", generator=g)[:B]
    tables = torch.randperm(n_blocks, device="cuda", generator=g)[:B * 6].view(B, 6)
    sink = torch.randn(H, device="cuda", generator=g)
    idx = torch.randint(-1, W + S + 6 * per_block, (B, S, L), device="cuda", generator=g)
    got = paged_sparse_attn(q, ring, slots, kv, pool, tables, sink, idx, D ** -0.5)
    gathered = torch.cat([ring[slots], kv, pool[tables].flatten(1, 2)], dim=1)
    assert torch.equal(got, sparse_attn(q, gathered, sink, idx, D ** -0.5))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_quant_kernels_give_the_bits_of_model_quant(dtype):
    from kernels import quant as quant_kernel
    from model import quant

    g = torch.Generator(device="cuda").manual_seed(3)
    x = (torch.randn(64, 12, 256, device="cuda", generator=g) * torch.logspace(-9, 3, 256, device="cuda")).to(dtype)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for want, got in ((quant.act_quant_fp8(x, 32), quant_kernel.act_quant_fp8(x, 32)),
                      (quant.act_quant_fp4(x, 32, "ue8m0"), quant_kernel.act_quant_fp4(x, 32, "ue8m0")),
                      (quant.act_quant_fp4(x, 16, "e4m3"), quant_kernel.act_quant_fp4(x, 16, "e4m3"))):
        assert torch.equal(got.view(bits), want.view(bits))


@pytest.mark.parametrize("n", [96, 128])
def test_compiled_rms_norm_and_hc_kernels_match_the_torch_paths(n):
    import model.attention as attention
    from kernels import hc as hc_kernel
    from kernels.norm import rms_norm

    g = torch.Generator(device="cuda").manual_seed(n)
    norm = attention.RMSNorm(n, 1e-20).cuda()
    norm.weight.data = torch.randn(n, device="cuda", generator=g).bfloat16()
    x = (torch.randn(300, n, device="cuda", generator=g) * 3).bfloat16()
    got = rms_norm(x, norm.weight, 1e-20)
    attention.USE_KERNELS = False
    try:
        want = norm(x)
    finally:
        attention.USE_KERNELS = True
    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=0)  # within a bf16 ulp
    h = torch.randn(300, 4, 128, device="cuda", generator=g).bfloat16()
    y = torch.randn(300, 128, device="cuda", generator=g).bfloat16()
    pre, post, comb = (torch.rand(300, *s, device="cuda", generator=g) for s in ((4,), (4,), (4, 4)))
    hc.USE_KERNEL = False
    try:
        want_pre, want_post = hc.hc_pre(h, pre), hc.hc_post(y, h, post, comb)
    finally:
        hc.USE_KERNEL = True
    torch.testing.assert_close(hc_kernel.hc_pre(h, pre), want_pre, rtol=2 ** -7, atol=0)
    torch.testing.assert_close(hc_kernel.hc_post(y, h, post, comb), want_post, rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("heads", [None, 4])
def test_compiled_rope_matches_the_torch_path(heads):
    """bf16 in place on the last 32 dims, head dim broadcast, both directions: within a bf16 ulp."""
    from kernels import rope as rope_kernel
    from model.rope import apply_rope

    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn((64, 3) + ((heads,) if heads else ()) + (128,), device="cuda", generator=g).bfloat16()
    freqs = torch.polar(torch.ones(64, 3, 16, device="cuda"), torch.rand(64, 3, 16, device="cuda", generator=g) * 6)
    for inverse in (False, True):
        want, got = x.clone(), x.clone()
        apply_rope(want[..., -32:], freqs, inverse)
        assert rope_kernel.applies(got[..., -32:], freqs)
        rope_kernel.apply_rope(got[..., -32:], freqs, inverse)
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-6)
        assert torch.equal(got[..., :-32], x[..., :-32])


@pytest.mark.parametrize("rows", [1, 64, 300])
def test_grouped_moe_matches_the_masked_path_on_cuda(rows):
    m = Transformer(preset("tiny-68m"))
    init_weights(m.named_parameters(), seed=0)
    moe = m.layers[5].ffn.cuda()
    x = (torch.randn(rows, 128, device="cuda", generator=torch.Generator(device="cuda").manual_seed(rows)) * 2).bfloat16()
    got = moe(x)
    MoE.grouped = False
    try:
        want = moe(x)
    finally:
        MoE.grouped = True
    print(f"rows {rows}: {(got != want).float().mean().item():.2%} of outputs differ, "
          f"max {(got.float() - want.float()).abs().max().item():.3g}")
    torch.testing.assert_close(got, want, rtol=2 ** -6, atol=1e-3)  # a one-ulp flip of the bf16 hidden moves it ~2 ulps


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("micro")
    init_checkpoint("micro", 0, path)
    return str(path)


def test_decode_graphs_give_the_tokens_of_eager_steps(ckpt):
    """Graph replays (padded batch, bucketed context) against eager decode steps: the same tokens up to
    a named near tie; and a step's graph really is replayed."""
    ps = prompts(seed=6)
    graphs = LLM(ckpt, device="cuda")
    on = [o.token_ids for o in graphs.generate(ps, SAMPLED, progress=False)]
    assert graphs.engine.runner.graphs, "no decode step ran through a CUDA graph"
    eager = LLM(ckpt, device="cuda")
    eager.engine.runner.use_cuda_graphs = False
    off = [o.token_ids for o in eager.generate(ps, SAMPLED, progress=False)]
    assert not eager.engine.runner.graphs
    assert assert_same_tokens(graphs, ps, SAMPLED, on, off) >= 24


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_invariant_gemm_compiled_keeps_a_row_s_bits_whatever_the_row_count(dtype):
    """kernels/gemm.py compiled: close to torch's GEMM, and a row's output is bitwise the same alone, among
    7 rows or among 3000 (where cuBLAS changes kernels), as the batch-invariant mode needs."""
    from kernels.gemm import gemm_nt, linear

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(3000, 384, generator=g, device="cuda").to(dtype)
    w = torch.randn(520, 384, generator=g, device="cuda").to(dtype)
    full = linear(x, w)
    torch.testing.assert_close(full.float(), F.linear(x.float(), w.float()), rtol=2e-2, atol=2e-1)
    for rows in (slice(5, 6), slice(0, 7), slice(1000, 1129)):
        assert torch.equal(linear(x[rows], w), full[rows])
    batched = gemm_nt(x.view(3, 1000, 384), w.expand(3, 520, 384))
    assert torch.equal(batched.view(3000, 520), full)
    cublas = [F.linear(x[:n], w)[0] for n in (1, 3000)]
    print("cuBLAS row 0 alone vs among 3000 rows equal:", torch.equal(*cublas))


def test_moe_combine_kernel_compiled_gives_the_bits_of_the_torch_lines():
    """kernels/moe.py `combine` compiled: the routed outputs added in ascending expert id in fp32, the shared
    expert last, bit for bit as MoE._grouped_pass's torch lines (magnitudes over 8 decades, so another
    order of the adds would show)."""
    from kernels.moe import combine

    g = torch.Generator(device="cuda").manual_seed(0)
    E, N, D, k = 8, 300, 256, 2
    out = (torch.randn(E + 1, N, D, generator=g, device="cuda")
           * 10 ** (8 * torch.rand(E + 1, N, 1, generator=g, device="cuda") - 4)).bfloat16()
    ids = torch.rand(N, E, generator=g, device="cuda").topk(k, dim=-1).indices
    want = torch.zeros(N, D, device="cuda")
    picked = out[ids.sort(dim=-1).values, torch.arange(N, device="cuda")[:, None]]
    for j in range(k):
        want += picked[:, j]
    assert torch.equal(combine(out, ids, torch.float32), want + out[E])


@pytest.mark.parametrize("k", [1, 2])
def test_gate_route_kernel_compiled_gives_the_bits_of_the_torch_gate(k):
    """kernels/moe.py `route` compiled against the gate's torch lines on CUDA: same ids, same weights."""
    from kernels.moe import route

    g = torch.Generator(device="cuda").manual_seed(k)
    softplus = F.softplus(torch.randn(3000, 16, generator=g, device="cuda") * 3)
    bias = torch.randn(16, generator=g, device="cuda") * 0.1
    scores = softplus.sqrt()
    ids = (scores + bias).topk(k, dim=-1).indices
    w = scores.gather(1, ids)
    if k > 1:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    got_w, got_ids = route(softplus, bias, k, True, 1.5)
    assert torch.equal(got_ids, ids)
    assert torch.equal(got_w, w * 1.5)


def test_indexer_kernels_compiled_match_the_torch_paths():
    """kernels/indexer.py compiled: the index list exactly; the scores within a bf16 ulp of the torch lines
    (the dot products and the head sum associate otherwise), with the same -inf mask."""
    from kernels.indexer import attention_list as kernel_list, index_scores as kernel_scores
    from model import attention

    g = torch.Generator(device="cuda").manual_seed(0)
    B, S, H, D, E = 5, 33, 8, 64, 300
    q = torch.randn(B, S, H, D, generator=g, device="cuda").bfloat16()
    w = torch.randn(B, S, H, generator=g, device="cuda").bfloat16()
    keys = torch.randn(B, E + 7, D, generator=g, device="cuda").bfloat16()[:, :E]
    visible = torch.randint(0, E + 1, (B, S), generator=g, device="cuda")
    attention.USE_KERNELS = False
    try:
        want = attention.index_scores(q, w, keys, visible)
    finally:
        attention.USE_KERNELS = True
    got = kernel_scores(q, w, keys, visible)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = ~torch.isinf(want)
    torch.testing.assert_close(got[finite].float(), want[finite].float(), rtol=2 ** -7, atol=2 ** -6)
    for s in range(0, S, 4):  # a decode step's query (a program per query) gives the bits of a chunk's (a block)
        assert torch.equal(kernel_scores(q[:, s:s + 1], w[:, s:s + 1], keys, visible[:, s:s + 1]), got[:, s:s + 1]), s
    H = 64  # the released indexer's heads: four blocks of the dot's rows, at a decode shape
    q, w = torch.randn(B, S, H, D, generator=g, device="cuda").bfloat16(), torch.randn(B, S, H, generator=g, device="cuda").bfloat16()
    got = kernel_scores(q, w, keys, visible)
    assert torch.equal(kernel_scores(q[:, -1:], w[:, -1:], keys, visible[:, -1:]), got[:, -1:])

    W, K, end = 128, 64, torch.tensor([5, 130, 400, 1, 128], device="cuda")
    window = torch.randint(-1, 500, (B, S, W), generator=g, device="cuda")
    topk = torch.randint(0, 200, (B, S, K), generator=g, device="cuda").sort(-1).values
    topk[..., 50:] = -1
    for full in (False, True):
        window_len = torch.full_like(end, W) if full else end.clamp(max=W)
        want = attention.attention_list(window, window_len, torch.where(topk >= 0, topk + W + S, -1),
                                        (end // 2).clamp(max=K))
        assert torch.equal(kernel_list(window, topk, end, W + S, 2, K, full), want)


def test_moe_combine_kernel_compiled_rounds_to_bf16_as_torch_does():
    """The combine's bf16 output (what the fused grouped MoE returns) is the torch lines' fp32 sum rounded
    by .to(bfloat16), bit for bit."""
    from kernels.moe import combine

    g = torch.Generator(device="cuda").manual_seed(1)
    out = (torch.randn(9, 500, 128, generator=g, device="cuda") * 3).bfloat16()
    ids = torch.rand(500, 8, generator=g, device="cuda").topk(2, dim=-1).indices
    assert torch.equal(combine(out, ids, torch.bfloat16), combine(out, ids, torch.float32).bfloat16())
