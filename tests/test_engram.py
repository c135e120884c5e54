"""Engram (spec §4): layout sizes, hashing against a naive restatement of spec §4.2, chunked hashing,
the module's parameters against the tiny-68m state dict, and its forward against spec §4.3."""
import math

import numpy as np
import pytest
import torch

from model.config import ConfigError, preset
from model.engram import (Engram, EngramLayout, compressed_token_map, engram_history, hash_ids,
                          start_history)
from tests.conftest import DATA

BF16 = torch.bfloat16


# ---- a naive restatement of spec §4.2 with Python ints: the oracle ---------------------------------
def naive_primes(args) -> list[list[int]]:
    """Step 3, literally: per (layer, n-gram size, head), the smallest unused prime above vocab - 1."""
    used, out = set(), []
    for _layer in args.engram_layer_ids:
        row = []
        for _n in range(2, args.engram_max_ngram_size + 1):
            for _head in range(args.engram_n_heads):
                p = args.engram_vocab_size
                while p in used or any(p % d == 0 for d in range(2, math.isqrt(p) + 1)):
                    p += 1
                used.add(p)
                row.append(p)
        out.append(row)
    return out


def naive_multipliers(args, layer: int) -> list[int]:
    """Step 2: numpy's default_rng(10007 * L), int64 draws below the overflow bound, made odd."""
    bound = max(1, ((2**63 - 1) // args.engram_compressed_vocab_size) // 2)
    draws = np.random.default_rng(10007 * layer).integers(0, bound, size=args.engram_max_ngram_size, dtype=np.int64)
    return [int(v) * 2 + 1 for v in draws]


def naive_row_ids(args, comp: list[int], pad: int) -> list:
    """Steps 4-5 for one whole sequence: [position][engram layer][column]."""
    primes = naive_primes(args)
    out = []
    for p in range(len(comp)):
        back = [comp[p - s] if p - s >= 0 else pad for s in range(args.engram_max_ngram_size)]
        per_layer = []
        for li, layer in enumerate(args.engram_layer_ids):
            m, rolling, cols = naive_multipliers(args, layer), None, []
            rolling = back[0] * m[0]
            for i in range(1, args.engram_max_ngram_size):
                rolling ^= back[i] * m[i]
                for head in range(args.engram_n_heads):
                    c = (i - 1) * args.engram_n_heads + head
                    cols.append(rolling % primes[li][c] + sum(primes[li][:c]))
            per_layer.append(cols)
        out.append(per_layer)
    return out


def random_ids(args, batch: int, seq_len: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, args.vocab_size, (batch, seq_len), generator=g)
    ids[0, :3] = args.engram_pad_id  # real pad tokens at the start: they must not stop the look-back
    ids[1, 1] = args.vocab_size - 1  # the largest compressed id: the int64 products must not overflow
    ids[1, 0] = 0  # compressed id 0: its products are 0
    return ids


# ---- layout ------------------------------------------------------------------------------------------
def test_tiny_layout_reproduces_spec_table_sizes():
    args = preset("tiny-68m")
    layout = EngramLayout.from_args(args)
    assert layout.num_embeddings == (192176, 192440) == args.engram_num_embeddings
    assert [list(p) for p in layout.primes] == naive_primes(args)
    assert layout.primes[0][0] == 32003  # the smallest prime above 31999
    assert layout.multipliers.dtype == torch.int64
    assert layout.multipliers.tolist() == [naive_multipliers(args, 1), naive_multipliers(args, 4)]
    # pinned from the official compute_hash_multipliers at compressed vocab 64640
    assert layout.multipliers[0].tolist() == [117475675455051, 7419446191811, 55125554601933, 113421306364897]
    assert layout.offsets.tolist()[1] == [0, 32059, 64122, 96191, 128268, 160351]


def test_real_config_layout_sizes():
    args = preset("tiny-68m")
    args.engram_layer_ids, args.engram_vocab_size, args.engram_n_heads = (1, 14), 16_000_000, 8
    args.engram_num_embeddings, args.engram_compressed_vocab_size = (), 99092
    assert EngramLayout.from_args(args).num_embeddings == (384006168, 384016682)  # spec §1.1


def test_micro_preset_gets_sensible_table_sizes():
    args = preset("micro")
    layout = EngramLayout.from_args(args)
    assert args.engram_num_embeddings == layout.num_embeddings == tuple(sum(p) for p in naive_primes(args))
    for primes in layout.primes:
        assert len(primes) == args.n_hash_cols == 6
        assert all(args.engram_vocab_size <= p < 2 * args.engram_vocab_size for p in primes)
    assert not set(layout.primes[0]) & set(layout.primes[1])


def test_layout_rejects_wrong_table_sizes_and_has_none_without_engram():
    args = preset("tiny-68m")
    args.engram_num_embeddings = (192176, 192441)
    with pytest.raises(ConfigError, match="engram_num_embeddings"):
        EngramLayout.from_args(args)
    args.engram_layer_ids, args.engram_num_embeddings = (), ()
    assert EngramLayout.from_args(args) is None


# ---- token map -----------------------------------------------------------------------------------------
def test_half_token_map_and_start_history_use_the_pad_compressed_id():
    args = preset("tiny-68m")
    token_map = compressed_token_map(args)
    assert token_map.dtype == torch.int64 and token_map.shape == (args.vocab_size,)
    assert token_map[[0, 1, 2, 3, 129279]].tolist() == [0, 0, 1, 1, 64639]
    assert start_history(args, token_map, 2).tolist() == [[1, 1, 1], [1, 1, 1]]


def test_tokenizer_token_map_needs_a_tokenizer():
    args = preset("micro")
    args.engram_token_map = "tokenizer"
    with pytest.raises(ConfigError, match="tokenizer"):
        compressed_token_map(args)


def test_tokenizer_token_map_of_the_stub_tokenizer_is_half():
    pytest.importorskip("tokenizers")

    class Stub:  # tt-metal testing.py's StubTokenizer: 2k -> "w{k}", 2k+1 -> " W{k}", which normalise alike
        def get_vocab_size(self, with_added_tokens=True):
            return 1024

        def decode(self, ids, skip_special_tokens=False):
            return f"w{ids[0] // 2}" if ids[0] % 2 == 0 else f" W{ids[0] // 2}"

        def id_to_token(self, token):
            return self.decode([token])

    args = preset("micro")
    args.engram_token_map = "tokenizer"
    assert torch.equal(compressed_token_map(args, Stub()), torch.arange(1024) // 2)


# ---- hashing -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny-68m", "micro"])
def test_hash_matches_naive_restatement_with_pad_at_sequence_start(name):
    args = preset(name)
    layout, token_map = EngramLayout.from_args(args), compressed_token_map(args)
    for seq_len in (2, 37):  # 2: shorter than the 4-gram, so every look-back crosses the start
        ids = random_ids(args, 2, seq_len, seed=seq_len)
        comp = token_map[ids]
        got = hash_ids(layout, comp, start_history(args, token_map, 2))
        assert got.shape == (2, seq_len, 2, args.n_hash_cols) and got.dtype == torch.int64
        for b in range(2):
            assert got[b].tolist() == naive_row_ids(args, comp[b].tolist(), pad=1)
        assert ((got >= 0) & (got < torch.tensor(layout.num_embeddings)[:, None])).all()


def test_hash_pinned_values_from_official_code():
    """Row ids that DeepSeek's NgramHashState gives for tokens [100, 7, 129279, 2, 5] at tiny-68m.
    By hand for position 0, column 0: compressed id 50 and three pads (1), so the 2-gram hash is
    (50*m0 ^ 1*m1) % 32003 = 7437 with layer 1's m0, m1, and no offset."""
    args = preset("tiny-68m")
    layout, token_map = EngramLayout.from_args(args), compressed_token_map(args)
    got = hash_ids(layout, token_map[torch.tensor([[100, 7, 129279, 2, 5]])], start_history(args, token_map, 1))
    m0, m1, _, _ = layout.multipliers[0].tolist()
    assert (50 * m0 ^ m1) % 32003 == 7437
    assert got[0, 0].tolist() == [[7437, 47465, 69985, 115628, 134254, 166480],
                                  [10791, 43946, 68506, 127846, 160338, 188684]]
    assert got[0, 4, 0].tolist() == [29694, 47877, 74287, 118377, 140624, 163214]


def test_chunked_hash_with_history_equals_one_shot():
    """An engine's view: each row advances by its own chunk length per step (decode steps of 1
    included), the chunk padded to the longest, and the history carried in a state slot."""
    args = preset("micro")
    layout, token_map = EngramLayout.from_args(args), compressed_token_map(args)
    comp = token_map[random_ids(args, 3, 40, seed=1)]
    one_shot = hash_ids(layout, comp, start_history(args, token_map, 3))
    chunks = [[5, 1, 2], [1, 7, 1], [3, 3, 1], [1, 1, 4], [30, 28, 32]]  # per step, tokens of each row
    history, pos = start_history(args, token_map, 3), [0, 0, 0]
    for sizes in chunks:
        n = torch.tensor(sizes)
        chunk = torch.full((3, max(sizes)), 99)  # 99: garbage in the padding, must not leak
        for b, s in enumerate(sizes):
            chunk[b, :s] = comp[b, pos[b]:pos[b] + s]
        got = hash_ids(layout, chunk, history)
        for b, s in enumerate(sizes):
            assert torch.equal(got[b, :s], one_shot[b, pos[b]:pos[b] + s]), (sizes, b)
            pos[b] += s
        history = engram_history(history, chunk, n)
    assert pos == [40, 40, 40]
    assert torch.equal(engram_history(start_history(args, token_map, 3), comp), comp[:, -3:])


# ---- the module ----------------------------------------------------------------------------------------
def test_module_parameters_match_tiny_state_dict():
    lines = [line.split("\t") for line in (DATA / "tiny-68m.state_dict.tsv").read_text().splitlines()[1:]]
    args = preset("tiny-68m")
    for layer in args.engram_layer_ids:
        prefix = f"layers.{layer}.engram."
        expected = [(n.removeprefix(prefix), shape, dtype) for n, shape, dtype, _ in lines if n.startswith(prefix)]
        with torch.device("meta"):
            module = Engram(args, layer)
        got = [(n, str(list(p.shape)), str(p.dtype).removeprefix("torch.")) for n, p in module.named_parameters()]
        assert got == expected
        assert list(module.state_dict()) == [n for n, _, _ in expected]


def random_engram(args, layer: int, seed: int) -> Engram:
    g = torch.Generator().manual_seed(seed)
    module = Engram(args, layer)
    with torch.no_grad():
        emb = module.embed
        emb.weight.copy_(torch.randn(emb.weight.shape, generator=g).to(torch.float8_e4m3fn))
        emb.scale.copy_(torch.exp2(torch.randint(-6, 3, emb.scale.shape, generator=g).float()))
        w = module.wkv.weight
        w.copy_(torch.randn(w.shape, generator=g) * w.shape[1] ** -0.5)
        module.q_weight.copy_(torch.randn(module.q_weight.shape, generator=g))
        module.k_weight.copy_(torch.randn(module.k_weight.shape, generator=g))
    return module


def spec_forward(module: Engram, x: torch.Tensor, row_ids: torch.Tensor, eps: float) -> torch.Tensor:
    """Spec §4.3, step by step (fp32 where the spec says so, grouped as the official code groups the
    products so that the fp32 steps agree bitwise)."""
    hc, d = x.shape[-2], x.shape[-1]
    table = module.embed.weight.float() * module.embed.scale.float().repeat_interleave(32, dim=-1)
    e = table.to(BF16)[row_ids].flatten(-2)  # 1. per-row dequantised rows, [..., n_hash_cols * 32]
    kv = e @ module.wkv.weight.T  # 2. bf16 GEMM
    key = kv[..., :hc * d].float().reshape(*kv.shape[:-1], hc, d)
    value = kv[..., hc * d:].float()
    h = x.float()
    qk = module.q_weight.float() * module.k_weight.float()
    rs = torch.rsqrt((h * h).mean(-1) + eps) * torch.rsqrt((key * key).mean(-1) + eps)
    dot = (h * qk * key).sum(-1) * rs * d**-0.5  # 3. per (token, copy)
    gate = torch.sigmoid(torch.copysign(torch.sqrt(torch.maximum(dot.abs(), torch.tensor(1e-6))), dot))  # 4.
    return (h + gate[..., None] * value[..., None, :]).to(BF16)  # 5. rounded once


def test_forward_matches_spec_restatement_for_any_leading_shape():
    args = preset("micro")
    module = random_engram(args, 4, seed=0)
    layout, token_map = EngramLayout.from_args(args), compressed_token_map(args)
    comp = token_map[random_ids(args, 2, 9, seed=2)]
    row_ids = hash_ids(layout, comp, start_history(args, token_map, 2))[:, :, module.layer_index]
    x = torch.randn(2, 9, args.hc_mult, args.dim, generator=torch.Generator().manual_seed(3)).to(BF16)
    with torch.inference_mode():
        out = module(x, row_ids)
        assert out.dtype == BF16 and out.shape == x.shape
        assert torch.equal(out, spec_forward(module, x, row_ids, args.norm_eps))
        assert torch.equal(module(x.flatten(0, 1), row_ids.flatten(0, 1)), out.flatten(0, 1))  # [T] layout
        assert not torch.equal(out, x)


def test_gate_of_zero_dot_is_sigmoid_of_signed_sqrt_clamp():
    args = preset("micro")
    module = random_engram(args, 1, seed=1)
    key = torch.randn(5, args.hc_mult, args.dim)
    with torch.inference_mode():
        gate = module.gate(torch.zeros(5, args.hc_mult, args.dim), key)
        assert torch.equal(gate, torch.full_like(gate, torch.sigmoid(torch.tensor(1e-6).sqrt()).item()))
        assert (gate > 0.5).all()  # sigmoid(+1e-3), not sigmoid(0)
        weight = module.q_weight.float() * module.k_weight.float()
        assert (module.gate(-key * weight.sign(), key) < 0.5).all()  # anti-aligned: negative dot


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hash_and_forward_on_cuda_without_host_syncs():
    args = preset("micro")
    layout, token_map = EngramLayout.from_args(args), compressed_token_map(args)
    module = random_engram(args, 1, seed=0)
    comp = token_map[random_ids(args, 2, 20, seed=4)]
    history = start_history(args, token_map, 2)
    x = torch.randn(2, 20, args.hc_mult, args.dim).to(BF16)
    row_ids = hash_ids(layout, comp, history)
    dev_layout, dev_module = layout.to("cuda"), module.to("cuda")
    dev = [t.cuda() for t in (comp, history, x, torch.tensor([20, 3]))]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            dev_ids = hash_ids(dev_layout, dev[0], dev[1])
            dev_history = engram_history(dev[1], dev[0], dev[3])
            out = dev_module(dev[2], dev_ids[:, :, 0])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(dev_ids.cpu(), row_ids)
    assert torch.equal(dev_history.cpu(), engram_history(history, comp, torch.tensor([20, 3])))
    with torch.inference_mode():
        ref = module.cpu()(x, row_ids[:, :, 0]).float()
    assert (out.cpu().float() - ref).abs().max() < 0.05
