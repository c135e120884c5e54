"""The CUDA compute paths of issue #7 against the torch paths they replace, on CPU tensors.

The HC split + Sinkhorn kernel runs here through Triton's interpreter (conftest sets TRITON_INTERPRET=1
without CUDA); the grouped MoE is plain torch and runs on CPU tensors as it does on CUDA. Both are
checked compiled on the GPU by tests/gpu/test_kernels_gpu.py. The CPU forward itself never takes these
paths, so the golden bits are untouched.
"""
import os

from types import SimpleNamespace

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


# a prefill chunk's handoff at wide streams (kernels/hc.py handoff_config): 8 tokens a program (so 15 tokens are a
# whole program and one in part; 64 compiled), the stream in blocks of 16 (d = 80 has five) and the collapse in
# blocks of 64 (at d = 80 the second in part)
WIDE = dict(T=8, BLOCK_K=16, BLOCK_D=64, num_warps=8)


@needs_interpreter
@pytest.mark.parametrize("cfg", [None, WIDE, dict(T=1, PART_K=128), dict(T=8, PART_K=128, BLOCK_K=16, num_warps=4)])
# a token a program (tiny-68m's form), several (a wide chunk's), the mixes summed in parts first by a token a
# program (a wide stream's in the batch-invariant mode) or by 8 (a wide stream's decode; at d = 80 the third of
# the 320 positions' parts is in part, and 15 tokens are a whole program and one in part)
@pytest.mark.parametrize("expand", [True, False])
@pytest.mark.parametrize("d", [128, 80])  # 128: tiny-68m (one 512-wide tile of the stream); 80: no power of two
def test_hc_handoff_kernel_matches_the_torch_path(expand, d, cfg):
    """The fused handoff (expand, mixes, Sinkhorn, collapse) against model/hc.py's torch ops in turn, on tokens
    of 3 x 5 rows: the stream within a bf16 ulp (the interpreter's bf16 cast truncates; tests/gpu checks the
    compiled rounding), the mixes and the collapse from the kernel's own stream within fp32 rounding (the
    collapse then within the truncation of its rounding). Several tokens a program: the mixes on the
    tensor-core path (fn split in three bf16 parts; the interpreter's dot in fp32 from the same values)."""
    g = torch.Generator().manual_seed(d + expand)
    h, fn, scale, base = hc_inputs(15, d=d, seed=d)
    h = h.view(3, 5, 4, d)
    y = torch.randn(3, 5, d, generator=g).bfloat16() if expand else None
    post, comb = (torch.rand(3, 5, 4, generator=g), torch.rand(3, 5, 4, 4, generator=g)) if expand else (None, None)
    pre = torch.rand(3, 5, 4, generator=g)
    got_stream, got_mixes, got_x = hc_kernel.hc_handoff(y, h, post, comb, fn, scale, base, pre, 20, 1e-6, 1e-20,
                                                        cfg=cfg)
    want = hc.hc_post(y, h, post, comb) if expand else h
    torch.testing.assert_close(got_stream.float(), want.float(), rtol=2 ** -7, atol=1e-6)
    for name, a, b in zip(("pre", "post", "comb"), hc.hc_mixes(got_stream, fn, scale, base, 4, 20, 1e-6, 1e-20),
                          got_mixes):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=name)
    torch.testing.assert_close(got_x.float(), hc.hc_pre(got_stream, pre).float(), rtol=2 ** -7, atol=1e-5)
    assert not expand or not torch.equal(got_x, hc.hc_pre(h, pre))  # the expanded stream is the one collapsed


def test_which_launches_take_the_tensor_core_forms():
    """kernels/hc.py handoff_config and kernels/moe.py use_tensor_cores. The handoff of a bf16 stream of the
    slice's width: 64 tokens a program from 4,096 tokens (a prefill chunk), 16 a program summing one part of the
    mixes below that (a decode step); a token a program at tiny-68m's width, in fp32 and in the batch-invariant
    mode (a token's bits its own), a wide stream's in parts fixed by the width alone. The gate's logits of a bf16
    weight on the tensor cores outside the batch-invariant mode: from 4,096 rows, and at any rows beyond 128
    experts (the slice's 384), there in one tile and parts of d fixed by the shape below 4,096 rows."""
    from kernels.hc import CHUNK_ROWS, handoff_config
    from kernels.moe import TC_ROWS, gate_tiles, use_tensor_cores

    stream = lambda n, d=5120, dtype=torch.bfloat16: torch.empty(n, 4, d, dtype=dtype, device="meta")  # noqa: E731
    assert handoff_config(stream(CHUNK_ROWS)) == dict(T=64, BLOCK_K=64, BLOCK_D=64, num_warps=8)
    decode = dict(T=16, PART_K=256, BLOCK_K=64, num_warps=4)
    assert handoff_config(stream(1)) == handoff_config(stream(64)) == handoff_config(stream(CHUNK_ROWS - 1)) == decode
    for n in (1, CHUNK_ROWS):
        assert handoff_config(stream(n), batch_invariant=True) == dict(T=1, PART_K=2048)
        assert handoff_config(stream(n, dtype=torch.float32)) == dict(T=1, PART_K=2048)
    assert handoff_config(stream(CHUNK_ROWS, d=128)) == dict(T=1)  # tiny-68m: one launch, its trace's bits
    tiny = torch.empty(16, 128, dtype=torch.bfloat16, device="meta")
    assert use_tensor_cores(TC_ROWS, tiny, False)
    assert not use_tensor_cores(TC_ROWS - 1, tiny, False) and not use_tensor_cores(TC_ROWS, tiny, True)
    assert not use_tensor_cores(TC_ROWS, tiny.float(), False)
    wide = torch.empty(384, 5120, dtype=torch.bfloat16, device="meta")
    assert all(use_tensor_cores(n, wide, False) for n in (1, 64, TC_ROWS - 1, TC_ROWS))
    assert not any(use_tensor_cores(n, wide, True) or use_tensor_cores(n, wide.float(), False) for n in (1, TC_ROWS))
    assert gate_tiles(1, 384, tc=True) == gate_tiles(TC_ROWS - 1, 384, tc=True) == (64, 32, 64, 4, 3)


@pytest.mark.parametrize("invariant_mode", [False, True])
def test_the_fused_handoff_and_gate_are_told_the_batch_invariant_mode(monkeypatch, invariant_mode):
    """model/hc.py `handoff` and model/moe.py `Gate` pass the mode to their fused launches, which keep a token's
    bits its own in it (the kernels, recorded here, are CUDA-only; the switch is what is checked)."""
    import model.hc as model_hc
    import model.moe as model_moe
    from kernels import moe as moe_kernel
    from model import invariant
    from model.moe import Gate

    seen = {}
    record = lambda name: lambda *a, batch_invariant, **k: seen.setdefault(name, batch_invariant)  # noqa: E731
    monkeypatch.setattr(model_hc, "use_fused", lambda x: True)
    monkeypatch.setattr(model_moe, "use_fused", lambda x: True)
    monkeypatch.setattr(hc_kernel, "hc_handoff", record("handoff"))
    monkeypatch.setattr(moe_kernel, "gate", record("gate"))
    h, fn = torch.zeros(2, 4, 8), torch.zeros(24, 32)
    with invariant.mode(invariant_mode), pytest.raises(TypeError):  # the recorder returns no tuple: stop there
        model_hc.handoff(None, h, None, None, fn, fn[0, :3], fn[0], 4, 20, 1e-6, 1e-6, h[..., 0])
    gate = Gate(SimpleNamespace(n_activated_experts=2, gate_temp=1.0, route_scale=1.0, norm_topk_prob=True,
                                n_routed_experts=16, dim=8))
    with invariant.mode(invariant_mode):
        gate(torch.zeros(3, 8))
    assert seen == {"handoff": invariant_mode, "gate": invariant_mode}


@needs_interpreter
@pytest.mark.parametrize("cfg", [None, WIDE])
@pytest.mark.parametrize("d", [128, 80])
def test_hc_handoff_kernel_norms_its_collapse_as_the_norm_kernel_does(d, cfg):
    """With the sublayer's norm weight the handoff also returns the RMSNorm of its collapse x, as kernels/norm.py
    computes it from that x (the sum of squares over another tile: within an fp32 ulp before the rounding, the
    interpreter truncating the cast), and its other values unchanged."""
    from kernels import norm as norm_kernel

    g = torch.Generator().manual_seed(d)
    h, fn, scale, base = hc_inputs(15, d=d, seed=d)
    y, pre = torch.randn(15, d, generator=g).bfloat16(), torch.rand(15, 4, generator=g)
    post, comb = torch.rand(15, 4, generator=g), torch.rand(15, 4, 4, generator=g)
    weight = (torch.rand(d, generator=g) + 0.5).bfloat16()
    plain = hc_kernel.hc_handoff(y, h, post, comb, fn, scale, base, pre, 20, 1e-6, 1e-20, cfg=cfg)
    stream, mixes, x, normed = hc_kernel.hc_handoff(y, h, post, comb, fn, scale, base, pre, 20, 1e-6, 1e-20,
                                                    weight, 1e-6, cfg=cfg)
    assert torch.equal(stream, plain[0]) and torch.equal(x, plain[2])
    assert all(torch.equal(a, b) for a, b in zip(mixes, plain[1]))
    want = norm_kernel.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(normed.float(), want.float(), rtol=2 ** -7, atol=1e-6)
    assert not torch.equal(normed, x)


@needs_interpreter
@pytest.mark.parametrize("M, H, D, R, G, rank", [(5, 4, 128, 32, 2, 64), (70, 2, 64, 16, 2, 32), (3, 4, 32, 8, 4, 48),
                                                 (4, 2, 64, 16, 4, 32), (3, 3, 32, 8, 2, 48)])
def test_rope_wo_a_kernel_is_the_inverse_rotation_then_the_grouped_gemm(M, H, D, R, G, rank):
    """kernels/output.py against model/attention.py's CUDA lines (kernels/rope.py's inverse rotation, then the
    grouped einsum): within fp32 rounding before the bf16 rounding (another order of the GEMM's sums), o left as
    it is; and with wo_a an identity per group, the rotation itself bit for bit. Shapes: tiny-68m's (4 heads of
    128, rope 32, 2 groups of rank 64), micro's over 70 rows (more than one row tile), a group of one head of a
    rank that is not a power of two, a group of half a head (the rope dims in every other group) and groups
    of a head and a half."""
    from kernels import output as output_kernel, rope as rope_kernel
    from model.rope import rope_table

    g = torch.Generator().manual_seed(M + D)
    args = preset("tiny-68m")
    args.rope_head_dim = R
    freqs = rope_table(args, 0)[torch.randint(0, 1000, (M,), generator=g)]  # [M, R/2] complex
    o = torch.randn(M, H, D, generator=g).bfloat16()
    K = H * D // G
    wo_a = (torch.randn(G, rank, K, generator=g) * K ** -0.5).bfloat16()
    before = o.clone()
    got = output_kernel.rope_wo_a(o, freqs, wo_a, R)
    assert torch.equal(o, before), "the kernel wrote o"
    rotated = o.clone()
    rope_kernel.apply_rope(rotated[..., -R:], freqs, inverse=True)
    assert not torch.equal(rotated, o)
    want = torch.einsum("mgk,grk->mgr", rotated.float().view(M, G, K), wo_a.float()).flatten(1)
    torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=1e-5)
    eye = torch.eye(K).expand(G, K, K).bfloat16().contiguous()
    assert torch.equal(output_kernel.rope_wo_a(o, freqs, eye, R), rotated.view(M, G * K))


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
    gathered copy, with each block's rows loaded an iteration ahead (PREFETCH) or not. (The interpreter's bf16
    dot is not faithful, so the numerics against the torch path are checked compiled, in tests/gpu; here both
    sides run the same interpreted arithmetic, the dots in fp32.)"""
    from kernels.attention import paged_sparse_attn, sparse_attn

    B, H, D, W, per_block, n_blocks, L = 3, 2, 16, 8, 4, 12, 150  # three blocks of 64 indices, the last part-full
    g = torch.Generator().manual_seed(S)
    q = torch.randn(B, S, H, D, generator=g).bfloat16()
    ring, kv = torch.randn(5, W, D, generator=g).bfloat16(), torch.randn(B, S, D, generator=g).bfloat16()
    pool = torch.randn(n_blocks, per_block, D, generator=g).bfloat16()
    slots, tables = torch.randperm(5, generator=g)[:B], torch.randperm(n_blocks, generator=g)[:B * 3].view(B, 3)
    sink = torch.randn(H, generator=g)
    idx = torch.randint(-1, W + S + 3 * per_block, (B, S, L), generator=g)
    gathered = torch.cat([ring[slots], kv, pool[tables].flatten(1, 2)], dim=1)
    want = sparse_attn(q, gathered, sink, idx, D ** -0.5, cfg=dict(PREFETCH=False))
    for prefetch in (False, True):  # each block's rows loaded as it starts, or an iteration ahead: the same
        got = paged_sparse_attn(q, ring, slots, kv, pool, tables, sink, idx, D ** -0.5, cfg=dict(PREFETCH=prefetch))
        assert torch.equal(got, want), prefetch


def test_a_launch_the_device_cannot_hold_takes_the_kernels_next_smaller_configuration(monkeypatch):
    """kernels/fit.py: where Triton refuses a configuration for its shared memory (OutOfResources, raised as it loads
    the kernel, before anything runs), `launch` runs the kernel's next smaller one (its module's `smaller`); every
    launch starts from the configuration asked for, so what runs never depends on an earlier launch. A kernel with no
    smaller configuration, or none that fits, raises Triton's error. A stand-in kernel that holds 32 heads a program
    at most; sparse attention's `smaller` halves the heads down to 16."""
    pytest.importorskip("triton")
    from kernels import attention, fit

    ran = []

    class Kernel:  # kernel[grid](*args, **kwargs), refusing more than 32 heads a program as a small GPU would
        def __getitem__(self, grid):
            def run(*args, **cfg):
                if cfg["BLOCK_H"] > 32:
                    raise fit.OutOfResources(263200, 232448, "shared memory")
                ran.append((grid, args, cfg))
            return run

    kernel = Kernel()
    monkeypatch.setattr(fit, "SMALLER", {})  # the stand-in's entry leaves with the test
    fit.register(kernel, attention.smaller)
    grid = lambda c: (4, 64 // c["BLOCK_H"])  # noqa: E731
    assert fit.launch(kernel, grid, (1, 2), dict(BLOCK_H=64, num_warps=8), D=512) == dict(BLOCK_H=32, num_warps=8)
    assert ran == [((4, 2), (1, 2), dict(D=512, BLOCK_H=32, num_warps=8))]
    assert fit.launch(kernel, grid, (1, 2), dict(BLOCK_H=16, num_warps=8), D=512)["BLOCK_H"] == 16  # fits as asked
    assert fit.launch(kernel, grid, (1, 2), dict(BLOCK_H=64, num_warps=8), D=512)["BLOCK_H"] == 32  # the same again
    fit.SMALLER[kernel] = lambda cfg: None  # nothing smaller: Triton's error stands
    with pytest.raises(fit.OutOfResources):
        fit.launch(kernel, grid, (1, 2), dict(BLOCK_H=64, num_warps=8), D=512)
    assert attention.smaller(dict(BLOCK_H=32, num_warps=8)) == dict(BLOCK_H=16, num_warps=8)
    assert attention.smaller(dict(BLOCK_H=16)) is None


@needs_interpreter
def test_sparse_attention_takes_decode_tiles_at_wide_heads_only_outside_the_batch_invariant_mode(monkeypatch):
    """kernels/attention.py `config`: a decode step's queries (one a row) at wide heads take DECODE_WIDE's tiles,
    a chunk's and the batch-invariant mode's (whose decode rows must keep a chunk's bits) one block of all heads;
    narrow heads (tiny-68m's 128) the same tiles in every case. And the launch asks for the decode tiles exactly
    when a row has one query and the mode is off."""
    from kernels import attention
    from model import invariant

    assert attention.config(64, 512, decode=True) == attention.DECODE_WIDE
    assert attention.config(64, 512)["BLOCK_H"] == 64
    assert attention.config(16, 128, decode=True) == attention.config(16, 128)
    asked = []
    real = attention.config
    monkeypatch.setattr(attention, "config", lambda H, D, decode=False: asked.append(decode) or real(H, D, decode))
    g = torch.Generator().manual_seed(0)
    for S, mode in ((1, False), (3, False), (1, True)):
        q, kv = torch.randn(2, S, 2, 16, generator=g).bfloat16(), torch.randn(2, 9, 16, generator=g).bfloat16()
        idx = torch.randint(-1, 9, (2, S, 9), generator=g)
        with invariant.mode(mode):
            attention.sparse_attn(q, kv, torch.zeros(2), idx, 0.25)
    assert asked == [True, False, False]


@needs_interpreter
@pytest.mark.parametrize("S", [1, 7])
def test_paged_sparse_attention_rotates_q_as_it_loads_it_as_the_rope_kernel_does(S):
    """With `freqs` the kernel takes q without its RoPE and rotates its last R dims as it loads them: the same
    result as q rotated first by kernels/rope.py (the same bf16 q), bit for bit; and not the unrotated one."""
    from kernels import rope as rope_kernel
    from kernels.attention import paged_sparse_attn
    from model.rope import rope_table

    B, H, D, R, W, per_block, n_blocks, L = 3, 2, 32, 16, 8, 4, 12, 24
    g = torch.Generator().manual_seed(S + 10)
    args = preset("tiny-68m")
    args.rope_head_dim = R
    freqs = rope_table(args, 0)[torch.randint(0, 500, (B, S), generator=g)]  # [B, S, R/2] complex
    q = torch.randn(B, S, H, D, generator=g).bfloat16()
    ring, kv = torch.randn(5, W, D, generator=g).bfloat16(), torch.randn(B, S, D, generator=g).bfloat16()
    pool = torch.randn(n_blocks, per_block, D, generator=g).bfloat16()
    slots, tables = torch.randperm(5, generator=g)[:B], torch.randperm(n_blocks, generator=g)[:B * 3].view(B, 3)
    sink, idx = torch.randn(H, generator=g), torch.randint(-1, W + S + 3 * per_block, (B, S, L), generator=g)
    rotated = q.clone()
    rope_kernel.apply_rope(rotated[..., -R:], freqs)
    sources = (ring, slots, kv, pool, tables, sink, idx, D ** -0.5)
    got = paged_sparse_attn(q, *sources, freqs=freqs)
    assert torch.equal(got, paged_sparse_attn(rotated, *sources))
    assert not torch.equal(got, paged_sparse_attn(q, *sources))


def test_q_is_rotated_at_sparse_attentions_load_only_for_narrow_heads():
    """kernels/attention.py rope_at_load: tiny-68m's heads (128) take q's RoPE in the kernel's load (one launch
    fewer a layer); the slice's (512) rotate q first, where the rotated q beside the [64, 512] accumulator
    would make the compiled kernel spill."""
    from kernels import attention

    assert attention.rope_at_load(preset("tiny-68m").head_dim)
    assert not attention.rope_at_load(preset("v41-slice").head_dim)


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
@pytest.mark.parametrize("tc", [False, True])  # the logits by FMA chains, or on the tensor cores (a prefill chunk's)
@pytest.mark.parametrize("E,k,temp,part_d", [(16, 2, 1.0, None), (16, 1, 0.7, None), (200, 6, 1.0, 0), (200, 6, 0.7, 32)])
def test_gate_kernel_is_the_torch_gate_within_fp32_rounding(E, k, temp, part_d, tc):
    """kernels/moe.py `gate` (the logits' GEMM, / temp, softplus and the route in one launch up to 128
    experts, two beyond, d then in parts whose sums the route adds: 4 parts of 32 here, by FMA chains) against
    model/moe.py's torch lines, on rows and widths that are not multiples of
    the tiles: the same experts in the same order, the weights within fp32 rounding: a logit's d sums in
    another order differ by up to D·2^-24·Σ|x·w| (torch's CPU GEMM sums by the machine's vector width), which
    a score sqrt(softplus(logit / temp)) of a very negative logit carries relatively, halved and over temp;
    the softplus through fp64. Very negative logits keep their tiny softplus."""
    from kernels.moe import gate
    from model.moe import Gate

    g = torch.Generator().manual_seed(E + k)
    N, D = 37, 100
    x = (torch.randn(N, D, generator=g) * 2).bfloat16()
    x[:, 0] = 4.0
    weight = torch.randn(E, D, generator=g) * 0.3
    weight[3, 0] = -12.0  # expert 3's logits near -48: softplus ~ 1e-21, its score sqrt ~ 3e-11
    bias = torch.randn(E, generator=g) * 0.1
    bias[3] = 10.0  # ... and the bias picks it first in every row, so its tiny weight is compared
    module = Gate(SimpleNamespace(n_activated_experts=k, gate_temp=temp, route_scale=1.5, norm_topk_prob=True,
                                  n_routed_experts=E, dim=D))
    module.weight.data, module.bias.data = weight.bfloat16(), bias
    want_w, want_ids = module(x)
    got_w, got_ids = gate(x, module.weight, bias, temp, k, True, 1.5, tc=tc, part_d=part_d)
    assert torch.equal(got_ids, want_ids) and (want_ids[:, 0] == 3).all()
    sums = (x.float().abs() @ module.weight.float().abs().T).gather(1, want_ids)  # Σ|x·w| of each pick
    rtol = 1e-5 + 0.5 / temp * D * 2 ** -24 * sums.amax(-1, keepdim=True)  # a slot's weight also carries the row's sum
    assert ((got_w - want_w).abs() <= rtol * want_w.abs()).all(), ((got_w - want_w).abs() / want_w.abs()).amax()
    assert k == 1 or (want_w[:, 0] < 1e-8).all()
    if part_d:  # the parts are taken (on the tensor cores too, below TC_ROWS rows): other sums than one part's
        whole = gate(x, module.weight, bias, temp, k, True, 1.5, tc=tc, part_d=0)
        assert not torch.equal(got_w, whole[0])


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


@needs_interpreter
def test_index_scores_kernel_reads_paged_keys_in_place():
    """With block tables, `index_scores` reads a kv source's keys where they lie in the paged pool (no streamed
    copy, model/paged.py): the scores of the torch path over `stream`'s copy, for blocks of 16 entries (four to
    an entry block of the kernel), tables in shuffled order (a strided view) and one row shorter than the other."""
    from kernels.indexer import index_scores as kernel_scores
    from model import attention

    g = torch.Generator().manual_seed(1)
    B, H, D, E, per_block, n_blocks = 2, 4, 16, 70, 16, 12
    pool = torch.randint(-1, 2, (n_blocks, per_block, D), generator=g).bfloat16()
    tables = torch.randperm(n_blocks, generator=g)[:2 * 6].view(B, 6)[:, :5]  # a strided view, as a step's tables are
    for S in (3, 17):
        q = torch.randint(-1, 2, (B, S, H, D), generator=g).bfloat16()
        w = (2 ** torch.randint(0, 2, (B, S, H), generator=g)).bfloat16()
        visible = torch.randint(0, E + 1, (B, S), generator=g)
        visible[1] = visible[1].clamp(max=40)
        want = attention.index_scores(q, w, attention.stream(pool, tables, E), visible)
        assert torch.equal(attention.index_scores(q, w, pool, visible, tables, E), want), S
        got = kernel_scores(q, w, pool, visible, block_tables=tables, n_entries=E)
        assert torch.equal(got, want), S


@needs_interpreter
def test_index_scores_decode_rows_give_the_same_bits_in_every_layout():
    """Decode's row kernel scores NB blocks of BE entries a program (kernels/indexer.py `row_config`): 1, 2 and 3
    blocks of 16 a program over paged keys (programs ending past E and inside a row's visible entries, two head
    blocks) give the bits of one block a program and of the torch path over values whose products are exact."""
    from kernels.indexer import index_scores as kernel_scores
    from model import attention

    g = torch.Generator().manual_seed(2)
    B, H, D, E, per_block, n_blocks = 2, 32, 16, 70, 16, 12
    pool = torch.randint(-1, 2, (n_blocks, per_block, D), generator=g).bfloat16()
    tables = torch.randperm(n_blocks, generator=g)[:2 * 5].view(B, 5)
    q = torch.randint(-1, 2, (B, 1, H, D), generator=g).bfloat16()
    w = (2 ** torch.randint(0, 2, (B, 1, H), generator=g)).bfloat16()
    visible = torch.tensor([[E], [37]])
    want = attention.index_scores(q, w, attention.stream(pool, tables, E), visible)
    for NB in (1, 2, 3):
        got = kernel_scores(q, w, pool, visible, block_tables=tables, n_entries=E,
                            cfg=dict(BE=16, NB=NB, num_warps=2, num_stages=2))
        assert torch.equal(got, want), NB


def test_index_scores_decode_rows_take_blocks_a_program_only_from_many_entries():
    """`row_config`: ROW_TILE's blocks a program from ROW_BLOCKS_FROM entries a row, one below (tiny-68m's rows)."""
    from kernels import indexer as indexer_kernel

    n = indexer_kernel.ROW_BLOCKS_FROM
    assert indexer_kernel.row_config(n)["NB"] == indexer_kernel.ROW_TILE["NB"] > 1
    assert indexer_kernel.row_config(n - 1)["NB"] == 1
    assert indexer_kernel.row_config(n - 1)["BE"] == indexer_kernel.ROW_TILE["BE"]


@needs_interpreter
@pytest.mark.parametrize("name", ["tiny-68m", "micro"])
def test_engram_hash_kernel_gives_the_torch_ids(name):
    """kernels/engram.py's hashes against model/engram.py's torch path: the same int64 ids, for chunks with
    and without history (the look-back crossing into it), the largest compressed id and id 0 included."""
    from kernels import engram as engram_kernel
    from model.engram import EngramLayout, compressed_token_map, hash_ids, start_history
    from tests.test_engram import random_ids

    args = preset(name)
    layout, token_map = EngramLayout.from_args(args), compressed_token_map(args)
    comp = token_map[random_ids(args, 3, 11, seed=5)]
    for history in (start_history(args, token_map, 3), comp[:, :3].flip(1)):
        got = engram_kernel.hash_ids(layout, comp, history)
        assert torch.equal(got, hash_ids(layout, comp, history))


@needs_interpreter
def test_engram_lookup_and_gate_kernels_match_the_torch_path():
    """The lookup gives the torch path's bits (an exact dequantisation); the gate and its mix within a bf16
    ulp of model/engram.py's fp32 ops (another order of the sums over dim, then one rounding)."""
    from kernels import engram as engram_kernel
    from model.engram import GATE_CLAMP, EngramLayout, compressed_token_map, hash_ids, start_history
    from tests.test_engram import random_engram, random_ids

    args = preset("micro")
    module = random_engram(args, 4, seed=3)
    layout, token_map = EngramLayout.from_args(args), compressed_token_map(args)
    row_ids = hash_ids(layout, token_map[random_ids(args, 2, 9, seed=6)], start_history(args, token_map, 2))
    row_ids = row_ids[:, :, module.layer_index]
    with torch.inference_mode():
        rows = engram_kernel.lookup(row_ids, module.embed.weight, module.embed.scale)
        assert torch.equal(rows, module.embed.lookup(row_ids))
        x = torch.randn(2, 9, args.hc_mult, args.dim, generator=torch.Generator().manual_seed(8)).bfloat16()
        kv = module.wkv(rows.flatten(-2))
        got = engram_kernel.gate(x, kv, module.q_weight, module.k_weight, module.eps, GATE_CLAMP)
        want = module(x, row_ids)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -8, atol=1e-6)
    assert not torch.equal(got, x)


def test_index_scores_take_the_chunk_form_only_for_a_prefill_chunk_outside_the_invariant_mode(monkeypatch):
    """kernels/indexer.py `scores_config`: the bf16-dot form from CHUNK_ROWS queries on CUDA, never in the
    batch-invariant mode nor on CPU; and model/attention.py passes the mode to the kernel."""
    from kernels import indexer as indexer_kernel
    from model import attention, invariant

    cuda, n = torch.device("cuda"), indexer_kernel.CHUNK_ROWS
    assert indexer_kernel.scores_config(n, cuda)["BF16"]
    assert indexer_kernel.scores_config(4 * n, cuda)["BS"] == 64
    base = dict(BS=indexer_kernel.BLOCK_S, BE=indexer_kernel.BLOCK_E, BF16=False)
    assert indexer_kernel.scores_config(n - 1, cuda) == base
    assert indexer_kernel.scores_config(n, cuda, batch_invariant=True) == base
    assert indexer_kernel.scores_config(n, torch.device("cpu")) == base
    seen = []
    monkeypatch.setattr(indexer_kernel, "applies_scores", lambda q, keys: True)
    monkeypatch.setattr(indexer_kernel, "index_scores", lambda *a, **k: seen.append(k["batch_invariant"]))
    q, keys = torch.zeros(1, 2, 4, 16), torch.zeros(1, 3, 16)
    attention.index_scores(q, torch.zeros(1, 2, 4), keys, torch.ones(1, 2, dtype=torch.long))
    with invariant.mode():
        attention.index_scores(q, torch.zeros(1, 2, 4), keys, torch.ones(1, 2, dtype=torch.long))
    assert seen == [False, True]


@needs_interpreter
def test_engram_gate_kernel_past_the_wide_dim_matches_the_torch_path(monkeypatch):
    """kernels/engram.py's two-pass gate (a dim past WIDE_D, the released 5,120's form; 2,304 here, not a multiple
    of its 512-wide blocks) against model/engram.py's fp32 ops and against the one-pass kernel on the same rows:
    within a bf16 ulp (the sums over dim associate otherwise, then one rounding)."""
    from types import SimpleNamespace

    from kernels import engram as engram_kernel
    from model.engram import GATE_CLAMP, Engram

    hc, d, n = 4, 2304, 3
    g = torch.Generator().manual_seed(11)
    x = torch.randn(n, hc, d, generator=g).bfloat16()
    kv = torch.randn(n, (hc + 1) * d, generator=g).bfloat16()
    qw, kw = (torch.rand(hc, d, generator=g) + 0.5).bfloat16(), (torch.rand(hc, d, generator=g) + 0.5).bfloat16()
    x[1, 2] = -x[1, 2]  # copies whose dot has the other sign
    key, value = kv.float().split([hc * d, d], dim=-1)
    module = SimpleNamespace(q_weight=qw, k_weight=kw, eps=1e-6, dim=d)
    gate = Engram.gate(module, x.float(), key.unflatten(-1, (hc, d)))
    assert (gate > 0.6).any() and (gate < 0.4).any()  # both signs of the dot
    want = (x.float() + gate.unsqueeze(-1) * value.unsqueeze(-2)).bfloat16()
    with torch.inference_mode():
        wide = engram_kernel.gate(x, kv, qw, kw, 1e-6, GATE_CLAMP)
        monkeypatch.setattr(engram_kernel, "WIDE_D", d)  # the one-pass kernel at the same width
        one_pass = engram_kernel.gate(x, kv, qw, kw, 1e-6, GATE_CLAMP)
    # a bf16 ulp (2^-8 to 2^-7 of the value); and where h and gate·value cancel, the gate's own fp32 error (its
    # sums over dim associate otherwise: ~1e-6 of it at this width) times |value| < 6 decides: atol 1e-5
    for got in (wide, one_pass):
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-5)
    torch.testing.assert_close(wide.float(), one_pass.float(), rtol=2 ** -7, atol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("E, k, block, part", [(300, 64, 4096, None), (300, 64, 128, None), (50, 50, 64, None),
                                               (37, 5, 16, None), (300, 64, 4096, 64), (300, 64, 128, 128)])
def test_topk_entries_kernel_gives_the_torch_list(dtype, E, k, block, part):
    """kernels/indexer.py's top-k against model/attention.py's keyed top-k, sort and mask: the same list, with
    ties at the k-th score (bf16 scores of few values), -0.0 beside +0.0, -inf (masked and invisible entries)
    inside the top k, rows where fewer than k entries are visible, and rows over several passes (block < E);
    in two launches (`part`: each part's top k, a last part shorter than k, then the candidates' top k, held or
    over several passes)."""
    from kernels import indexer as indexer_kernel
    from model.attention import topk_entries

    g = torch.Generator().manual_seed(E + k + block)
    B, S = 3, 4
    scores = (torch.randint(-4, 5, (B, S, E), generator=g) * 0.5).to(dtype)
    scores[0, 0] = torch.randn(E, generator=g).to(dtype)  # no ties
    scores[0, 1, ::3] = -0.0
    visible = torch.randint(0, E + 1, (B, S), generator=g)
    visible[1, 2] = 0
    visible[2, 3] = E
    scores = scores.masked_fill(torch.arange(E) >= visible.unsqueeze(-1), -torch.inf)
    scores[2, 0, :E // 2] = -torch.inf  # masked by candidates inside the visible entries
    assert indexer_kernel.topk_parts(E, k, part) == {None: 0, 64: 5, 128: 3}[part]
    got = indexer_kernel.topk_entries(scores, visible, k, block, part=part)
    assert torch.equal(got, topk_entries(scores, visible, k))


@needs_interpreter
@pytest.mark.parametrize("case", ["window_kv", "index_keys", "index_queries", "compressed_kv"])
def test_norm_rope_quant_kernel_matches_the_torch_chain(case):
    """kernels/latent.py against model/attention.py's torch ops in turn (norm, RoPE in place, quantisation)
    for each of its four uses: the same values but where the interpreter's truncating bf16 cast moves a value
    to a neighbouring grid point (at most one quantisation step of its group)."""
    from kernels import latent as latent_kernel
    from model import attention
    from model.rope import rope_table

    args = preset("micro")
    g = torch.Generator().manual_seed(11)
    heads = 4 if case == "index_queries" else None
    D = args.index_head_dim if case in ("index_keys", "index_queries") else args.head_dim
    x = torch.randn(2, 6, *([heads] if heads else []), D, generator=g).bfloat16() * 3
    freqs = rope_table(args, 2)[torch.randint(0, 1000, (2, 6), generator=g)]
    norm = None
    if case in ("window_kv", "index_keys"):
        norm = attention.RMSNorm(D, args.norm_eps)
        norm.weight.data = torch.randn(D, generator=g).bfloat16()
    quant, block = {"window_kv": ("fp8", 32), "compressed_kv": ("e4m3", 16)}.get(case, ("ue8m0", 32))
    before = x.clone()
    want = attention.norm_rope_quant(x, norm, freqs, args.rope_head_dim, quant, block)  # CPU: the torch ops
    got = latent_kernel.norm_rope_quant(x, norm, freqs, args.rope_head_dim, quant, block)
    assert torch.equal(x, before) and got.shape == want.shape and got.dtype == want.dtype
    step = want.float().unflatten(-1, (-1, block)).abs().amax(-1, keepdim=True) / (2 if quant != "fp8" else 8)
    assert ((got.float() - want.float()).unflatten(-1, (-1, block)).abs() <= step).all()
    assert (got == want).float().mean() > 0.9


@needs_interpreter
@pytest.mark.parametrize("case", ["window_kv", "compressed_kv"])
def test_norm_rope_quant_kernel_stores_its_rows_to_a_paged_table(case):
    """store_at (table, i, j): the launch writes each result row to table[i, j] as well (model/paged.py's ring
    at decode, the blocks' entries and index keys), what index_put would write, and leaves the rest of the table
    and the returned tensor as they were; rows sent to one trash row leave one of them there."""
    from kernels import latent as latent_kernel
    from model import attention
    from model.rope import rope_table

    args = preset("micro")
    g = torch.Generator().manual_seed(5)
    D = args.head_dim
    x = torch.randn(2, 6, D, generator=g).bfloat16() * 3
    freqs = rope_table(args, 2)[torch.randint(0, 1000, (2, 6), generator=g)]
    norm = attention.RMSNorm(D, args.norm_eps) if case == "window_kv" else None
    if norm is not None:  # its weight is torch.empty's until set
        norm.weight.data = torch.randn(D, generator=g).bfloat16()
    quant, block = ("fp8", 32) if case == "window_kv" else ("e4m3", 16)
    table = torch.full((4, 8, D), 7.0).bfloat16()  # 3 slots of 8 rows and the trash slot 3
    i = torch.tensor([[0, 0, 3, 1, 2, 3], [2, 3, 3, 3, 1, 0]])
    j = torch.tensor([[0, 5, 1, 7, 2, 1], [6, 1, 1, 1, 0, 3]])
    plain = latent_kernel.norm_rope_quant(x, norm, freqs, args.rope_head_dim, quant, block)
    got = latent_kernel.norm_rope_quant(x, norm, freqs, args.rope_head_dim, quant, block, store_at=(table, i, j))
    assert torch.equal(got, plain)
    want = torch.full_like(table, 7.0)
    want[i, j] = got
    live = i < 3
    assert torch.equal(table[:3], want[:3]) and torch.equal(table[i[live], j[live]], got[live])
    assert any(torch.equal(table[3, 1], row) for row in got[i == 3])  # one of the four rows sent to (3, 1)
    assert torch.equal(table[3, torch.arange(8) != 1], want[3, torch.arange(8) != 1])


def compressor_decode_case(comp, positions, state_slots, a, gates, tails, trash: int):
    """One-token rows at `positions` (each its chunk's start) through a ratio-2 compressor: the addresses
    model/paged.py compress_addresses gives them ("members", "tail_slots", "tail_at"), and what its torch
    lines make of them: the latent and the tails after the step (copies; `tails` is left as it is)."""
    r, p = 2, positions[:, None]
    member = p[..., None] - r + 1 + torch.arange(r, device=p.device)  # [B, 1, r]: p itself is in this chunk
    members = torch.where(member >= p[..., None], r + member - p[..., None], member.clamp_min(0) % r)
    keep = p >= (p + 1) // r * r  # the group p opens stays open
    at = dict(members=members, tail_slots=torch.where(keep, state_slots[:, None], trash), tail_at=p % r)
    want_tails = tuple(t.clone() for t in tails)
    rows = torch.arange(p.size(0), device=p.device)[:, None]
    gather = lambda tail, t: torch.cat([tail[state_slots], t], 1)[rows[..., None], members]  # noqa: E731
    want = comp.pool(gather(want_tails[0], a), gather(want_tails[1], gates))
    want_tails[0][at["tail_slots"], at["tail_at"]], want_tails[1][at["tail_slots"], at["tail_at"]] = a, gates
    return at, want, want_tails


@needs_interpreter
def test_compressor_decode_kernel_pools_and_writes_the_tails_as_the_torch_lines():
    """kernels/compressor.py against model/paged.py's torch lines for decode rows at ratio 2: rows whose
    group closes (its first member from the tail) and rows that open one (their token into the tail), a
    member whose gate is still -inf, the trash slot; the tails bit for bit, the latent within the
    interpreter's truncating bf16 casts (tests/gpu: bit for bit compiled)."""
    from kernels import compressor as compressor_kernel
    from model import attention

    args = preset("micro")
    D, slots = args.head_dim, 6
    g = torch.Generator().manual_seed(2)
    comp = attention.Compressor(args, 2)
    comp.norm.weight.data = torch.randn(D, generator=g).bfloat16()
    positions, state_slots = torch.tensor([5, 8, 1, 12, 7]), torch.tensor([3, 0, 5, 1, 2])
    a = torch.randn(positions.numel(), 1, D, generator=g) * 2
    gates = torch.randn(positions.numel(), 1, D, generator=g) * 3
    tails = (torch.randn(slots + 1, 2, D, generator=g), torch.randn(slots + 1, 2, D, generator=g))
    tails[1][5, 0, :8] = -torch.inf  # a member whose projection never came
    at, want, want_tails = compressor_decode_case(comp, positions, state_slots, a, gates, tails, trash=slots)
    got = compressor_kernel.pool_decode(a, gates, tails, state_slots, at, comp.norm)
    assert torch.equal(tails[0], want_tails[0]) and torch.equal(tails[1], want_tails[1])
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.allclose(got.float(), want.float(), rtol=2 ** -6, atol=0)  # two bf16 ulps: two truncations


@needs_interpreter
@pytest.mark.parametrize("ratio", [1, 2, 3])  # 3: a ratio that is no power of two
def test_compress_addresses_kernel_gives_the_torch_tensors(ratio):
    """kernels/paged.py against model/paged.py's torch `compress_addresses`: the same tensors, exactly, on a
    step mixing a prefill from 0, a later chunk starting mid-group, decode rows and a padded row."""
    from kernels import paged as paged_kernel
    from model.paged import ForwardBatch, PagedModel, _Step

    args = preset("micro")
    with torch.device("meta"):
        weights = Transformer(args)
    model = PagedModel.__new__(PagedModel)
    model.weights, model.args, model.trash_block, model.trash_slot = weights, args, 40, 9
    start, num = torch.tensor([0, 37, 130, 5]), torch.tensor([7, 6, 1, 1])
    S = 7
    tables = torch.randperm(40, generator=torch.Generator().manual_seed(ratio))[:4 * 5].view(4, 5)
    batch = ForwardBatch(torch.zeros(4, S, dtype=torch.long), start, num, tables, torch.tensor([3, 0, 8, 2]), 160, False)
    arange = torch.arange(S)
    step = _Step(batch, start[:, None] + arange, arange < num[:, None], start + num, torch.arange(4)[:, None])
    per_block = 128 // ratio
    want = model.compress_addresses(ratio, step, per_block, "cpu")
    got = paged_kernel.compress_addresses(batch, weights.rope(ratio, "cpu"), ratio, per_block, 40, 9)
    assert sorted(got) == sorted(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


@needs_interpreter
@pytest.mark.parametrize("decode", [False, True])
def test_window_addresses_kernel_gives_the_torch_tensors(decode):
    """kernels/paged.py's window list and ring addresses against model/paged.py's torch path: the same tensors,
    in the prefill order (a chunk from 0, one mid-sequence, a padded row) and the decode order."""
    from kernels import paged as paged_kernel
    from model.paged import ForwardBatch, PagedModel, _Step

    args = preset("micro")
    model = PagedModel.__new__(PagedModel)
    model.args, model.trash_slot = args, 9
    if decode:
        start, num, S = torch.tensor([5, 31, 32, 200]), torch.tensor([1, 1, 1, 1]), 1
    else:
        start, num, S = torch.tensor([0, 37, 3, 100]), torch.tensor([40, 6, 1, 40]), 40
    slots = torch.tensor([3, 0, 8, 2])
    batch = ForwardBatch(torch.zeros(4, S, dtype=torch.long), start, num, torch.zeros(4, 2, dtype=torch.long), slots,
                         300, decode)
    arange = torch.arange(S)
    step = _Step(batch, start[:, None] + arange, arange < num[:, None], start + num, torch.arange(4)[:, None])
    window, ring_at = model.window_addresses(step)
    got_window, got_ring = paged_kernel.window_addresses(batch, args.window_size, decode, 9)
    assert torch.equal(got_window, window)
    assert torch.equal(got_ring[0], ring_at[0]) and torch.equal(got_ring[1], ring_at[1])
    assert (window == -1).any() and (window >= args.window_size).any() and (decode or (ring_at[0] == 9).any())


@needs_interpreter
@pytest.mark.parametrize("S, nb", [(1, 3), (7, 2), (1100, 9)])
def test_unpack_kernel_gives_the_runners_batch_and_the_forwards_per_token_values(S, nb):
    """kernels/paged.py unpack against engine/model_runner.py's torch unpacking (the in-flight first id from the
    next-token buffer where remap is 1) and model/paged.py's per-token values: the same tensors."""
    from engine import step as layout
    from engine.model_runner import ModelRunner
    from kernels import paged as paged_kernel

    g = torch.Generator().manual_seed(S + nb)
    B = 5
    ints = torch.randint(0, 1000, (B, layout.NCOL + S + nb), generator=g)
    ints[:, 0] = torch.tensor([1, 0, 1, 0, 0])  # remap
    ints[:, 1] = torch.randint(0, 5000, (B,), generator=g)  # start
    ints[:, 2] = torch.randint(1, S + 1, (B,), generator=g)  # num_tokens
    ints[:, 3] = torch.tensor([4, 0, 7, 2, 9])  # state slots (9: the trash slot)
    runner = SimpleNamespace(next_tokens=torch.randint(0, 1000, (10,), generator=g))
    got = paged_kernel.unpack(ints, S, runner.next_tokens, 160, S == 1)
    want = ModelRunner._unpack(runner, ints.clone(), S, 160, S == 1)  # the torch lines (CPU: not fused)
    for name in ("input_ids", "start", "num_tokens", "block_tables", "state_slots"):
        assert torch.equal(getattr(got[0], name), getattr(want[0], name)), name
    assert (got[0].context_len, got[0].decode) == (160, S == 1) and want[0].per_token is None
    assert all(torch.equal(a, b) for a, b in zip(got[1:], want[1:]))
    positions, valid, end, rows = got[0].per_token
    start, num, arange = want[0].start, want[0].num_tokens, torch.arange(S)
    assert torch.equal(positions, start[:, None] + arange) and torch.equal(valid, arange < num[:, None])
    assert torch.equal(end, start + num) and torch.equal(rows, torch.arange(B)[:, None])
    assert not torch.equal(got[0].input_ids, layout.split(ints, S)[1]), "no in-flight id was taken"


def test_rope_wo_a_serves_narrow_groups_only():
    """kernels/output.py `applies`: tiny-68m's groups (256 wide) take the one launch; the slice's (4,096 wide,
    rank 1,024), where the launch measured 20x slower than the rotation and cuBLAS, keep the three launches."""
    from kernels import output as output_kernel

    if output_kernel.triton is None:
        pytest.skip("needs Triton")
    tiny, wide = preset("tiny-68m"), preset("v41-slice")
    for args, want in ((tiny, True), (wide, False)):
        G, H, D = args.o_groups, args.n_heads, args.head_dim
        o = torch.zeros(2, H, D, dtype=torch.bfloat16)
        wo_a = torch.zeros(G, args.o_lora_rank, H * D // G, dtype=torch.bfloat16)
        assert output_kernel.applies(o, wo_a, args.rope_head_dim) is want, (G, H, D)


@needs_interpreter
@pytest.mark.parametrize("M", [1, 20])
def test_head_kernel_matches_the_fp32_product_within_its_sum_error(M):
    """kernels/head.py: the fp32 weight split into three bf16 parts (exactly), three dots: within the error of an
    fp32 sum of K terms of the exact (fp64) product, and within fp32 rounding of F.linear; masked edges (V and K
    not multiples of the tiles)."""
    from kernels import head as head_kernel

    g = torch.Generator().manual_seed(M)
    V, K = 150, 96
    x = torch.randn(M, K, generator=g).bfloat16()
    w = torch.randn(V, K, generator=g) * 0.02
    got = head_kernel.head(x, w, cfg=dict(BV=64, BM=16, BK=64, num_warps=4))
    exact = x.double() @ w.double().T
    bound = K * 2 ** -24 * (x.double().abs() @ w.double().abs().T)
    assert got.dtype == torch.float32 and got.shape == (M, V)
    assert bool(((got.double() - exact).abs() <= bound).all())
    torch.testing.assert_close(got, torch.nn.functional.linear(x.float(), w), rtol=1e-6, atol=1e-6)


@needs_interpreter
def test_the_head_kernel_reads_a_bf16_valued_weight_from_its_bf16_copy_with_the_three_parts_bits(monkeypatch):
    """kernels/head.py `bf16_copy`: a weight whose fp32 values are all bf16 values (the released head, stored bf16)
    gets a bf16 copy, found once and kept until the weight changes in place; the kernel then makes one dot a block
    from it: the bits of the three parts' form (USE_BF16_COPY off). A weight with one value off bf16 has none."""
    from kernels import head as head_kernel

    g = torch.Generator().manual_seed(3)
    V, K = 150, 96
    x = torch.randn(20, K, generator=g).bfloat16()
    w = (torch.randn(V, K, generator=g) * 0.02).bfloat16().float()
    cfg = dict(BV=64, BM=16, BK=64, num_warps=4)
    got = head_kernel.head(x, w, cfg=cfg)
    copy = head_kernel.bf16_copy(w)
    assert copy is not None and copy.dtype == torch.bfloat16 and torch.equal(copy.float(), w)
    assert head_kernel.bf16_copy(w) is copy  # kept, not made again
    copy[0] = 0  # the kernel reads the copy, not the fp32 weight: vocab row 0's logits become 0
    read = head_kernel.head(x, w, cfg=cfg)
    assert bool((read[:, 0] == 0).all()) and torch.equal(read[:, 1:], got[:, 1:])
    copy[0] = w[0].bfloat16()
    monkeypatch.setattr(head_kernel, "USE_BF16_COPY", False)
    fresh = w.clone()  # no copy found for it: three parts
    assert head_kernel.bf16_copy(fresh) is None
    assert torch.equal(got, head_kernel.head(x, fresh, cfg=cfg))
    monkeypatch.setattr(head_kernel, "USE_BF16_COPY", True)
    w[3, 5] += 2 ** -20  # one value off bf16, in place: found again, none
    assert head_kernel.bf16_copy(w) is None
    wide = torch.zeros(70000, 256)  # compared in parts of 65,536 rows: the last part counts too
    wide[-1, -1] = 1 + 2 ** -20
    assert head_kernel.bf16_copy(wide) is None and head_kernel.bf16_copy(wide[:-1].clone()) is not None
    torch.testing.assert_close(head_kernel.head(x, w, cfg=cfg), torch.nn.functional.linear(x.float(), w),
                               rtol=1e-6, atol=1e-6)


SM90_HEAD_ADDS = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import head
parts = int(sys.argv[1])
signature = dict(x_ptr="*bf16", w_ptr="*bf16" if parts == 1 else "*fp32", out_ptr="*fp32", M="i32", V="i32",
                 K="i32", zero="fp32", BF16="constexpr", BV="constexpr", BM="constexpr", BK="constexpr",
                 PARTS="constexpr")
tiles = {k: v for k, v in head.config(64).items() if k in ("BV", "BM", "BK")}
source = ASTSource(head._head_kernel, signature, constexprs=dict(BF16=True, PARTS=parts, **tiles),
                   attrs={(i,): [["tt.divisibility", 16]] for i in range(6)})
ttgir = triton.compile(source, target=GPUTarget("cuda", 90, 64), options=dict(num_warps=4)).asm["ttgir"]
print(ttgir.count("arith.addf"))
"""


@needs_interpreter
@pytest.mark.parametrize("parts", [1, 3])
def test_the_compiled_head_kernel_adds_each_blocks_sum_in_fp32(parts):
    """kernels/head.py compiled for sm_90 off the GPU (Triton's compiler runs wherever its wheel does; in a child
    process, without the interpreter): each K block's dots start from a fresh accumulator and their sum is added
    to the running one by one fp32 add. Triton rewrites acc + dot(a, b, constant 0) into dot(a, b, acc), the
    running sum in the tensor cores' truncating accumulation: the bf16 copy's one dot from `tl.zeros` came out so
    (other bits than the three parts' on an H100), hence the kernel's `zero` argument."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", SM90_HEAD_ADDS, str(parts)], capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert int(run.stdout.split()[-1]) == 1  # the block's sum into the running one (the split's r - mid: subf)


def test_the_head_kernel_serves_wide_heads_outside_the_invariant_mode_only(monkeypatch):
    """kernels/head.py `applies`, and model/transformer.py's logits (through model/invariant.py `head`) taking it
    where it applies and F.linear's fp32 product elsewhere."""
    from kernels import head as head_kernel
    from model import invariant

    class Cuda(torch.Tensor):  # a CPU tensor that says it is on CUDA, for the rule alone
        is_cuda = True

    x = torch.zeros(16, head_kernel.WIDE_HEAD, dtype=torch.bfloat16).as_subclass(Cuda)
    w = torch.zeros(8, head_kernel.WIDE_HEAD)
    assert head_kernel.applies(x, w, False) is (head_kernel.triton is not None)
    assert not head_kernel.applies(x, w, True)
    assert not head_kernel.applies(x[:15], w, False)  # under MIN_ROWS
    assert not head_kernel.applies(x[:, :-1], w[:, :-1], False)  # under WIDE_HEAD
    assert not head_kernel.applies(x.float(), w, False)
    assert not head_kernel.applies(x.as_subclass(torch.Tensor), w, False)  # CPU
    m = Transformer(preset("micro"))
    init_weights(m.named_parameters(), seed=0)  # every weight: an uninitialised norm weight can be NaN
    seen = []
    monkeypatch.setattr("model.attention.use_kernels", lambda x: True)
    monkeypatch.setattr(head_kernel, "applies", lambda x, w, inv: seen.append(inv) or not inv)
    monkeypatch.setattr(head_kernel, "head", lambda x, w: torch.full((*x.shape[:-1], w.size(0)), 7.0))
    h = torch.randn(2, m.args.hc_mult, m.args.dim, generator=torch.Generator().manual_seed(1)).bfloat16()
    pre = torch.full((2, m.args.hc_mult), 1.0 / m.args.hc_mult)
    with torch.inference_mode():
        assert (m.logits(h, pre) == 7.0).all()
        with invariant.mode():
            want = invariant.linear(m.norm(hc.hc_pre(h, pre)).float(), m.head.weight)
            assert bool(want.isfinite().all()) and torch.equal(m.logits(h, pre), want)
    assert seen == [False, True]


@needs_interpreter
def test_decode_launch_shapes_reach_the_launch_and_take_no_part_in_the_values(monkeypatch):
    """A decode step's small launches get more programs (issue #20 item 5: each program's steps are round trips
    through memory one after another): kernels/latent.py `rows_a_program` a program per 256 rows or more,
    kernels/output.py `tiles` 32 outputs a program and K in steps of up to 256 at <= 64 rows, kernels/moe.py
    `gate_tiles` 8 rows a program at <= 64 rows of <= 32 experts; prefill keeps its tiles. The overrides reach the
    launch's grid, and the rows a program and the outputs a program leave every value as it was (tests/gpu: the
    same bits compiled, also for the K step)."""
    from kernels import latent as latent_kernel, moe as moe_kernel, output as output_kernel
    from model.rope import rope_table

    assert [latent_kernel.rows_a_program(n, D) for n, D in ((64, 128), (512, 64), (8192, 64), (1 << 14, 64),
                                                             (8192, 512))] == [1, 2, 32, 64, 8]
    assert output_kernel.tiles(64, 64, 256) == (16, 32, 256, 4) and output_kernel.tiles(65, 64, 256) == (64, 64, 64, 4)
    assert moe_kernel.gate_tiles(64, 16) == (8, 16, 128, 2, 1) and moe_kernel.gate_tiles(65, 16)[0] == 16
    grids = []

    def spied(kernel):
        class Spy:
            def __getitem__(self, grid):
                grids.append(grid)
                return kernel[grid]
        return Spy()

    monkeypatch.setattr(latent_kernel, "_latent_kernel", spied(latent_kernel._latent_kernel))
    monkeypatch.setattr(output_kernel, "_rope_wo_a_kernel", spied(output_kernel._rope_wo_a_kernel))
    args = preset("micro")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(12, args.head_dim, generator=g).bfloat16() * 3
    freqs = rope_table(args, 0)[torch.randint(0, 1000, (12,), generator=g)]
    outs = [latent_kernel.norm_rope_quant(x, None, freqs, args.rope_head_dim, "fp8", 32, rows) for rows in (None, 4, 8)]
    assert [grid[0] for grid in grids] == [12, 3, 2]
    assert all(torch.equal(out, outs[0]) for out in outs)
    grids.clear()
    o = torch.randn(12, 4, 32, generator=g).bfloat16()
    wo_a = (torch.randn(2, 48, 64, generator=g) * 0.1).bfloat16()
    f = rope_table(args, 0)[torch.randint(0, 1000, (12,), generator=g)][:, :4]
    outs = [output_kernel.rope_wo_a(o, f, wo_a, 8, tile) for tile in (None, (16, 64, 64, 4), (16, 16, 64, 4))]
    assert [grid[1] for grid in grids] == [2, 1, 3]
    assert all(torch.equal(out, outs[0]) for out in outs)
