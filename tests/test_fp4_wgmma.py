"""kernels/fp4_wgmma.py (the FP4 experts' decode tile with asynchronous MMAs, sm_90) without a GPU: Triton
compiles a Gluon kernel for sm_90 on any machine (its ptxas and nvdisasm ship in the wheel), so the property the
tile exists for is checked here in its SASS: each dot's MMAs are left running while the next dot decodes, and
ptxas did not serialize them. Its values are checked on an H100/H200 (tests/gpu/test_fp4_gpu.py); elsewhere
(the CPU interpreter has no Gluon, sm_100 has no wgmma) fp4_moe's Triton tile runs, as the last test shows."""
import pytest
import torch

from kernels import fp4_moe, fp4_wgmma
from test_fp4_kernels import fp4_experts, moe_inputs, needs_interpreter

needs_gluon = pytest.mark.skipif(fp4_wgmma.gluon is None, reason="needs Triton with Gluon (Linux wheels)")

SIGNATURES = {
    "_gate_up_kernel": dict(x_words="*i32", pairs_ptr="*i64", tile_ptr="*i64", w_words="*i32", s_ptr="*u8",
                            route_ptr="*fp32", out_ptr="*bf16", D="i32", I="i32", TOPK="i32", limit="fp32"),
    "_down_kernel": dict(x_words="*i32", tile_ptr="*i64", w_words="*i32", s_ptr="*u8", out_ptr="*bf16", D="i32",
                         I="i32"),
}


def sm90_sass(name: str, **constexprs) -> str:
    """The kernel compiled for sm_90 (with the launcher's 16-byte alignment of pointers and sizes), as SASS."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    signature = dict(SIGNATURES[name], **{key: "constexpr" for key in constexprs})
    aligned = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(SIGNATURES[name].values()) if kind != "fp32"}
    source = GluonASTSource(getattr(fp4_wgmma, name), signature, constexprs=constexprs, attrs=aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 64), options=dict(num_warps=4)).asm["sass"]


@needs_gluon
@pytest.mark.parametrize("name", ["_gate_up_kernel", "_down_kernel"])
@pytest.mark.parametrize("lanes", [0, 1])
def test_each_dots_mmas_run_while_the_next_dot_decodes(name, lanes):
    """An iteration's 4 dots are 16 HGMMAs (2 row halves x 2 K steps each); after each dot's, the warpgroup waits
    only until one group is left running (`WARPGROUP.DEPBAR.LE gsb0, 0x1`), and for none (0x0) once, after the
    loop. The Triton tile waits for 0x0 after every HGMMA; so does this one where ptxas serializes the MMAs (as
    it did with x stored by stmatrix, C7515) or with OUTSTANDING=0."""
    sass = sm90_sass(name, OUTSTANDING=fp4_wgmma.DEFAULTS["OUTSTANDING"], LANES=lanes)
    assert sass.count("HGMMA.64x16x16.F32.BF16") == 16
    assert sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x1") == 4
    assert sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0") == 1


def test_the_tile_runs_only_at_decodes_configuration_on_sm_90():
    """`fits` takes fp4_moe config's decode tier only (the tile's sizes are written into the kernels), `applies`
    only an sm_90 device."""
    assert [fp4_wgmma.fits(fp4_moe.config(n * 6, 384)) for n in (1, 64, 256, 257, 2048)] == [True] * 3 + [False] * 2
    assert not fp4_wgmma.fits(dict(fp4_moe.config(6, 384), B=0))  # the e4m3 decode: the Triton tile's only
    assert not fp4_wgmma.applies(torch.device("cpu"))


@needs_interpreter
def test_asked_for_where_it_cannot_run_the_triton_tile_runs():
    """cfg G=1 on a device without wgmma (here the CPU, through the interpreter) runs the Triton tile: its bits."""
    w13, s13, w2, s2 = fp4_experts(8, 256, 128, seed=3)  # U = 4 divides both GEMMs' groups: decode's tile fits
    x, weights, ids, _ = moe_inputs(2, 2, 8, 256, seed=4)
    assert fp4_wgmma.fits(fp4_moe.config(ids.numel(), 8))
    want, _ = fp4_moe.routed_experts(x, weights, ids, w13, s13, w2, s2, 10.0, cfg=dict(G=0))
    got, _ = fp4_moe.routed_experts(x, weights, ids, w13, s13, w2, s2, 10.0, cfg=dict(G=1))
    assert torch.equal(got, want)
