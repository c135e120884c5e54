"""The sampler: deterministic, batch-invariant Gumbel-max sampling (mirrors DeepInfer's
tilelang_ops/random_sampling.py).

Promise 3 of the design: a token's randomness depends only on the sequence seed and the output position,
never on the batch row, the batch size or a global RNG, so a recomputed step (replay, preemption, a bigger
batch) draws the same token from the same logits. Three pieces:

1. `mix_seed(seed, position)` -> one 64-bit key per row: the `position`-th output (counting from 0) of a
   SplitMix64 generator seeded with `seed`, in wrapping uint64 arithmetic:
       z = seed + (position + 1) * 0x9E3779B97F4A7C15
       z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
       z = (z ^ (z >> 27)) * 0x94D049BB133111EB
       key = z ^ (z >> 31)                        (>> is a logical shift; the key is stored as int64 bits)
   The finaliser is a bijection, so distinct (seed, position) pairs collide only when
   seed - seed' == (position' - position) * 0x9E37...7C15 mod 2**64; for |seed - seed'| < 2**39 and
   positions below 2**24 that never happens (the smallest |k * gamma mod 2**64| for 0 < k < 2**24 is 2**39).
2. Philox noise, exactly as Triton's `tl.rand(key, v)` defines it (triton/language/random.py):
   Philox-4x32 with 10 rounds, key words (k0, k1) = (key & 0xFFFFFFFF, key >> 32), counter
   (c0, c1, c2, c3) = (v, 0, 0, 0) for vocab index v, output word c0 = r. r becomes a float in [0, 1) as
   `uint_to_uniform_float` does: x = r read as int32; x = x < 0 ? -x - 1 : x; u = fp32(x) * fp32(4.6566127342e-10).
3. Gumbel-max: g = fp32(-log(-log(fp64(u)))) and token = argmax(logits / T + g) in fp32, lowest index on ties.
   The logs run in fp64 and round once to fp32 because fp32 logs differ by an ulp between libraries: in fp32,
   numpy (which the Triton interpreter runs) and torch's CPU kernels disagree on g for 19% of u. Through fp64
   the rounded noise agrees on every one of the 75,497,473 values u can take, on CPU and on CUDA (libdevice
   vs torch), as the tests check. u = 0 (odds 2**-31) gives g = -inf: that token is never drawn.
   Temperature 0 is greedy: plain argmax of the logits, no noise, the seed ignored.

Two paths, equal bit for bit: a Triton kernel (a program per row and vocab split, looping over its part of
the vocab in blocks with a running argmax, then the lowest index at the maximum over the splits; the fp64
logs only for the lanes whose score may reach the program's best so far, by a bound from fp32 logs that
lies above it for every u, `_gumbel`'s BOUND: a skipped lane's score is below a score already seen, so it can
neither be the token nor tie with it) and a torch
path that re-implements Philox in int64 ops for CPU, where the Triton interpreter is far too slow at a
129,280-token vocab. Neither synchronises with the host (no .item(), no data-dependent
shape), so `sample` can sit inside an asynchronous step and a CUDA graph. Logits must be free of NaN (the
paths treat NaN differently).
"""
import torch

try:  # Triton ships Linux wheels only; elsewhere the torch path is the sampler.
    import triton
    import triton.language as tl

    # The kernel's margin between the fp32-log noise and the fp64-log noise (`_gumbel`'s BOUND): 300x the largest
    # difference (3e-6), and well above half an ulp of g (<= 2^-20 at |g| <= 22)
    SCREEN = tl.constexpr(1e-3)
except ImportError:
    triton = None

_M32 = 0xFFFFFFFF


# ---- mix_seed: SplitMix64 over (seed, position) -----------------------------------------------------------
# uint64 constants (each >= 2^63) as the int64s with the same bits
_GAMMA, _MIX1, _MIX2 = (c - (1 << 64) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _wrap(x):
    """Wrap a Python int to int64 as a tensor op would; int64 tensors wrap by themselves."""
    return x if isinstance(x, torch.Tensor) else ((x + (1 << 63)) & ((1 << 64) - 1)) - (1 << 63)


def _shr(x, n: int):
    """Logical right shift of 64-bit patterns held as int64 (Python's and torch's >> are arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def mix_seed(seed: int | torch.Tensor, position: int | torch.Tensor) -> int | torch.Tensor:
    """Key of (sequence seed, output position): SplitMix64's `position`-th output for `seed` (module docstring).

    The same lines serve Python ints (wrapped to int64 after every + and *) and int64 tensors (broadcast);
    the result is int64 bits either way. A Python seed may be any int: its low 64 bits are used.
    """
    z = _wrap(_wrap(seed) + _wrap(_GAMMA * (position + 1)))
    z = _wrap((z ^ _shr(z, 30)) * _MIX1)
    z = _wrap((z ^ _shr(z, 27)) * _MIX2)
    return z ^ _shr(z, 31)


# ---- torch path --------------------------------------------------------------------------------------------
# Philox-4x32-10 constants, as in triton/language/random.py.
_PHILOX_KEY_A, _PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
_PHILOX_ROUND_A, _PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57
_PHILOX_ROUNDS = 10
_UNIFORM_SCALE = 4.6566127342e-10  # Triton's: the largest scale with (2**31 - 1) * scale < 1.0 in fp32


def _philox_torch(keys: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Triton's `tl.randint(key, v)` for every row key and vocab index v in cols: uint32 bits in int64, [B, C].

    Words are uint32 held in int64; a product of two is formed whole (it wraps mod 2**64, the high word is
    still bits 32..63). The low word (c1, c3) keeps junk above bit 31, cleared where it is XORed into c0, c2.
    """
    k0 = (keys & _M32)[:, None]  # [B, 1]
    k1 = _shr(keys, 32)[:, None]  # [B, 1]
    c0 = cols[None, :]  # [1, C]: the counter is (vocab index, 0, 0, 0)
    c1 = c2 = c3 = torch.zeros((), dtype=torch.int64, device=keys.device)
    for _ in range(_PHILOX_ROUNDS):
        prod_b, prod_a = _PHILOX_ROUND_B * c2, _PHILOX_ROUND_A * c0
        c0, c1, c2, c3 = ((prod_b >> 32) ^ c1 ^ k0) & _M32, prod_b, ((prod_a >> 32) ^ c3 ^ k1) & _M32, prod_a
        k0, k1 = (k0 + _PHILOX_KEY_A) & _M32, (k1 + _PHILOX_KEY_B) & _M32
    return c0  # [B, C]: row keys enter in round 1, vocab counters in round 2


def _uniform_torch(bits: torch.Tensor) -> torch.Tensor:
    """Triton's `uint_to_uniform_float` on uint32 bits held in int64: fp32 in [0, 1)."""
    x = torch.where(bits >= 1 << 31, _M32 - bits, bits)  # the int32 view, then x < 0 ? -x - 1 : x
    return x.to(torch.float32) * _UNIFORM_SCALE  # fp32 * fp32(scale), as the kernel multiplies


def _gumbel_torch(u: torch.Tensor) -> torch.Tensor:
    """g = -log(-log(u)), the logs in fp64, rounded once to fp32 (module docstring), as `_gumbel` in the kernel."""
    return (-torch.log(-torch.log(u.to(torch.float64)))).to(torch.float32)


def _noise_torch(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel noise [B, V], a vocab chunk at a time: on CPU, ~2**16-element chunks keep the int64 temporaries
    in cache (1.5-2x faster at B=8, V=129280). Chunk bounds depend on shapes only, never on data."""
    out = torch.empty(keys.shape[0], vocab_size, dtype=torch.float32, device=keys.device)
    chunk = max(1024, (1 << 16 if keys.device.type == "cpu" else 1 << 24) // max(1, keys.shape[0]))
    for start in range(0, vocab_size, chunk):
        cols = torch.arange(start, min(start + chunk, vocab_size), dtype=torch.int64, device=keys.device)
        out[:, start:start + chunk] = _gumbel_torch(_uniform_torch(_philox_torch(keys, cols)))
    return out


def _sample_torch(logits: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    greedy = (temperatures == 0)[:, None]  # [B, 1]
    t = torch.where(greedy, 1.0, temperatures[:, None])
    scores = torch.where(greedy, logits, logits / t + _noise_torch(keys, logits.shape[1]))  # [B, V]
    return scores.argmax(dim=1)  # the first maximum: lowest index on ties


# ---- Triton path -------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _gumbel(u, BOUND: tl.constexpr = False):
        """g = -log(-log(u)), the logs in fp64, rounded once to fp32. BOUND: an upper bound of it from fp32 logs
        (the kernel's screen): two fp32 logs (libdevice's logf compiled, within an ulp) put -log(-log(u)) within
        3e-6 of g for every u (|g| <= 22; tests/gpu checks all 75,497,473), and SCREEN lies above that and the
        add's rounding; u = 0 gives -inf, as g."""
        if BOUND:
            return -tl.log(-tl.log(u)) + SCREEN
        return (-tl.log(-tl.log(u.to(tl.float64)))).to(tl.float32)

    @triton.jit
    def _row_key(seeds_ptr, positions_ptr, row):
        """mix_seed(seed, position) of one row (the module docstring's step 1), in uint64 arithmetic, which
        wraps and shifts logically: the same 64 bits as the torch lines, in the kernel that uses them
        instead of 14 int64 launches before it."""
        z = tl.load(seeds_ptr + row).to(tl.uint64, bitcast=True)
        z = z + (tl.load(positions_ptr + row).to(tl.uint64, bitcast=True) + 1) * 0x9E3779B97F4A7C15  # the position
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        return z ^ (z >> 31)

    @triton.jit
    def _sample_kernel(logits_ptr, stride_row, temps_ptr, seeds_ptr, positions_ptr, best_ptr, best_idx_ptr, V,
                       CHUNK, BLOCK: tl.constexpr, SKIP: tl.constexpr):
        """Program (row, split): the argmax of the row's scores over vocab [split·CHUNK, (split+1)·CHUNK)."""
        row, split = tl.program_id(0), tl.program_id(1)
        key = _row_key(seeds_ptr, positions_ptr, row)
        temp = tl.load(temps_ptr + row)
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        # Running argmax per lane: the earliest index of each lane's maximum (strict > keeps the first).
        best, best_idx = tl.full([BLOCK], float("-inf"), tl.float32), tl.zeros([BLOCK], tl.int32)
        for start in range(split * CHUNK, tl.minimum(split * CHUNK + CHUNK, V), BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf"))  # lanes past V never win
            if temp == 0.0:  # greedy: plain argmax, no noise (a branch per row: ~7x cheaper on an H200)
                score = x
            else:
                # Philox keyed by the row's key, counter = vocab index; div_rn: IEEE division, as torch's `/`
                u, scaled = tl.rand(key, cols), tl.div_rn(x, temp)
                # The fp64 logs only where a lane's score may reach the program's best so far: elsewhere its
                # bound (fp32 logs) is below it, so its score is too, and it cannot be the token or tie with it.
                near = scaled + _gumbel(u, True) >= tl.max(best, axis=0) if SKIP else cols >= 0
                score = tl.full([BLOCK], float("-inf"), tl.float32)
                if tl.max(near.to(tl.int32), axis=0) > 0:
                    score = tl.where(near, scaled + _gumbel(u), score)
            better = score > best
            best, best_idx = tl.where(better, score, best), tl.where(better, cols, best_idx)
        top = tl.max(best, axis=0)
        out = row * tl.num_programs(1) + split
        tl.store(best_ptr + out, top)
        tl.store(best_idx_ptr + out, tl.min(tl.where(best == top, best_idx, V), axis=0))  # lowest index at the top

    @triton.jit
    def _argmax_splits_kernel(best_ptr, best_idx_ptr, out_ptr, V, SPLITS: tl.constexpr):
        """Per row: the lowest vocab index among the splits that reach the row's maximum score."""
        row = tl.program_id(0)
        best = tl.load(best_ptr + row * SPLITS + tl.arange(0, SPLITS))
        idx = tl.load(best_idx_ptr + row * SPLITS + tl.arange(0, SPLITS))
        token = tl.min(tl.where(best == tl.max(best, axis=0), idx, V), axis=0)
        tl.store(out_ptr + row, token.to(tl.int64))

    @triton.jit
    def _gumbel_noise_kernel(seeds_ptr, positions_ptr, out_ptr, V, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        key = _row_key(seeds_ptr, positions_ptr, row)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            tl.store(out_ptr + row.to(tl.int64) * V + cols, _gumbel(tl.rand(key, cols)), mask=cols < V)


def _sample_triton(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                   block: int | None = None, skip_from: int = 8, splits: int | None = None) -> torch.Tensor:
    # A program per (row, vocab split) is bound by Philox and the fp64 logs: 16 warps of 4096 lanes ran
    # 2.3x faster than 4 warps of 1024 on an H200 (V=129280). One program per row left most of the
    # chip idle below ~132 rows, so the vocab is split until rows x splits fills it; a second launch
    # takes the lowest index at the maximum over the splits, which is the token of one whole-row pass.
    # The fp64 logs are skipped where a lane cannot win (`_gumbel`'s BOUND) once a program walks `skip_from`
    # blocks or more (its first block takes them all; over a few blocks the fp32 bound costs more than it
    # saves), in blocks of 1,024 from 16 rows. On an H200 at V = 129,280 (benchmarks/RESULTS.md): 64 rows
    # 0.103 -> 0.079 ms, 256 rows 0.405 -> 0.253; 16 rows 0.033 -> 0.027 (the block alone); 1 row unchanged.
    # None of these choices moves a token: each is the exact argmax, lowest index on ties.
    rows, V = logits.shape
    splits = splits or 1 << (max(1, min(32, 512 // max(rows, 1))).bit_length() - 1)  # a power of two, by the shape
    block = block or (4096 if rows < 16 else 1024)
    chunk = triton.cdiv(triton.cdiv(V, splits), block) * block
    best, best_idx = (torch.empty(rows, splits, dtype=t, device=logits.device) for t in (torch.float32, torch.int32))
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _sample_kernel[(rows, splits)](logits, logits.stride(0), temperatures, seeds, positions, best, best_idx, V,
                                       chunk, BLOCK=block, SKIP=chunk >= skip_from * block, num_warps=16)
        _argmax_splits_kernel[(rows,)](best, best_idx, out, V, SPLITS=splits)
    return out


# ---- public API --------------------------------------------------------------------------------------------
def _use_triton(use_triton: bool | None, device: torch.device) -> bool:
    use_triton = device.type == "cuda" if use_triton is None else use_triton
    if use_triton and triton is None:
        raise RuntimeError("Triton is not installed here; sample with use_triton=False (the torch path).")
    return use_triton


def sample(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, *,
           use_triton: bool | None = None) -> torch.Tensor:
    """One token per row: greedy where the temperature is 0, else Gumbel-max keyed by (seed, position).

    logits [B, V] fp32 (rows may be strided, the vocab contiguous), temperatures [B] fp32 (0 or > 0),
    seeds [B] int64, positions [B] int64 (the output position of the token drawn), all on one device.
    use_triton: None picks the Triton kernel on CUDA and the torch path elsewhere; the two agree bit for bit
    (on CPU the kernel runs only under TRITON_INTERPRET=1). Returns LongTensor [B]; never syncs the host.
    """
    assert logits.dim() == 2 and logits.dtype == torch.float32 and logits.stride(1) == 1, "logits: [B, V] fp32"
    assert temperatures.dtype == torch.float32 and seeds.dtype == positions.dtype == torch.int64
    assert temperatures.shape == seeds.shape == positions.shape == logits.shape[:1], "one value per row"
    if _use_triton(use_triton, logits.device):  # the keys in the kernel
        return _sample_triton(logits, temperatures.contiguous(), seeds.contiguous(), positions.contiguous())
    return _sample_torch(logits, temperatures, mix_seed(seeds, positions))


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int, *,
                 use_triton: bool | None = None, block: int = 4096) -> torch.Tensor:
    """Debug entry point: the Gumbel noise [B, V] fp32 that `sample` adds to logits / T for these rows."""
    if not _use_triton(use_triton, seeds.device):
        return _noise_torch(mix_seed(seeds, positions), vocab_size)
    out = torch.empty(seeds.shape[0], vocab_size, dtype=torch.float32, device=seeds.device)
    _gumbel_noise_kernel[(seeds.shape[0],)](seeds.contiguous(), positions.contiguous(), out, vocab_size, BLOCK=block)
    return out
