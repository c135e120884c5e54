"""Promise 3: sampling randomness depends only on (sequence seed, output position), never on the batch.

The Triton kernel runs through the interpreter here (conftest sets TRITON_INTERPRET=1 without CUDA), on small
vocabularies: one program instance costs milliseconds. The compiled kernel at the real vocab is checked by
tests/gpu/test_sampling_gpu.py.
"""
import os

import pytest
import torch

from kernels import sampling
from kernels.sampling import gumbel_noise, mix_seed, sample

needs_triton = pytest.mark.skipif(  # the kernel runs on CPU tensors only through the interpreter
    sampling.triton is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs Triton's interpreter (TRITON_INTERPRET=1, set by conftest without CUDA); tests/gpu covers CUDA")
PATHS = [False, pytest.param(True, marks=needs_triton)]  # use_triton
M64 = (1 << 64) - 1

if sampling.triton is not None:
    import triton
    import triton.language as tl

    @triton.jit
    def _randint_kernel(keys_ptr, out_ptr, V, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        tl.store(out_ptr + row * V + cols, tl.randint(tl.load(keys_ptr + row), cols), mask=cols < V)

    @triton.jit
    def _gumbel_of_uniform_kernel(u_ptr, out_ptr, N, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, sampling._gumbel(tl.load(u_ptr + offs, mask=offs < N)), mask=offs < N)


def splitmix64(seed: int):
    """Vigna's SplitMix64 generator in unsigned Python ints, the reference for mix_seed."""
    state = seed & M64
    while True:
        state = (state + 0x9E3779B97F4A7C15) & M64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        yield z ^ (z >> 31)


def rows(n: int, vocab: int, seed: int = 0):
    """n rows of logits with a mix of greedy and sampled temperatures, seeds (some negative) and positions."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * 0.5  # flat enough that the noise decides most draws
    temperatures = torch.tensor([0.0, 1.0, 0.6, 1.7, 0.0, 0.9, 1.3, 0.4])[torch.arange(n) % 8]
    seeds = torch.randint(-(1 << 62), 1 << 62, (n,), generator=g)
    positions = torch.randint(0, 1 << 20, (n,), generator=g)
    return logits, temperatures, seeds, positions


def test_mix_seed_is_splitmix64_output_at_position():
    assert mix_seed(0, 0) & M64 == 0xE220A8397B1DCDAF  # the published first output of SplitMix64(0)
    for seed in [0, 1, 42, -1, (1 << 63) - 1, -(1 << 63), 0x0123456789ABCDEF]:
        stream = splitmix64(seed)
        for position in range(5):
            assert mix_seed(seed, position) & M64 == next(stream)


def test_mix_seed_python_ints_and_torch_agree():
    g = torch.Generator().manual_seed(1)
    seeds = torch.cat([torch.tensor([0, 1, -1, (1 << 63) - 1, -(1 << 63)]),
                       torch.randint(-(1 << 63), (1 << 63) - 1, (195,), generator=g)])
    positions = torch.cat([torch.tensor([0, 1, 2, (1 << 40), 7]), torch.randint(0, 1 << 40, (195,), generator=g)])
    keys = mix_seed(seeds, positions)
    assert keys.dtype == torch.int64
    assert keys.tolist() == [mix_seed(s, p) for s, p in zip(seeds.tolist(), positions.tolist())]
    assert mix_seed(12345, positions).tolist() == [mix_seed(12345, p) for p in positions.tolist()]
    assert mix_seed((1 << 64) - 1, 3) == mix_seed(-1, 3)  # a Python seed counts by its low 64 bits


def test_mix_seed_never_collides_for_seeds_below_2_39_and_positions_below_2_24():
    """(s, p) and (s', p') share a key only if s - s' == (p' - p) * gamma mod 2**64 (the docstring's claim)."""
    k = torch.arange(1, 1 << 24)
    assert (k * sampling._GAMMA).abs().min().item() >= 1 << 39  # int64 products wrap mod 2**64


@needs_triton
def test_philox_bits_match_triton_randint():
    assert sampling._philox_torch(torch.tensor([0]), torch.tensor([0])).item() == 0x6627E8D5  # Random123 KAT
    keys = mix_seed(torch.tensor([0, 7, -3, 1 << 40]), torch.tensor([0, 1, 5, 99]))
    assert (keys < 0).any() and (keys >= 0).any()
    vocab = 300
    bits = torch.empty(4, vocab, dtype=torch.int32)
    _randint_kernel[(4,)](keys, bits, vocab, BLOCK=512)
    ours = sampling._philox_torch(keys, torch.arange(vocab))
    assert torch.equal(torch.where(ours >= 1 << 31, ours - (1 << 32), ours).to(torch.int32), bits)


@needs_triton
@pytest.mark.parametrize("n, vocab, block", [(5, 97, 32), (3, 300, 64), (8, 128, 1024)])
def test_triton_kernel_matches_torch_path_bit_for_bit(n, vocab, block):
    logits, temperatures, seeds, positions = rows(n, vocab, seed=vocab)
    want = sample(logits, temperatures, seeds, positions, use_triton=False)
    assert torch.equal(sampling._sample_triton(logits, temperatures, seeds, positions, block=block), want)
    assert torch.equal(sample(logits, temperatures, seeds, positions, use_triton=True), want)
    assert (want != logits.argmax(dim=1)).any()  # the noise decided some draws, so the check has teeth
    noise = gumbel_noise(seeds, positions, vocab, use_triton=True, block=block)
    want_noise = gumbel_noise(seeds, positions, vocab, use_triton=False)
    assert torch.equal(noise.view(torch.int32), want_noise.view(torch.int32))  # bit for bit, -inf included


@needs_triton
def test_the_kernel_takes_the_fp64_noise_only_where_a_lane_may_win():
    """A program walks its part of the vocab in blocks and takes the fp64 logs only for lanes whose bound from
    fp32 logs reaches its best score so far (`_gumbel`'s BOUND): 48 rows of 512 in one program a row, 16 blocks of
    32 each, so later blocks skip; the tokens are the torch path's, every one, and the same as with no skipping.
    (With the bound's margin made negative, SCREEN -0.5, this test fails.)"""
    logits, temperatures, seeds, positions = rows(48, 512, seed=11)
    want = sample(logits, temperatures, seeds, positions, use_triton=False)
    for skip in (True, False):
        got = sampling._sample_triton(logits, temperatures, seeds, positions, block=32, splits=1,
                                      skip_from=1 if skip else 1 << 30)
        assert torch.equal(got, want), skip
    assert (want != logits.argmax(dim=1)).sum() > 20


@needs_triton
def test_the_kernels_keys_are_mix_seed_at_the_int64_extremes():
    """The sampler's kernels derive each row's key from (seed, position) themselves (`_row_key`, uint64): the
    bits of mix_seed's int64 lines where the sums and products wrap and the shifts must be logical."""
    seeds = torch.tensor([0, -1, (1 << 63) - 1, -(1 << 63), 0x0123456789ABCDEF, -12345])
    positions = torch.tensor([0, (1 << 40) + 3, 5, 1 << 62, 7, 1 << 24])
    noise = gumbel_noise(seeds, positions, 64, use_triton=True, block=64)
    want = gumbel_noise(seeds, positions, 64, use_triton=False)
    assert torch.equal(noise.view(torch.int32), want.view(torch.int32))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:divide by zero")
@needs_triton
def test_gumbel_transform_agrees_on_every_uniform_value():
    """u = fp32(x) * scale takes 75,497,473 values: fp64 logs make the kernel and torch round all alike."""
    xs = [torch.arange(0, 1 << 24)] + [torch.arange(1 << k, 2 << k, 1 << (k - 23)) for k in range(24, 31)]
    u = sampling._uniform_torch(torch.cat(xs + [torch.tensor([(1 << 31) - 1])]))
    assert u.unique().numel() == u.numel() == 75_497_473
    for chunk in u.split(1 << 23):
        g = torch.empty_like(chunk)
        _gumbel_of_uniform_kernel[(triton.cdiv(chunk.numel(), 1 << 20),)](chunk, g, chunk.numel(), BLOCK=1 << 20)
        assert torch.equal(g.view(torch.int32), sampling._gumbel_torch(chunk).view(torch.int32))


@pytest.mark.parametrize("use_triton", PATHS)
def test_lowest_index_wins_ties(use_triton):
    logits = torch.zeros(4, 97)
    logits[1, [70, 5]] = 3.0  # different blocks of 32, different lanes
    logits[2, [40, 8]] = 3.0  # the same lane of different blocks
    logits[3] = float("-inf")
    temperatures, seeds, positions = torch.zeros(4), torch.arange(4), torch.arange(4)
    got = (sampling._sample_triton(logits, temperatures, seeds, positions, block=32) if use_triton
           else sample(logits, temperatures, seeds, positions, use_triton=False))
    assert got.tolist() == [0, 5, 8, 0]


@pytest.mark.parametrize("use_triton", PATHS)
def test_token_does_not_depend_on_batch_row_size_or_order(use_triton):
    vocab = 150 if use_triton else 1000
    logits, temperatures, seeds, positions = rows(6, vocab, seed=3)
    batch = sample(logits, temperatures, seeds, positions, use_triton=use_triton)
    alone = [sample(logits[i:i + 1], temperatures[i:i + 1], seeds[i:i + 1], positions[i:i + 1],
                    use_triton=use_triton).item() for i in range(6)]
    assert batch.tolist() == alone
    flip = torch.arange(5, -1, -1)
    reversed_batch = sample(logits[flip], temperatures[flip], seeds[flip], positions[flip], use_triton=use_triton)
    assert reversed_batch.flip(0).tolist() == batch.tolist()
    torch.manual_seed(123)  # no global RNG is read
    assert sample(logits, temperatures, seeds, positions, use_triton=use_triton).tolist() == batch.tolist()


@pytest.mark.parametrize("use_triton", PATHS)
def test_same_seed_position_logits_temperature_give_same_token_in_any_batch(use_triton):
    vocab = 120 if use_triton else 1000
    logits, temperatures, seeds, positions = rows(8, vocab, seed=4)
    temperatures[:] = 1.0
    for i in (2, 5):  # rows 2 and 5 copy row 0 of a batch whose other rows differ
        logits[i], seeds[i], positions[i] = logits[0], seeds[0], positions[0]
    tokens = sample(logits, temperatures, seeds, positions, use_triton=use_triton)
    assert tokens[0] == tokens[2] == tokens[5]
    other_logits, _, other_seeds, other_positions = rows(3, vocab, seed=5)
    other_logits[1], other_seeds[1], other_positions[1] = logits[0], seeds[0], positions[0]
    assert sample(other_logits, torch.ones(3), other_seeds, other_positions, use_triton=use_triton)[1] == tokens[0]


def test_each_position_and_seed_is_a_fresh_draw():
    logits, vocab = torch.zeros(64, 300), 300  # uniform: 64 independent draws give ~58 distinct tokens
    by_position = sample(logits, torch.ones(64), torch.full((64,), 9), torch.arange(64))
    by_seed = sample(logits, torch.ones(64), torch.arange(64), torch.full((64,), 9))
    assert by_position.unique().numel() > 45 and by_seed.unique().numel() > 45
    noise = gumbel_noise(torch.tensor([9, 9]), torch.tensor([0, 1]), vocab)
    assert not torch.isclose(noise[0], noise[1]).any()


@pytest.mark.parametrize("use_triton", PATHS)
def test_greedy_rows_ignore_seeds(use_triton):
    logits = rows(1, 200, seed=6)[0].expand(6, 200).contiguous()
    tokens = sample(logits, torch.zeros(6), torch.tensor([0, 1, -1, 99, 1 << 40, 5]), torch.arange(6) * 7,
                    use_triton=use_triton)
    assert tokens.tolist() == [logits[0].argmax().item()] * 6


@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_draws_follow_softmax_of_logits_over_temperature(temperature):
    n, logits = 20_000, torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.2, 1.2])
    tokens = sample(logits.expand(n, 8).contiguous(), torch.full((n,), temperature), torch.full((n,), 11),
                    torch.arange(n))
    counts = torch.bincount(tokens, minlength=8).double()

    def chi2(probs):
        expected = probs.double() * n
        return ((counts - expected) ** 2 / expected).sum().item()

    assert chi2(torch.softmax(logits / temperature, 0)) < 40  # 7 degrees of freedom: p < 1e-6 above 40
    assert chi2(torch.softmax(logits, 0)) > 200  # the temperature is applied, so the test can fail
