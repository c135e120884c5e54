"""model/slice.py and the v41-slice preset (issue #20 item 1): the released widths with one layer of each
role, made in the released storage from a seed, identified by a digest over its tensors.

The full width runs only on a GPU (tests/gpu/test_slice_gpu.py); here `narrow` keeps the preset's layer
roles, storage and code path at toy widths, so the same functions run on the CPU in seconds."""
import dataclasses

import pytest
import torch

import model.config as config
from kernels import fp4_moe
from model.checkpoint import init_weights, parameter_specs, save_checkpoint, weights_digest
from model.load import load_model
from model.config import preset
from model.engram import EngramLayout
from model.released import FP4Linear, FP8Linear, load_released, quantize_checkpoint
from model.slice import build_slice, released_tensors, tensors_digest, write_slice


def narrow() -> config.ModelArgs:
    """The v41-slice preset's layer roles and Engram placement at micro's widths (top-k binds after 16
    entries, candidates after 32)."""
    args = dataclasses.replace(
        config._v41_slice(), vocab_size=1024, dim=64, moe_inter_dim=64, n_heads=2, n_routed_experts=8,
        n_activated_experts=2, q_lora_rank=32, head_dim=64, rope_head_dim=16, o_groups=2, o_lora_rank=32,
        window_size=32, index_n_heads=4, index_head_dim=32, index_topk=16, candidate_topk_blocks=4,
        engram_vocab_size=1000, engram_n_heads=2, engram_head_dim=32, engram_compressed_vocab_size=512,
        engram_num_embeddings=(), max_seq_len=2048)
    args.engram_num_embeddings = tuple(EngramLayout.from_args(args).num_embeddings)
    return args.check()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def test_the_preset_has_the_released_widths_and_one_layer_of_each_role():
    a = preset("v41-slice")
    released = dict(dim=5120, n_heads=64, head_dim=512, rope_head_dim=64, q_lora_rank=1280, o_groups=8,
                    o_lora_rank=1024, window_size=128, n_routed_experts=384, n_activated_experts=6,
                    moe_inter_dim=2304, index_n_heads=32, index_head_dim=128, index_topk=512,
                    candidate_topk_blocks=2048, candidate_block_size=8, vocab_size=129280, hc_mult=4,
                    engram_n_heads=8, engram_head_dim=256, engram_max_ngram_size=4)  # spec §1.1
    assert {k: getattr(a, k) for k in released} == released
    roles = [(a.compress_ratios[i], a.is_kv_source(i), a.is_index_source(i),
              a.is_index_source(i) and a.uses_candidates(i), i == a.candidate_source_layer,
              i in a.engram_layer_ids) for i in range(a.n_layers)]
    assert roles == [(0, False, False, False, False, False),  # window only (real layer 0)
                     (0, False, False, False, False, True),   # window only, Engram before it (real 1)
                     (2, True, True, False, False, False),    # ratio-2 KV and index source (real 2)
                     (2, False, False, False, False, False),  # ratio-2 consumer (real 3)
                     (1, True, True, False, True, False),     # ratio-1 KV, index and candidate source (real 20)
                     (1, False, False, False, False, False),  # ratio-1 consumer (real 21)
                     (1, False, True, True, False, False)]    # masked index source (real 24)
    assert a.engram_num_embeddings[0] < 384006168 // 90  # shortened ~100x, as its docstring says


def test_the_slice_tensors_are_init_then_quantize_of_the_same_draws(tmp_path):
    args = narrow()
    tensors = [(n, torch.empty(s, dtype=d)) for n, s, d in parameter_specs(args)]
    init_weights(tensors, seed=3)
    save_checkpoint(tmp_path / "bf16", args, tensors)
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "q")
    from_files = load_released(tmp_path / "q").model.state_dict()
    built, digest = build_slice(args, seed=3)
    assert list(built.state_dict()) == list(from_files)
    for name, t in built.state_dict().items():
        assert same_bytes(t, from_files[name]), name
    assert isinstance(built.layers[0].attn.wq_a, FP8Linear) and isinstance(built.layers[6].ffn.experts[0].w1, FP4Linear)
    assert built.layers[0].ffn.grouped and fp4_moe.fp4_experts(built.layers[0].ffn)  # CUDA: kernels/fp4_moe.py


def test_the_digest_is_over_the_stored_tensors_and_names_a_changed_byte(tmp_path):
    args = narrow()
    stored = dict(released_tensors(args, 5, "cpu"))
    assert tensors_digest(stored.items(), threads=2) == weights_digest(stored.items())[1]
    assert build_slice(args, seed=5)[1] == weights_digest(stored.items())[1]
    assert build_slice(args, seed=6)[1] != weights_digest(stored.items())[1]
    name = next(n for n in stored if ".experts." in n)
    stored[name].view(torch.uint8).view(-1)[7] ^= 1
    assert tensors_digest(stored.items()) != build_slice(args, seed=5)[1]
    write_slice(args, 5, tmp_path / "r", device="cpu")  # the released folder of the same tensors
    files = load_released(tmp_path / "r").model.state_dict()
    model = build_slice(args, seed=5)[0].state_dict()
    assert list(model) == list(files) and all(same_bytes(model[n], files[n]) for n in model)


def test_record_and_check_of_the_preset_by_name(tmp_path, monkeypatch):
    """`--model v41-slice` builds the preset in memory at each load (record, then check), at narrow width."""
    from tracing.execute import check_tokens
    from tracing.reader import open_trace
    from tui.cli import main

    monkeypatch.setitem(config.PRESETS, "v41-slice", narrow)
    trace = tmp_path / "slice.mdt"
    assert main(["record", "-o", str(trace), "--model", "v41-slice", "--num-prompts", "3", "--input-len", "60:90",
                 "--output-len", "5:8", "--num-kv-blocks", "6", "--cancel-rate", "0"]) == 0
    t = open_trace(trace)
    assert t.header["model_source"] == "v41-slice"
    assert t.header["checkpoint_digest"] == build_slice(narrow())[1]
    r = check_tokens(t)
    assert r.mismatch is None and r.tokens >= 15
    assert load_model("v41-slice")[1] == t.header["checkpoint_digest"]


def test_the_preset_refuses_ep():
    from model.checkpoint import CheckpointError
    from model.parallel import Shard

    with pytest.raises(CheckpointError, match="built in one process"):
        build_slice(narrow(), shard=Shard(rank=0, world_size=2))
