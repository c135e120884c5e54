"""Issue #7's CUDA paths, compiled, against the torch paths they replace: the HC split + Sinkhorn kernel,
the grouped MoE, and decode steps replayed from CUDA graphs. Skipped without CUDA (not a pass)."""
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from test_engine import SAMPLED, assert_same_tokens, prompts  # noqa: E402
from test_kernels import compressor_decode_case  # noqa: E402

import model.hc as hc  # noqa: E402
from engine import LLM  # noqa: E402
from kernels.hc import hc_split_sinkhorn  # noqa: E402
from model.checkpoint import init_checkpoint, init_weights  # noqa: E402
from model.config import preset  # noqa: E402
from model.moe import MoE  # noqa: E402
from model.transformer import Transformer  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def fused(monkeypatch):
    """The fused launches of issue #20 item 5 on (model/attention.py FUSED_LAUNCHES, the default), whatever
    the switch is set to."""
    import model.attention as attention

    monkeypatch.setattr(attention, "FUSED_LAUNCHES", True)


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


# a prefill chunk's handoff at wide streams (kernels/hc.py handoff_config: 64 tokens a program, the mixes on the
# tensor cores), and other tiles of it
WIDE_FORMS = [dict(T=64, BLOCK_K=64, BLOCK_D=64, num_warps=8), dict(T=32, BLOCK_K=32, BLOCK_D=128, num_warps=4)]


def mixes_error(mixes, stream, fn, scale, base) -> float:
    """The largest difference of (pre, post, comb) from the same stream's in fp64 (model/hc.py's torch lines)."""
    want = hc.hc_mixes(stream.cpu(), fn.cpu().double(), scale.cpu().double(), base.cpu().double(), 4, 20, 1e-6, 1e-20)
    return max((got.cpu().double() - w).abs().max().item() for got, w in zip(mixes, want))


@pytest.mark.parametrize("n, d, cfg", [(64, 128, None), (1000, 128, None), (64, 5120, None), (1000, 5120, None),
                                       *[(n, 5120, form) for n in (64, 1000) for form in WIDE_FORMS]])
@pytest.mark.parametrize("expand", [True, False])
def test_compiled_hc_handoff_matches_the_separate_kernels_and_the_torch_path(n, d, cfg, expand):
    """The fused handoff (kernels/hc.py; `cfg` None: its own form for the shape) against the four launches it
    replaces and against model/hc.py's torch ops: the stream and the collapse within a bf16 ulp; the mixes (of
    the kernels' own stream, so that a stream value an ulp apart does not count twice) no further from the
    same stream's fp64 mixes than theirs are, twice over, plus 2^-17 for the tensor cores' fp32 accumulation,
    which truncates (a prefill chunk's form at the slice's width: 2.6-6.2e-6 from fp64 where the FMA chain
    is 0.7-1.3e-6, on an H200; at 20,480 values a token two fp32 sums in another order differ by far more
    than an ulp); at tiny-68m's width within 1e-5 of theirs."""
    from kernels import hc as hc_kernel

    g = torch.Generator(device="cuda").manual_seed(n + d + expand)
    h = torch.randn(n, 4, d, device="cuda", generator=g).bfloat16()
    y = torch.randn(n, d, device="cuda", generator=g).bfloat16() if expand else None
    post = torch.rand(n, 4, device="cuda", generator=g) * 2 if expand else None
    comb = torch.rand(n, 4, 4, device="cuda", generator=g) if expand else None
    fn = torch.randn(24, 4 * d, device="cuda", generator=g) * 0.05
    scale, base = torch.randn(3, device="cuda", generator=g), torch.randn(24, device="cuda", generator=g)
    pre = torch.rand(n, 4, device="cuda", generator=g)
    stream, mixes, x = hc_kernel.hc_handoff(y, h, post, comb, fn, scale, base, pre, 20, 1e-6, 1e-20, cfg=cfg)
    kernels = (hc_kernel.hc_post(y, h, post, comb) if expand else h,
               hc_kernel.hc_split_sinkhorn(hc_kernel.hc_mixes(stream, fn, 1e-20), scale, base, 4, 20, 1e-6),
               hc_kernel.hc_pre(stream, pre))
    hc.USE_KERNEL = False
    try:
        reference = (hc.hc_post(y, h, post, comb) if expand else h, hc.hc_mixes(stream, fn, scale, base, 4, 20, 1e-6, 1e-20),
                     hc.hc_pre(stream, pre))
    finally:
        hc.USE_KERNEL = True
    error = mixes_error(mixes, stream, fn, scale, base)
    for want, label in ((kernels, "separate kernels"), (reference, "torch path")):
        # a bf16 ulp is at most 2^-7 of a value; a sum that cancels to near 0 is off by its terms' fp32 rounding
        torch.testing.assert_close(stream.float(), want[0].float(), rtol=2 ** -7, atol=2 ** -16,
                                   msg=lambda m: f"{label}, the stream: {m}")
        their_error = mixes_error(want[1], stream, fn, scale, base)
        assert error <= 2 * their_error + 2 ** -17, f"{label}: mixes {error:.3g} from fp64, theirs {their_error:.3g}"
        if d == 128:
            for name, a, b in zip(("pre", "post", "comb"), want[1], mixes):
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"{label}, {name}: {m}")
        torch.testing.assert_close(x.float(), want[2].float(), rtol=2 ** -7, atol=2 ** -16,
                                   msg=lambda m: f"{label}, x: {m}")
        print(f"{label}: {(stream != want[0]).float().mean().item():.3%} of the stream and "
              f"{(x != want[2]).float().mean().item():.3%} of x differ; the mixes {error:.3g} from fp64, theirs "
              f"{their_error:.3g}")


def expand_norm_inputs(n: int, d: int, seed: int):
    """A handoff's inputs with an expand and a norm: y, h, post, comb, fn, scale, base, pre and the norm weight."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(n, 4, d, device="cuda", generator=g).bfloat16()
    y = torch.randn(n, d, device="cuda", generator=g).bfloat16()
    post, comb = torch.rand(n, 4, device="cuda", generator=g) * 2, torch.rand(n, 4, 4, device="cuda", generator=g)
    fn = torch.randn(24, 4 * d, device="cuda", generator=g) * 0.05
    scale, base = torch.randn(3, device="cuda", generator=g), torch.randn(24, device="cuda", generator=g)
    pre = torch.rand(n, 4, device="cuda", generator=g)
    weight = (torch.rand(d, device="cuda", generator=g) + 0.5).bfloat16()
    return y, h, post, comb, fn, scale, base, pre, weight


@pytest.mark.parametrize("cfg", WIDE_FORMS + [None, dict(T=1, PART_K=2048)])
def test_compiled_hc_handoff_of_a_token_does_not_depend_on_the_tokens_beside_it(cfg):
    """At the slice's width a prefill chunk's handoff takes several tokens a program (kernels/hc.py
    handoff_config), and a decode step's sums its mixes in parts first, 16 tokens a part program (None: the
    default form at 37 tokens), or a token a program (the batch-invariant mode's): every value of a token,
    alone or the 6th of 37 (so in another program's slot, beside other tokens), bit for bit."""
    from kernels import hc as hc_kernel

    n, d = 37, 5120
    y, h, post, comb, fn, scale, base, pre, weight = expand_norm_inputs(n, d, seed=5)
    run = lambda rows: hc_kernel.hc_handoff(y[rows], h[rows], post[rows], comb[rows], fn, scale, base, pre[rows], 20,
                                            1e-6, 1e-20, weight, 1e-6, cfg=cfg)
    stream, mixes, x, normed = run(slice(0, n))
    alone = run(slice(5, 6))
    assert torch.equal(alone[0], stream[5:6]) and torch.equal(alone[2], x[5:6]) and torch.equal(alone[3], normed[5:6])
    assert all(torch.equal(a, b[5:6]) for a, b in zip(alone[1], mixes))


@pytest.mark.parametrize("n, d, cfg", [(64, 128, None), (64, 5120, None), (1000, 5120, WIDE_FORMS[0])])
def test_compiled_hc_handoff_norm_matches_the_norm_kernel(n, d, cfg):
    """The handoff's RMSNorm of its collapse (issue #20 item 5: the attn_norm and ffn_norm launches folded in)
    against kernels/norm.py on the same x, compiled: within a bf16 ulp (another tile sums the squares); the
    stream and the collapse the launch without the norm gives (a prefill chunk's form too)."""
    from kernels import hc as hc_kernel, norm as norm_kernel

    y, h, post, comb, fn, scale, base, pre, weight = expand_norm_inputs(n, d, seed=n + d)
    plain = hc_kernel.hc_handoff(y, h, post, comb, fn, scale, base, pre, 20, 1e-6, 1e-20, cfg=cfg)
    stream, mixes, x, normed = hc_kernel.hc_handoff(y, h, post, comb, fn, scale, base, pre, 20, 1e-6, 1e-20,
                                                    weight, 1e-6, cfg=cfg)
    assert torch.equal(stream, plain[0]) and torch.equal(x, plain[2])
    want = norm_kernel.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(normed.float(), want.float(), rtol=2 ** -7, atol=2 ** -16)
    print(f"d={d}: {(normed != want).float().mean().item():.3%} of the normed x differ from the norm kernel's")


@pytest.mark.parametrize("S", [1, 33])
def test_compiled_sparse_attention_config_keeps_the_one_block_bits(S):
    """At the slice's widths (64 heads of 512, 640 indices), compiled: the configuration `config` picks for a
    chunk, and for a decode step in the batch-invariant mode (benchmarks/bench_attention.py --sweep), gives the
    bits of one block of all heads on 4 warps, the kernel's earlier form; blocks of 16 or 32 heads, among them a
    decode step's outside the mode (DECODE_WIDE), move a few values within the torch path's tolerance (another
    MMA shape accumulates the 512-wide dot in another order)."""
    import model.attention as attention
    from kernels.attention import DECODE_WIDE, config, sparse_attn
    from model import invariant

    B, H, D, N, L = 3, 64, 512, 1000, 640
    g = torch.Generator(device="cuda").manual_seed(S)
    q = torch.randn(B, S, H, D, device="cuda", generator=g).bfloat16()
    kv = torch.randn(B, N, D, device="cuda", generator=g).bfloat16()
    sink = torch.randn(H, device="cuda", generator=g)
    idx = torch.randint(-1, N, (B, S, L), device="cuda", generator=g)
    one_block = sparse_attn(q, kv, sink, idx, D ** -0.5, dict(BLOCK_H=64, num_warps=4, num_stages=3))
    assert config(H, D)["BLOCK_H"] == 64
    with invariant.mode():
        assert torch.equal(sparse_attn(q, kv, sink, idx, D ** -0.5), one_block)
    if S > 1:
        assert torch.equal(sparse_attn(q, kv, sink, idx, D ** -0.5), one_block)
    else:  # a decode step outside the mode: its own tiles
        assert config(H, D, decode=True) == DECODE_WIDE
        decode = sparse_attn(q, kv, sink, idx, D ** -0.5, DECODE_WIDE)
        assert torch.equal(sparse_attn(q, kv, sink, idx, D ** -0.5), decode)
    attention.USE_KERNELS = False
    try:
        want = attention.sparse_attn(q, kv, sink, idx, D ** -0.5)
    finally:
        attention.USE_KERNELS = True
    for bh in (16, 32):
        torch.testing.assert_close(sparse_attn(q, kv, sink, idx, D ** -0.5, dict(BLOCK_H=bh, num_warps=4, num_stages=2)),
                                   want, rtol=2 ** -7, atol=2 ** -10)


def test_a_tile_the_gpu_cannot_hold_falls_back_to_the_next_eager_and_in_a_graph():
    """kernels/fit.py on the GPU: 128 heads a program at 512-wide heads takes 262,656 bytes of shared memory compiled
    for sm_90, more than an H100/H200 block may have; Triton refuses the kernel as it loads it, and the launch runs
    64 heads a program instead: the bits of asking for 64, eager and captured in a CUDA graph (the refusal comes
    before anything is enqueued, so the capture goes on)."""
    from kernels.attention import sparse_attn

    if torch.cuda.get_device_properties(0).shared_memory_per_block_optin >= 262656:
        pytest.skip("this GPU holds 128 heads a program at 512-wide heads: nothing to fall back from")
    B, H, D, N, L = 4, 64, 512, 1000, 640
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, 1, H, D, device="cuda", generator=g).bfloat16()
    kv = torch.randn(B, N, D, device="cuda", generator=g).bfloat16()
    sink = torch.randn(H, device="cuda", generator=g)
    idx = torch.randint(-1, N, (B, 1, L), device="cuda", generator=g)
    tile = dict(num_warps=8, num_stages=2, PREFETCH=False)
    want = sparse_attn(q, kv, sink, idx, D ** -0.5, dict(BLOCK_H=64, **tile))
    assert torch.equal(sparse_attn(q, kv, sink, idx, D ** -0.5, dict(BLOCK_H=128, **tile)), want)
    out = torch.zeros_like(want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(sparse_attn(q, kv, sink, idx, D ** -0.5, dict(BLOCK_H=128, **tile)))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


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


def paged_sources(g, B: int, S: int, H: int, D: int, W: int = 128, per_block: int = 64, n_blocks: int = 40,
                  L: int = 192) -> tuple:
    """paged_sparse_attn's sources after q, on CUDA: a ring of 9 slots of W rows, the chunk's latents, a pool of
    n_blocks blocks, each of B rows' state slot and 6 blocks, the sink and L indices a query over all of them."""
    ring = torch.randn(9, W, D, device="cuda", generator=g).bfloat16()
    kv = torch.randn(B, S, D, device="cuda", generator=g).bfloat16()
    pool = torch.randn(n_blocks, per_block, D, device="cuda", generator=g).bfloat16()
    slots = torch.randperm(9, device="cuda", generator=g)[:B]
    tables = torch.randperm(n_blocks, device="cuda", generator=g)[:B * 6].view(B, 6)
    sink = torch.randn(H, device="cuda", generator=g)
    idx = torch.randint(-1, W + S + 6 * per_block, (B, S, L), device="cuda", generator=g)
    return ring, slots, kv, pool, tables, sink, idx


@pytest.mark.parametrize("S", [1, 150])
def test_paged_sparse_attention_reads_ring_chunk_and_blocks_in_place(S):
    """The paged form (window ring by state slot, this chunk's latents, compressed entries through the block
    table) gives the bits of the plain kernel over the gathered, concatenated copy of the same rows, with each
    block's rows loaded an iteration ahead (PREFETCH, the narrow heads' form) or not."""
    from kernels.attention import paged_sparse_attn, sparse_attn

    B, H, D = 5, 4, 128
    g = torch.Generator(device="cuda").manual_seed(S)
    q = torch.randn(B, S, H, D, device="cuda", generator=g).bfloat16()
    ring, slots, kv, pool, tables, sink, idx = paged_sources(g, B, S, H, D)
    got = paged_sparse_attn(q, ring, slots, kv, pool, tables, sink, idx, D ** -0.5)
    gathered = torch.cat([ring[slots], kv, pool[tables].flatten(1, 2)], dim=1)
    assert torch.equal(got, sparse_attn(q, gathered, sink, idx, D ** -0.5))
    for prefetch in (False, True):  # each block's rows loaded an iteration ahead or not: the same bits
        cfg = dict(PREFETCH=prefetch)
        assert torch.equal(paged_sparse_attn(q, ring, slots, kv, pool, tables, sink, idx, D ** -0.5, cfg), got)


@pytest.mark.parametrize("S, H, D, R", [(1, 4, 128, 32), (150, 4, 128, 32), (1, 64, 512, 64), (33, 64, 512, 64)])
def test_compiled_paged_sparse_attention_rotates_q_at_load_bit_for_bit(S, H, D, R):
    """q's RoPE in the kernel's load (issue #20 item 5: the q RoPE launches folded in) gives the bits of q rotated
    first by kernels/rope.py, compiled, at tiny-68m's and the slice's head shapes."""
    from kernels import rope as rope_kernel
    from kernels.attention import paged_sparse_attn
    from model.rope import rope_table

    B = 5
    g = torch.Generator(device="cuda").manual_seed(S + H)
    args = preset("tiny-68m")
    args.rope_head_dim = R
    freqs = rope_table(args, 0, "cuda")[torch.randint(0, 1000, (B, S), device="cuda", generator=g)]
    q = torch.randn(B, S, H, D, device="cuda", generator=g).bfloat16()
    sources = (*paged_sources(g, B, S, H, D), D ** -0.5)
    rotated = q.clone()
    rope_kernel.apply_rope(rotated[..., -R:], freqs)
    got = paged_sparse_attn(q, *sources, freqs=freqs)
    want = paged_sparse_attn(rotated, *sources)
    print(f"S={S} H={H} D={D}: {(got != want).float().mean().item():.4%} of outputs differ")
    assert torch.equal(got, want)


@pytest.mark.parametrize("M, H, D, R, G, rank", [(64, 4, 128, 32, 2, 64), (1000, 4, 128, 32, 2, 64),
                                                 (64, 64, 512, 64, 8, 1024)])
def test_compiled_rope_wo_a_matches_the_rope_kernel_and_the_grouped_gemm(M, H, D, R, G, rank):
    """kernels/output.py compiled (issue #20 item 5: the o RoPE, the group-major copy and the batched GEMM in one
    launch) against kernels/rope.py's inverse rotation and the grouped einsum (cuBLAS): within a bf16 ulp; with
    an identity wo_a the rotation itself, bit for bit. Shapes of tiny-68m (decode, prefill) and the slice."""
    from kernels import output as output_kernel, rope as rope_kernel
    from model.rope import rope_table

    g = torch.Generator(device="cuda").manual_seed(M + D)
    args = preset("tiny-68m")
    args.rope_head_dim = R
    freqs = rope_table(args, 0, "cuda")[torch.randint(0, 1000, (M,), device="cuda", generator=g)]
    o = torch.randn(M, H, D, device="cuda", generator=g).bfloat16()
    K = H * D // G
    wo_a = (torch.randn(G, rank, K, device="cuda", generator=g) * K ** -0.5).bfloat16()
    got = output_kernel.rope_wo_a(o, freqs, wo_a, R)
    for tile in ((16, 64, 64, 4), (64, 64, 64, 4), (16, 16, 256, 2)):  # the tiles take no part in the bits
        assert torch.equal(output_kernel.rope_wo_a(o, freqs, wo_a, R, tile), got)
    rotated = o.clone()
    rope_kernel.apply_rope(rotated[..., -R:], freqs, inverse=True)
    want = torch.einsum("mgk,grk->mgr", rotated.view(M, G, K), wo_a).flatten(1)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -12)
    print(f"M={M} D={D}: {(got != want).float().mean().item():.3%} of outputs differ from cuBLAS's")
    if K <= 512:
        eye = torch.eye(K, device="cuda").expand(G, K, K).bfloat16().contiguous()
        assert torch.equal(output_kernel.rope_wo_a(o, freqs, eye, R), rotated.view(M, G * K))


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


@pytest.mark.parametrize("n", [1, 64, 4096])
def test_compiled_wide_engram_gate_matches_the_torch_path(n, monkeypatch):
    """kernels/engram.py's two-pass gate at the released width (hc 4, dim 5,120) against model/engram.py's fp32
    ops and against the one-pass kernel on the same rows: within a bf16 ulp."""
    from types import SimpleNamespace

    from kernels import engram as engram_kernel
    from model.engram import GATE_CLAMP, Engram

    hc, d = 4, 5120
    g = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(n, hc, d, device="cuda", generator=g).bfloat16()
    kv = torch.randn(n, (hc + 1) * d, device="cuda", generator=g).bfloat16()
    qw = (torch.rand(hc, d, device="cuda", generator=g) + 0.5).bfloat16()
    kw = (torch.rand(hc, d, device="cuda", generator=g) + 0.5).bfloat16()
    key, value = kv.float().split([hc * d, d], dim=-1)
    gate = Engram.gate(SimpleNamespace(q_weight=qw, k_weight=kw, eps=1e-6, dim=d), x.float(), key.unflatten(-1, (hc, d)))
    want = (x.float() + gate.unsqueeze(-1) * value.unsqueeze(-2)).bfloat16()
    wide = engram_kernel.gate(x, kv, qw, kw, 1e-6, GATE_CLAMP)
    monkeypatch.setattr(engram_kernel, "WIDE_D", d)
    one_pass = engram_kernel.gate(x, kv, qw, kw, 1e-6, GATE_CLAMP)
    # a bf16 ulp (2^-8 to 2^-7 of the value); and where h and gate·value cancel, the gate's own fp32 error (its
    # sums over dim associate otherwise: ~1e-6 of it at this width) times |value| < 6 decides: atol 1e-5
    for got in (wide, one_pass):
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-5)
    torch.testing.assert_close(wide.float(), one_pass.float(), rtol=2 ** -7, atol=1e-5)


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


@pytest.mark.parametrize("E, k", [(16, 1), (16, 2), (384, 6)])
def test_gate_route_kernel_compiled_gives_the_bits_of_the_torch_gate(E, k):
    """kernels/moe.py `route` compiled against the gate's torch lines on CUDA: the same ids; the same weights
    up to k = 2, within fp32 rounding at the slice's k = 6 (torch sums 6 in another order)."""
    from kernels.moe import route

    g = torch.Generator(device="cuda").manual_seed(k)
    softplus = F.softplus(torch.randn(3000, E, generator=g, device="cuda") * 3)
    bias = torch.randn(E, generator=g, device="cuda") * 0.1
    scores = softplus.sqrt()
    ids = (scores + bias).topk(k, dim=-1).indices
    w = scores.gather(1, ids)
    if k > 1:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    got_w, got_ids = route(softplus, bias, k, True, 1.5)
    assert torch.equal(got_ids, ids)
    if k <= 2:  # the kernel sums the k weights in order: for k = 2 one add, as torch's sum of a pair
        assert torch.equal(got_w, w * 1.5)
    else:  # torch's sum of 6 associates otherwise (an H200 run: not bit for bit)
        torch.testing.assert_close(got_w, w * 1.5, rtol=2 ** -20, atol=0)


@pytest.mark.parametrize("E, d, k", [(16, 128, 2), (8, 64, 2), (384, 5120, 6)])
def test_compiled_gate_is_the_torch_gate_within_fp32_rounding_and_batch_invariant(E, d, k):
    """kernels/moe.py `gate` compiled (one launch at tiny-68m's 16 experts and micro's 8, two at the slice's
    384) against model/moe.py's torch lines on CUDA (cuBLAS's fp32 GEMM, torch's softplus): the same experts
    wherever the k-th and next biased scores are apart by more than fp32 rounding, the weights within it;
    and a row's bits the same alone, in a decode step's 64 and in a batch of 1,000 (each its own tile). The bf16
    weight: the same FMA chains up to 128 experts; beyond, on the tensor cores (kernels/moe.py use_tensor_cores),
    the same experts where the pick is clear by 1e-4 (as a prefill chunk's, below), a row's bits again its own
    at 1, 64 and 1,000 rows, and the batch-invariant mode back on the FMA chains."""
    from types import SimpleNamespace

    from kernels.moe import ROUTE_EXPERTS, gate
    from model.moe import Gate

    g = torch.Generator(device="cuda").manual_seed(E)
    x = torch.randn(1000, d, device="cuda", generator=g).bfloat16()
    module = Gate(SimpleNamespace(n_activated_experts=k, gate_temp=1.0, route_scale=1.5, norm_topk_prob=True,
                                  n_routed_experts=E, dim=d)).cuda()
    module.weight.data = (torch.randn(E, d, device="cuda", generator=g) * d ** -0.5).bfloat16()
    module.bias.data = torch.randn(E, device="cuda", generator=g) * 0.1
    module.fused = False
    want_w, want_ids = module(x)
    got_w, got_ids = gate(x, module.weight_fp32(), module.bias, 1.0, k, True, 1.5)
    scores = F.softplus(F.linear(x.double(), module.weight.double())).sqrt() + module.bias.double()
    top = scores.topk(k + 1, dim=-1).values
    clear = (top[:, k - 1] - top[:, k]) > 1e-5  # no near tie at the k-th pick: the same k experts
    assert clear.float().mean() > 0.9
    assert torch.equal(got_ids[clear].sort(-1).values, want_ids[clear].sort(-1).values)
    # by expert, not by slot: two picks a near tie apart may come in the other order (the slice's 6 of 384 did
    # on the H200), which the MoE's combine ignores (it adds in ascending expert id)
    dense = [torch.zeros(len(x), E, device="cuda").scatter_(1, i, w) for w, i in ((got_w, got_ids), (want_w, want_ids))]
    same = (got_ids.sort(-1).values == want_ids.sort(-1).values).all(-1)
    torch.testing.assert_close(dense[0][same], dense[1][same], rtol=1e-5, atol=1e-7)
    alone = [gate(x[i:i + 1], module.weight_fp32(), module.bias, 1.0, k, True, 1.5) for i in (0, 17, 999)]
    for i, (w, ids) in zip((0, 17, 999), alone):
        assert torch.equal(w, got_w[i:i + 1]) and torch.equal(ids, got_ids[i:i + 1])
    step = gate(x[:64], module.weight_fp32(), module.bias, 1.0, k, True, 1.5)  # a decode step's tile (gate_tiles)
    assert torch.equal(step[0], got_w[:64]) and torch.equal(step[1], got_ids[:64])
    bf16_weight = gate(x, module.weight, module.bias, 1.0, k, True, 1.5)
    if E <= ROUTE_EXPERTS:  # upcast in the kernel: the same chains
        assert torch.equal(bf16_weight[0], got_w) and torch.equal(bf16_weight[1], got_ids)
    else:  # on the tensor cores: exact products, fp32 sums in the MMA's order
        tc_clear = (top[:, k - 1] - top[:, k]) > 1e-4
        assert tc_clear.float().mean() > 0.9
        picked = bf16_weight[1][tc_clear].sort(-1).values
        assert torch.equal(picked, scores.topk(k, dim=-1).indices[tc_clear].sort(-1).values)
        exact = (scores - module.bias.double()).gather(1, bf16_weight[1])
        exact = exact / exact.sum(-1, keepdim=True) * 1.5
        torch.testing.assert_close(bf16_weight[0][tc_clear].double(), exact[tc_clear], rtol=1e-4, atol=0)
        for i in (0, 17, 999):
            w, ids = gate(x[i:i + 1], module.weight, module.bias, 1.0, k, True, 1.5)
            assert torch.equal(w, bf16_weight[0][i:i + 1]) and torch.equal(ids, bf16_weight[1][i:i + 1])
        tc_step = gate(x[:64], module.weight, module.bias, 1.0, k, True, 1.5)
        assert torch.equal(tc_step[0], bf16_weight[0][:64]) and torch.equal(tc_step[1], bf16_weight[1][:64])
        fma = gate(x, module.weight, module.bias, 1.0, k, True, 1.5, batch_invariant=True)
        assert torch.equal(fma[0], got_w) and torch.equal(fma[1], got_ids)
    print(f"E={E} d={d}: {(dense[0][same] != dense[1][same]).float().mean().item():.3%} of weights differ, "
          f"{(~same).sum().item()} rows pick otherwise ({(~clear).sum().item()} near ties), "
          f"{(got_ids != want_ids).any(-1).sum().item()} in another order")


def test_compiled_gate_of_a_prefill_chunk_on_the_tensor_cores():
    """A prefill chunk's gate at the slice's widths (8,192 rows of 384 x 5,120, kernels/moe.py TC_ROWS): the
    logits of bf16 x and W on the tensor cores (exact products, fp32 sums), against the same inputs' logits in
    fp64: the same experts wherever the k-th and next biased scores are apart by more than 1e-4, the weights
    within 1e-4 (the FMA chain's bound in the test above is 1e-5); a row's bits the same whatever rows share
    its tiles (x shifted by 32 rows, half a tile of rows); the batch-invariant mode keeps the FMA chains."""
    from kernels.moe import TC_ROWS, gate, gate_tiles

    E, d, k, n = 384, 5120, 6, 8192 + 32
    assert gate_tiles(8192, E, tc=True)[0] == 64 and 8192 >= TC_ROWS
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(n, d, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(E, d, device="cuda", generator=g) * d ** -0.5).bfloat16()
    bias = torch.randn(E, device="cuda", generator=g) * 0.1
    got_w, got_ids = gate(x[:8192], weight, bias, 1.0, k, True, 1.5)
    shifted = gate(x[32:], weight, bias, 1.0, k, True, 1.5)
    assert torch.equal(shifted[0][:-32], got_w[32:]) and torch.equal(shifted[1][:-32], got_ids[32:])
    scores = F.softplus(F.linear(x[:8192].double(), weight.double())).sqrt()
    top = (scores + bias.double()).topk(k + 1, dim=-1)
    clear = (top.values[:, k - 1] - top.values[:, k]) > 1e-4
    assert clear.float().mean() > 0.9
    assert torch.equal(got_ids[clear].sort(-1).values, top.indices[clear, :k].sort(-1).values)
    want = scores.gather(1, got_ids)
    want = want / want.sum(-1, keepdim=True) * 1.5
    torch.testing.assert_close(got_w[clear].double(), want[clear], rtol=1e-4, atol=0)
    fma = gate(x[:8192], weight, bias, 1.0, k, True, 1.5, batch_invariant=True)
    chains = gate(x[:8192], weight.float(), bias, 1.0, k, True, 1.5)
    assert torch.equal(fma[0], chains[0]) and torch.equal(fma[1], chains[1])
    print(f"{(~clear).sum().item()} near ties; weights {(got_w[clear].double() - want[clear]).abs().max().item():.3g} "
          f"from fp64 at most; {(got_ids != fma[1]).any(-1).sum().item()} rows pick otherwise than the FMA chains")


@pytest.mark.parametrize("M", [16, 64, 100])
def test_compiled_head_kernel_is_within_the_sum_error_of_the_fp32_product(M):
    """kernels/head.py compiled at the released width (d 5,120; 20,007 vocab rows: a partial tile): within the
    error bound of an fp32 sum of K terms of the exact product, and within 1e-5 of cuBLAS's fp32 F.linear."""
    from kernels import head as head_kernel

    g = torch.Generator(device="cuda").manual_seed(M)
    V, K = 20007, 5120
    x = torch.randn(M, K, generator=g, device="cuda").bfloat16()
    w = torch.randn(V, K, generator=g, device="cuda") * 0.02
    got = head_kernel.head(x, w)
    exact = x.double() @ w.double().T
    want = torch.nn.functional.linear(x.float(), w)
    print(f"head M={M}: max |kernel - exact| {(got.double() - exact).abs().max().item():.3g}, "
          f"max |cuBLAS - exact| {(want.double() - exact).abs().max().item():.3g}")
    bound = K * 2 ** -24 * (x.double().abs() @ w.double().abs().T)
    assert bool(((got.double() - exact).abs() <= bound).all())
    # ~10 fp32 ulps at these logits' size: the products summed into one running accumulator by the tensor
    # cores came out ~1.2e-4 off (their truncation), each K block's sum promoted to fp32 adds ~1e-6
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("M", [16, 64, 100])
def test_compiled_head_kernel_from_the_bf16_copy_gives_the_three_parts_bits(M, monkeypatch):
    """kernels/head.py compiled at the released width, a weight of bf16 values (the released head): one dot a
    block from its bf16 copy gives the three parts' bits (mid's and lo's dots added exact zeros), eagerly and from
    a CUDA graph's replays; during a capture with no copy found yet, none is made (no host sync) and the three
    parts run."""
    from kernels import head as head_kernel

    g = torch.Generator(device="cuda").manual_seed(M)
    V, K = 20007, 5120
    x = torch.randn(M, K, generator=g, device="cuda").bfloat16()
    w = (torch.randn(V, K, generator=g, device="cuda") * 0.02).bfloat16().float()
    monkeypatch.setattr(head_kernel, "USE_BF16_COPY", False)
    want = head_kernel.head(x, w)
    monkeypatch.setattr(head_kernel, "USE_BF16_COPY", True)
    fresh = w.clone()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # the warm-up (compilation) then a capture with no copy found for `fresh`
        head_kernel.head(x, w.clone())
        graph, out = torch.cuda.CUDAGraph(), None
        with torch.cuda.graph(graph):
            out = head_kernel.head(x, fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert getattr(fresh, "_head_bf16", None) is None and torch.equal(out, want)
    got = head_kernel.head(x, w)
    assert head_kernel.bf16_copy(w) is not None and torch.equal(got, want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = head_kernel.head(x, w)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


def torch_index_scores(q, w, keys, visible):
    """model/attention.py's torch lines for the index scores (its kernels off)."""
    from model import attention

    attention.USE_KERNELS = False
    try:
        return attention.index_scores(q, w, keys, visible)
    finally:
        attention.USE_KERNELS = True


def assert_scores_close(got, want):
    """The same -inf mask, the finite scores within a bf16 ulp (the dots and the head sum associate otherwise)."""
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = ~torch.isinf(want)
    torch.testing.assert_close(got[finite].float(), want[finite].float(), rtol=2 ** -7, atol=2 ** -6)


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
    got = kernel_scores(q, w, keys, visible)
    assert_scores_close(got, torch_index_scores(q, w, keys, visible))
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


def test_index_scores_decode_rows_in_blocks_a_program_give_the_bits_of_one_block_and_of_a_chunk():
    """At the slice's index heads (32 of 128) and a 32k row's ratio-2 entries, read in place from a shuffled paged
    pool: decode's row kernel in row_config's layout (several entry blocks a program, pipelined) gives the bits of
    one block a program and of the 16-query blocks' kernel on the same query."""
    from kernels import indexer

    g = torch.Generator(device="cuda").manual_seed(3)
    B, S, H, D, E, per_block = 3, 17, 32, 128, 16448, 64
    n_blocks = B * -(-E // per_block)
    pool = torch.randn(n_blocks + 5, per_block, D, generator=g, device="cuda").bfloat16()
    tables = torch.randperm(n_blocks + 5, generator=g, device="cuda")[:n_blocks].view(B, -1)
    q = torch.randn(B, S, H, D, generator=g, device="cuda").bfloat16()
    w = (torch.randn(B, S, H, generator=g, device="cuda") * 0.1).bfloat16()
    visible = torch.tensor([E, 9000, 4097], device="cuda")[:, None].expand(B, S).contiguous()
    assert indexer.row_config(E)["NB"] > 1
    chunk = indexer.index_scores(q, w, pool, visible, block_tables=tables, n_entries=E)  # 17 queries: blocks
    one = dict(indexer.row_config(E), NB=1)
    for s in (0, S - 1):
        at = dict(block_tables=tables, n_entries=E)
        got = indexer.index_scores(q[:, s:s + 1], w[:, s:s + 1], pool, visible[:, s:s + 1], **at)
        assert torch.equal(got, indexer.index_scores(q[:, s:s + 1], w[:, s:s + 1], pool, visible[:, s:s + 1],
                                                     cfg=one, **at)), s
        assert torch.equal(got, chunk[:, s:s + 1]), s


def test_index_scores_prefill_chunk_form_matches_the_torch_path_and_the_invariant_mode_keeps_its_form():
    """From CHUNK_ROWS queries (a prefill chunk, the slice's 64 heads of 128) the scores come from the bf16-dot
    form: within a bf16 ulp of the torch lines, with the same -inf mask. In the batch-invariant mode the same
    chunk keeps the tf32 form, whose rows have the bits of any other launch's (a 16-query slice here)."""
    from kernels import indexer

    g = torch.Generator(device="cuda").manual_seed(3)
    B, S, H, D, E = 1, indexer.CHUNK_ROWS, 64, 128, 600
    assert indexer.scores_config(S, torch.device("cuda"))["BF16"]
    q = torch.randn(B, S, H, D, generator=g, device="cuda").bfloat16()
    w = (torch.randn(B, S, H, generator=g, device="cuda") * 0.1).bfloat16()
    keys = torch.randn(B, E, D, generator=g, device="cuda").bfloat16()
    visible = torch.randint(0, E + 1, (B, S), generator=g, device="cuda")
    got = indexer.index_scores(q, w, keys, visible)
    assert_scores_close(got, torch_index_scores(q, w, keys, visible))
    invariant = indexer.index_scores(q, w, keys, visible, batch_invariant=True)
    tf32 = dict(BS=indexer.BLOCK_S, BE=indexer.BLOCK_E, BF16=False)  # the form below CHUNK_ROWS, forced
    assert torch.equal(invariant, indexer.index_scores(q, w, keys, visible, cfg=tf32))
    assert torch.equal(invariant[:, 32:48], indexer.index_scores(q[:, 32:48], w[:, 32:48], keys, visible[:, 32:48]))


@pytest.mark.parametrize("S,per_block", [(1, 128), (3, 64), (33, 128), (4096, 128)])
def test_index_scores_read_paged_keys_in_place_to_the_bits_of_the_copy(S, per_block):
    """Keys read through the block tables (model/paged.py's decode and prefill) give the bits of the same kernel
    over `stream`'s copy, in the decode row form (S < 16), the 16-query blocks and the prefill chunk's form;
    blocks of 128 (ratio 1) and 64 (ratio 2) entries, tables shuffled, rows of different lengths."""
    from kernels import indexer
    from model.attention import stream

    g = torch.Generator(device="cuda").manual_seed(S)
    B, H, D, E, n_blocks = 3, 64, 128, 700, 40
    pool = torch.randn(n_blocks, per_block, D, generator=g, device="cuda").bfloat16()
    tables = torch.randperm(n_blocks, generator=g, device="cuda")[:B * 12].view(B, 12)
    q = torch.randn(B, S, H, D, generator=g, device="cuda").bfloat16()
    w = (torch.randn(B, S, H, generator=g, device="cuda") * 0.1).bfloat16()
    visible = torch.randint(0, E + 1, (B, S), generator=g, device="cuda")
    visible[1] = visible[1].clamp(max=300)
    want = indexer.index_scores(q, w, stream(pool, tables, E), visible)
    assert torch.equal(indexer.index_scores(q, w, pool, visible, block_tables=tables, n_entries=E), want)


def test_moe_combine_kernel_compiled_rounds_to_bf16_as_torch_does():
    """The combine's bf16 output (what the fused grouped MoE returns) is the torch lines' fp32 sum rounded
    by .to(bfloat16), bit for bit."""
    from kernels.moe import combine

    g = torch.Generator(device="cuda").manual_seed(1)
    out = (torch.randn(9, 500, 128, generator=g, device="cuda") * 3).bfloat16()
    ids = torch.rand(500, 8, generator=g, device="cuda").topk(2, dim=-1).indices
    assert torch.equal(combine(out, ids, torch.bfloat16), combine(out, ids, torch.float32).bfloat16())


@pytest.mark.parametrize("name", ["micro", "v41-slice"])
def test_compiled_engram_kernels_match_the_torch_path(name, fused):
    """kernels/engram.py compiled: the hashes and the lookup give the torch path's bits; the gate is within
    a bf16 ulp (the sums over dim in another order), at micro's and at the slice's Engram widths."""
    import model.attention as attention
    from model.engram import Engram, EngramLayout, compressed_token_map, hash_ids, start_history
    from tests.test_engram import random_ids

    args = preset(name)
    g = torch.Generator(device="cuda").manual_seed(0)
    module = Engram(args, args.engram_layer_ids[0]).cuda()
    with torch.no_grad():
        for p in module.parameters():
            if p.dtype == torch.float8_e4m3fn:
                p.copy_(torch.randn(p.shape, device="cuda", generator=g).to(p.dtype))
            elif p.dtype == torch.float8_e8m0fnu:
                p.copy_(torch.exp2(torch.randint(-6, 3, p.shape, device="cuda", generator=g).float()).to(p.dtype))
            else:
                p.copy_(torch.randn(p.shape, device="cuda", generator=g) * p.shape[-1] ** -0.5)
    layout, token_map = EngramLayout.from_args(args).to("cuda"), compressed_token_map(args).cuda()
    comp = token_map[random_ids(args, 4, 33, seed=2).cuda()]
    history = start_history(args, token_map, 4)
    x = torch.randn(4, 33, args.hc_mult, args.dim, device="cuda", generator=g).bfloat16()

    from kernels import engram as engram_kernel

    def run(lookup):
        with torch.inference_mode():
            ids = hash_ids(layout, comp, history)
            return ids, lookup(ids[:, :, 0]), module(x, ids[:, :, 0])
    got = run(lambda ids: engram_kernel.lookup(ids, module.embed.weight, module.embed.scale))
    attention.USE_KERNELS = False
    try:
        want = run(module.embed.lookup)
    finally:
        attention.USE_KERNELS = True
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2].float(), want[2].float(), rtol=2 ** -7, atol=2 ** -16)  # a bf16 ulp
    print(f"{name}: {(got[2] != want[2]).float().mean().item():.3%} of the Engram outputs differ")


@pytest.mark.parametrize("B, S, E, k", [(64, 1, 16384, 512), (64, 1, 32768, 512), (64, 1, 300, 64), (2, 300, 150, 64),
                                        (4, 1, 70000, 2048), (1, 4096, 8192, 512), (64, 1, 32788, 512),
                                        (64, 1, 131072, 512)])
def test_compiled_topk_entries_give_the_torch_list(B, S, E, k, fused):
    """kernels/indexer.py's top-k compiled against the keyed top-k, sort and mask of the torch path: the same
    list, on bf16 scores with ties and -inf, at slice decode shapes (16k and 32k entries, k = 512: rows held in
    registers), tiny-68m's, a prefill chunk's, and rows longer than TOPK_PARTS_FROM in two launches (32,788 and
    131,072 entries: the candidates held; 70,000 at k = 2,048: the candidates read again each pass), where the
    one launch reading the row again each pass (part = 0) gives the same list."""
    import model.attention as attention
    from kernels import indexer as indexer_kernel

    g = torch.Generator(device="cuda").manual_seed(E)
    scores = torch.randn(B, S, E, device="cuda", generator=g).bfloat16()
    scores[:, :, ::7] = scores[:, :, :1]  # ties
    visible = torch.randint(0, E + 1, (B, S), device="cuda", generator=g)
    scores = scores.masked_fill(torch.arange(E, device="cuda") >= visible.unsqueeze(-1), -torch.inf)
    got = attention.topk_entries(scores, visible, k)
    attention.USE_KERNELS = False
    try:
        want = attention.topk_entries(scores, visible, k)
    finally:
        attention.USE_KERNELS = True
    assert torch.equal(got, want)
    if indexer_kernel.topk_parts(E, k):
        assert torch.equal(indexer_kernel.topk_entries(scores, visible, k, part=0), want)


@pytest.mark.parametrize("B", [1, 64, 1000])
@pytest.mark.parametrize("name", ["tiny-68m", "v41-slice"])
def test_compiled_compressor_decode_gives_the_torch_lines_bits(B, name):
    """kernels/compressor.py compiled against model/paged.py's torch lines at decode (torch's softmax, product,
    sum and cast, kernels/norm.py): the latent and the tails bit for bit, for closing and opening groups,
    gates at -inf among the members, and the rows a program of 1, 64 and 1,000 rows."""
    from kernels import compressor as compressor_kernel
    from model import attention

    args = preset(name)
    layer = next(i for i in args.kv_source_layers if args.compress_ratios[i] == 2)
    D = args.head_dim
    g = torch.Generator(device="cuda").manual_seed(B)
    comp = attention.Compressor(args, layer).cuda()
    comp.norm.weight.data = torch.randn(D, device="cuda", generator=g).bfloat16()
    positions = torch.randint(1, 100_000, (B,), device="cuda", generator=g)
    state_slots = torch.randperm(B, device="cuda", generator=g)
    a = torch.randn(B, 1, D, device="cuda", generator=g) * 4
    gates = torch.randn(B, 1, D, device="cuda", generator=g) * 6
    tails = tuple(torch.randn(B + 1, 2, D, device="cuda", generator=g) * 4 for _ in range(2))
    tails[1][::3, :, ::5] = -torch.inf
    tails[0][::7] = 0.0
    a[::11] = 0.0  # products that are zero: their sum +0
    at, want, want_tails = compressor_decode_case(comp, positions, state_slots, a, gates, tails, trash=B)
    assert compressor_kernel.applies(a, gates, tails)
    got = compressor_kernel.pool_decode(a, gates, tails, state_slots, at, comp.norm)
    assert torch.equal(tails[0][:B], want_tails[0][:B]) and torch.equal(tails[1][:B], want_tails[1][:B])
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), \
        f"{(got != want).sum().item()} of {got.numel()} values differ"


@pytest.mark.parametrize("case", ["window_kv", "index_keys", "index_queries", "compressed_kv"])
@pytest.mark.parametrize("name", ["tiny-68m", "v41-slice"])
def test_compiled_norm_rope_quant_gives_the_separate_kernels_bits(case, name):
    """kernels/latent.py compiled against kernels/norm.py, rope.py and quant.py launched in turn on the same
    rows: the same bits (each step is the same code on the same tile shapes); and against the torch path
    within a quantisation step where the norm's or RoPE's fp32 rounding moves a value across a boundary."""
    from kernels import latent as latent_kernel, norm as norm_kernel, quant as quant_kernel, rope as rope_kernel
    from model import attention
    from model.rope import rope_table

    args = preset(name)
    g = torch.Generator(device="cuda").manual_seed(5)
    heads = args.index_n_heads if case == "index_queries" else None
    D = args.index_head_dim if case in ("index_keys", "index_queries") else args.head_dim
    x = torch.randn(64, 3, *([heads] if heads else []), D, device="cuda", generator=g).bfloat16() * 3
    freqs = rope_table(args, 2, "cuda")[torch.randint(0, 1000, (64, 3), device="cuda", generator=g)]
    norm = None
    if case in ("window_kv", "index_keys"):
        norm = attention.RMSNorm(D, args.norm_eps).cuda()
        norm.weight.data = torch.randn(D, device="cuda", generator=g).bfloat16()
    quant, block = {"window_kv": ("fp8", 32), "compressed_kv": ("e4m3", 16)}.get(case, ("ue8m0", 32))
    got = latent_kernel.norm_rope_quant(x, norm, freqs, args.rope_head_dim, quant, block)
    for rows in (2, 8, max(1, min(64, 4096 // D))):  # the rows a program take no part in a row's bits
        assert torch.equal(latent_kernel.norm_rope_quant(x, norm, freqs, args.rope_head_dim, quant, block, rows), got)
        if heads is None:  # store_at: the same rows to table[i, j] too (model/paged.py's ring and blocks)
            table = torch.zeros(65, 4, D, device="cuda", dtype=x.dtype)
            i, j = torch.arange(64, device="cuda")[:, None].expand(64, 3), torch.arange(3, device="cuda").expand(64, 3)
            stored = latent_kernel.norm_rope_quant(x, norm, freqs, args.rope_head_dim, quant, block, rows,
                                                   store_at=(table, i, j))
            assert torch.equal(stored, got) and torch.equal(table[:64, :3], got) and not table[:, 3:].any()
            assert not table[64].any()
    y = norm_kernel.rms_norm(x, norm.weight, args.norm_eps) if norm is not None else x.clone()
    rope_kernel.apply_rope(y[..., -args.rope_head_dim:], freqs)
    y = quant_kernel.act_quant_fp8(y, block) if quant == "fp8" else quant_kernel.act_quant_fp4(y, block, quant)
    assert torch.equal(got, y)
    attention.USE_KERNELS = False
    try:
        want = attention.norm_rope_quant(x, norm, freqs, args.rope_head_dim, quant, block)
    finally:
        attention.USE_KERNELS = True
    step = want.float().unflatten(-1, (-1, block)).abs().amax(-1, keepdim=True) / (2 if quant != "fp8" else 8)
    assert ((got.float() - want.float()).unflatten(-1, (-1, block)).abs() <= step).all()
    print(f"{name} {case}: {(got != want).float().mean().item():.3%} of values differ from the torch path")
