"""Batch-invariant mode (issue #11, model/invariant.py) on CPU with the `micro` model.

The promise: in the mode a request's logits are bitwise the same whatever else shares its batch, however
its prompt is chunked (20, 37, 128, 200 tokens; 20 ends before the window size), with ZOS on or off, and
after preemption and recomputation.
Each test also runs with the mode off, or with one invariant op broken on purpose, and asserts that the
same check then finds a difference, so none of them passes vacuously. Spec §10 says why the default mode
differs (GEMM shapes, discrete choices that amplify a last-ulp change); model/invariant.py lists the sites.
"""
import queue
import random
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.tracer import MemoryTracer
from model import invariant
from model.checkpoint import init_checkpoint, init_weights
from model.config import BLOCK_SIZE, cdiv, preset
from model.paged import ForwardBatch, PagedModel
from model.transformer import Transformer

# ATen's DEFAULT dispatch (no SIMD: a CPU below AVX2, or ATEN_CPU_CAPABILITY=default) has no SIMD/scalar split
# in sigmoid, silu and softplus, so there those ops are batch-invariant without the mode
POINTWISE_SPLIT = torch.backends.cpu.get_cpu_capability() != "DEFAULT"


@pytest.fixture(autouse=True)
def one_thread():
    """The mode's CPU guarantee is for one intra-op thread (the engine's default)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    m = Transformer(preset("micro"))
    init_weights(m.named_parameters(), seed=0)
    return m


# ---- the ops, one at a time ------------------------------------------------------------------------------

def rows_alone_vs_batched(fn, x: torch.Tensor, picks: int = 24, seed: int = 0) -> int:
    """How many of `picks` random rows of x [N, ...] give other bits through fn alone than at their place
    in a random sub-batch of 1..N rows."""
    rng, differ = random.Random(seed), 0
    for _ in range(picks):
        n = rng.randint(1, x.size(0))
        rows = rng.sample(range(x.size(0)), n)
        at = rng.randrange(n)
        differ += not torch.equal(fn(x[rows[at]:rows[at] + 1])[0], fn(x[rows])[at])
    return differ


def test_default_ops_depend_on_the_batch_and_the_mode_ops_do_not():
    """The CPU facts model/invariant.py rests on: an fp32 GEMM and the SIMD/scalar split of sigmoid,
    silu and softplus change a row's bits with the batch; the mode's versions do not. Under DEFAULT dispatch
    the pointwise ops have no split, and the test checks that they are then invariant as they are."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(300, 256, generator=g), torch.randn(96, 256, generator=g)
    z = torch.randn(300, 6, generator=g) * 3
    big = torch.randn(invariant.BIG_WEIGHT // 256 + 1, 256, generator=g)
    sites = {"linear fp32": lambda t: invariant.linear(t, w),
             "linear bf16": lambda t: invariant.linear(t.bfloat16(), w.bfloat16()),
             "linear, big weight": lambda t: invariant.linear(t, big),  # SMALL_ROW_TILE rows per call
             "sigmoid": lambda t: invariant.pointwise(torch.sigmoid, t[:, :6]),
             "silu": lambda t: invariant.pointwise(F.silu, t[:, :6]),
             "softplus": lambda t: invariant.pointwise(F.softplus, t[:, :6])}
    for name, fn in sites.items():
        pointwise = name in ("sigmoid", "silu", "softplus")
        data = z if pointwise else x
        if pointwise and not POINTWISE_SPLIT:
            assert rows_alone_vs_batched(fn, data) == 0, f"{name} depends on the batch under DEFAULT dispatch"
        else:
            assert rows_alone_vs_batched(fn, data) > 0 or name == "linear bf16", f"{name} was invariant by default"
        with invariant.mode():
            assert rows_alone_vs_batched(fn, data) == 0, name


def test_row_reductions_and_exact_pointwise_ops_are_already_invariant():
    """The claims the mode leaves to torch, checked: norms (mean over the feature dim), softmax over the
    last or the r-member dim, sums over hc, amax, exp, rsqrt and sqrt on one intra-op thread."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(300, 4, 64, generator=g) * 3
    ops = {"mean": lambda t: t.flatten(1).square().mean(-1, keepdim=True), "softmax-1": lambda t: t.softmax(-1),
           "softmax-2": lambda t: t.softmax(-2), "sum hc": lambda t: t.sum(-2), "amax": lambda t: t.amax(-1),
           "exp": torch.exp, "rsqrt": lambda t: torch.rsqrt(t.abs() + 1e-6), "sqrt": lambda t: t.abs().sqrt(),
           "exp [.,4]": lambda t: torch.exp(t[:, :, 0].contiguous())}
    for name, fn in ops.items():
        assert rows_alone_vs_batched(fn, x, picks=40) == 0, name


def test_every_gemm_call_of_a_forward_has_a_fixed_shape_in_the_mode(model, monkeypatch):
    """Structural: in the mode every F.linear call has exactly row_tile(w) rows and every torch.bmm call
    (index scores, sparse attention) one of three fixed shapes, whatever the batch; out of it, not.
    On this CPU the batched einsums happen to be invariant by default too (the products test below),
    so this is the test that fails if one of those sites loses its fixed-shape path."""
    shapes = {"linear": set(), "bmm": set(), "einsum": set()}
    linear, bmm, einsum = F.linear, torch.bmm, torch.einsum
    monkeypatch.setattr(torch, "einsum", lambda eq, *ops: shapes["einsum"].add(eq) or einsum(eq, *ops))
    monkeypatch.setattr(F, "linear", lambda x, w: shapes["linear"].add(x.size(0) - invariant.row_tile(w))
                        or linear(x, w))  # 0: exactly the weight's row tile
    monkeypatch.setattr(torch, "bmm", lambda a, b: shapes["bmm"].add((*a.shape, b.size(2), b.is_contiguous()))
                        or bmm(a, b))  # b is a transposed view where the site passes rows (index keys, K)
    tokens = request(model)
    for batch_invariant in (True, False):
        for seen in shapes.values():
            seen.clear()
        target_logits(model, tokens[:60], 50, batch_invariant, 37, 5, 4)
        a, i, T = model.args, invariant, invariant.ROW_TILE
        fixed = {(i.BATCH_TILE, T, a.index_head_dim, i.COL_TILE, False),  # index scores, N tiled
                 (i.BATCH_TILE, a.n_heads, a.head_dim, i.ATTN_BLOCK, False),  # q·kᵀ of one block
                 (i.BATCH_TILE, a.n_heads, i.ATTN_BLOCK, a.head_dim, True)}  # P·V over a whole block
        if batch_invariant:
            assert shapes["linear"] == {0}, shapes["linear"]
            assert shapes["bmm"] == fixed, shapes["bmm"]
            assert not shapes["einsum"], f"einsums left in the mode: {shapes['einsum']}"  # wo_a included
        else:
            assert len(shapes["linear"]) > 1 and not shapes["bmm"] & fixed and len(shapes["einsum"]) == 4


def test_index_scores_and_attention_products_have_fixed_shapes_in_the_mode():
    """The context-sized contractions: index scores over E entries (N grows with the context) and the
    sparse attention's batched products; a row's scores must not change with E beyond its own entries
    or with the number of rows."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(5, 37, 4, 32, generator=g).bfloat16()
    keys = torch.randn(5, 300, 32, generator=g).bfloat16()
    with invariant.mode():
        full = invariant.index_scores_dot(q, keys)
        assert torch.equal(invariant.index_scores_dot(q[2:3, 5:6], keys[2:3, :40])[0, 0], full[2, 5, :, :40])
        qf, kv = torch.randn(7, 9, 2, 64, generator=g), torch.randn(7, 9, 64, 64, generator=g)
        s = invariant.attention_scores(qf, kv)
        assert torch.equal(invariant.attention_scores(qf[3:4, 4:5], kv[3:4, 4:5])[0, 0], s[3, 4])
        v = invariant.attention_values(s, kv)
        assert torch.equal(invariant.attention_values(s[6:7, :1], kv[6:7, :1])[0, 0], v[6, 0])


# ---- the paged model: one request alone against the same request among random neighbours -----------------

class Driver:
    """PagedModel with explicit rows; sequence i owns state slot i and blocks [i·nb, (i+1)·nb)."""

    def __init__(self, model: Transformer, n_seqs: int, batch_invariant: bool, max_len: int = 512):
        self.nb, self.device = cdiv(max_len, BLOCK_SIZE), model.head.weight.device
        self.paged = PagedModel(model, n_seqs * self.nb, n_seqs, batch_invariant)

    def step(self, rows: list[tuple[int, int, list[int]]]) -> torch.Tensor:
        """rows (seq, start, tokens) -> logits of every token [B, S, vocab]."""
        S = max(len(t) for *_, t in rows)
        tensor = lambda x: torch.tensor(x, device=self.device)  # noqa: E731
        ids = tensor([t + [0] * (S - len(t)) for *_, t in rows])
        tables = tensor([[seq * self.nb + k for k in range(self.nb)] for seq, *_ in rows])
        batch = ForwardBatch(ids, tensor([s for _, s, _ in rows]), tensor([len(t) for *_, t in rows]),
                             tables, tensor([seq for seq, *_ in rows]), max(s + len(t) for _, s, t in rows),
                             all(len(t) == 1 and s > 0 for _, s, t in rows))
        return self.paged.forward(batch, all_logits=True)


def target_logits(model, tokens: list[int], prompt_len: int, batch_invariant: bool, chunk: int | None,
                  neighbours: int, seed: int) -> torch.Tensor:
    """The target request's logits at every position [len(tokens), vocab]: its prompt in chunks of
    `chunk` (None: one chunk), then one decode step per remaining token, each step beside up to
    `neighbours` random other sequences (random lengths, random chunks, the target at a random row)."""
    rng = random.Random(seed)
    drv = Driver(model, neighbours + 1, batch_invariant)
    others = {i: [rng.randrange(model.args.vocab_size) for _ in range(rng.randint(1, 400))]
              for i in range(1, neighbours + 1)}
    done = {i: 0 for i in others}
    out, pos = [], 0
    while pos < len(tokens):
        n = min(chunk or prompt_len, prompt_len - pos) if pos < prompt_len else 1
        rows = [(0, pos, tokens[pos:pos + n])]
        if neighbours:
            for i in rng.sample(sorted(others), rng.randint(1, neighbours)):
                left = len(others[i]) - done[i]
                if left > 0:
                    k = min(left, 1 if n == 1 and rng.random() < 0.8 else rng.randint(1, max(n, 8)))
                    rows.append((i, done[i], others[i][done[i]:done[i] + k]))
                    done[i] += k
        rng.shuffle(rows)
        logits = drv.step(rows)
        at = next(b for b, r in enumerate(rows) if r[0] == 0)
        out.append(logits[at, :n].cpu())
        pos += n
    return torch.cat(out)


def request(model, n: int = 260, seed: int = 5) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.args.vocab_size, (n,), generator=g).tolist()


PROMPT = 240  # then 20 decode steps: past the window (32), top-k (16 entries) and candidate (32) saturation


@pytest.fixture(scope="module")
def alone(model):
    """The request alone: its prompt in one chunk, then decode alone, in the mode."""
    return target_logits(model, request(model), PROMPT, True, None, 0, 0)


@pytest.mark.parametrize("chunk,neighbours,seed", [(37, 63, 1), (128, 8, 2), (200, 2, 3), (20, 8, 4)])
def test_logits_are_bitwise_the_same_alone_and_among_random_neighbours(model, alone, chunk, neighbours, seed):
    got = target_logits(model, request(model), PROMPT, True, chunk, neighbours, seed)
    differ = (got != alone).any(-1).nonzero().flatten().tolist()
    assert not differ, f"positions {differ[:10]} differ (of {len(differ)})"


def test_without_the_mode_the_same_check_finds_a_difference(model):
    tokens = request(model)
    base = target_logits(model, tokens, PROMPT, False, None, 0, 0)
    got = target_logits(model, tokens, PROMPT, False, 37, 8, 1)
    assert not torch.equal(got, base), "the default mode was batch-invariant here: the check proves nothing"


@pytest.fixture(scope="module")
def wide():
    """`micro` with a 96-position window: an attention list of 96 + 16 entries spans two blocks of 64, as
    tiny-68m's 128 + 64 spans three, so the decode window order moves entries between blocks (with one
    block, as in `micro`, the order changes only where the -1 gaps sit, which this CPU sums alike)."""
    args = preset("micro")
    args.window_size = 96
    m = Transformer(args.check())
    init_weights(m.named_parameters(), seed=0)
    return m


BROKEN = {
    "linear": lambda m: m.setattr(invariant, "linear", lambda x, w: F.linear(x, w)),
    "window order": lambda m: m.setattr(invariant, "window_decode_order", lambda decode: decode),
}


@pytest.mark.parametrize("op", sorted(BROKEN))
def test_breaking_one_invariant_op_is_caught(wide, op, monkeypatch):
    """Each site matters: with one op back to its default form, the same check (alone against random
    neighbours, both under the break) finds a difference. A short prompt, so that decode rows sit below
    the window size, the only positions where the official decode order differs from the prefill one.
    (`pointwise`: the fp32 test below; the contraction sites: the fixed-shape test above.)"""
    tokens = request(wide, 48)
    alone, batched = (lambda: target_logits(wide, tokens, 8, True, None, 0, 0),
                      lambda: target_logits(wide, tokens, 8, True, 37, 8, 1))
    assert torch.equal(alone(), batched())
    BROKEN[op](monkeypatch)
    assert not torch.equal(alone(), batched()), f"breaking {op} went unnoticed"


def test_fp32_debug_mode_is_invariant_and_needs_the_pointwise_path(model, monkeypatch):
    """The fp32 debugging mode (ARCHITECTURE.md §6) in the batch-invariant mode: bitwise too. There no bf16
    rounding absorbs a last-ulp change, so the SIMD/scalar split of sigmoid/silu/softplus shows at the
    model level: with `pointwise` back to the plain call the check finds a difference (in bf16 the
    rounding hid it in every scenario tried, though the op-level test shows the values differ). Under DEFAULT
    dispatch there is no split to find, and the plain call gives the same bits."""
    m = Transformer(preset("micro"))
    m.load_state_dict(model.state_dict())
    m.to_fp32()
    tokens = request(m, 120)
    alone32 = target_logits(m, tokens, 100, True, None, 0, 0)
    assert torch.equal(target_logits(m, tokens, 100, True, 37, 8, 1), alone32)
    monkeypatch.setattr(invariant, "pointwise", lambda fn, x: fn(x))
    same = torch.equal(target_logits(m, tokens, 100, True, 37, 8, 1), alone32)
    assert same != POINTWISE_SPLIT, ("breaking pointwise went unnoticed" if POINTWISE_SPLIT
                                     else "no split under DEFAULT dispatch, yet other bits")


# ---- the engine: LLM(batch_invariant=True), ZOS on and off, chunked prefill, preemption ------------------

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("micro-ckpt")
    init_checkpoint("micro", 0, path)
    return str(path)


def engine_logits(ckpt, prompts, params, order, **kw) -> tuple[dict, list, MemoryTracer]:
    """Run the prompts (submitted in `order`) and log every row's logits, keyed (prompt index, position of
    the row's last token); a position computed again after preemption adds a second entry."""
    tracer = MemoryTracer()
    llm = LLM(ckpt, tracer=tracer, **kw)
    runner, pending, seen = llm.engine.runner, queue.SimpleQueue(), defaultdict(list)
    execute, forward = runner.execute, runner.model.forward

    def logged_execute(batch):  # the CPU worker runs forwards in the order of their execute calls
        pending.put(batch.rows)
        return execute(batch)

    def logged_forward(batch, *args, **kwargs):
        logits = forward(batch, *args, **kwargs)
        for row, row_logits in zip(pending.get(), logits):
            seen[order[row.seq_id], row.start + row.num_tokens - 1].append(row_logits.clone())
        return logits

    runner.execute, runner.model.forward = logged_execute, logged_forward
    outs = llm.generate([prompts[i] for i in order], [params[i] for i in order], progress=False)
    llm.engine.shutdown()
    tokens = [None] * len(prompts)
    for i, out in zip(order, outs):
        tokens[i] = out.token_ids
    return seen, tokens, tracer


def workload(n: int, seed: int = 0):
    """n prompts of 90-126 tokens with 8-24 output tokens: most cross a KV block boundary in decode."""
    g = random.Random(seed)
    prompts = [[g.randrange(3, 1024) for _ in range(g.randint(90, 126))] for _ in range(n)]
    params = [SamplingParams(temperature=g.choice([0.0, 0.8, 1.0]), seed=100 + i, max_tokens=g.randint(8, 24),
                             ignore_eos=True) for i in range(n)]
    return prompts, params


def differing(a: dict, b: dict) -> list:
    """Keys both runs computed whose logits are not bitwise equal (every recomputation included)."""
    return [k for k in a.keys() & b.keys() if any(not torch.equal(x, a[k][0]) for x in a[k] + b[k])]


def test_engine_logits_are_bitwise_the_same_across_batching_chunking_zos_and_preemption(ckpt):
    """16 requests: (A) in order, chunks of 200 tokens, ZOS on; (B) reversed, chunks of 37, ZOS off, 6 KV
    blocks so that decode preempts and recomputes; (C) request 0 alone, chunks of 128. Every position two
    runs both computed, and every recomputed position, has bitwise the same logits; so the tokens agree."""
    prompts, params = workload(16)
    n = len(prompts)
    a, tok_a, _ = engine_logits(ckpt, prompts, params, list(range(n)), batch_invariant=True,
                                max_num_batched_tokens=200)
    b, tok_b, tracer = engine_logits(ckpt, prompts, params, list(range(n))[::-1], batch_invariant=True,
                                     max_num_batched_tokens=37, enable_zos=False, num_kv_blocks=6)
    c, tok_c, _ = engine_logits(ckpt, prompts[:1], params[:1], [0], batch_invariant=True, max_num_batched_tokens=128)
    assert len(tracer.kinds("preempt")) >= 2, "the pool was meant to force preemption"
    assert any(len(v) > 1 for v in b.values()), "no position was recomputed"
    common = a.keys() & b.keys()
    assert len(common) >= sum(p.max_tokens for p in params), "the runs share too few positions"
    assert not differing(a, b), differing(a, b)[:10]
    assert not differing(a, c) and len(a.keys() & c.keys()) == params[0].max_tokens, differing(a, c)
    assert tok_a == tok_b and tok_a[0] == tok_c[0]


def test_engine_without_the_mode_finds_a_difference(ckpt):
    """The same comparison with batch_invariant=False (and the mode's header field off) finds a position."""
    prompts, params = workload(12, seed=1)
    order = list(range(len(prompts)))
    a, _, tracer = engine_logits(ckpt, prompts, params, order, max_num_batched_tokens=200)
    b, _, _ = engine_logits(ckpt, prompts, params, order[::-1], max_num_batched_tokens=37, enable_zos=False)
    assert differing(a, b), "the default mode was batch-invariant here: the engine test proves nothing"
    assert tracer.events[0][1]["engine"]["batch_invariant"] is False


def test_the_mode_is_refused_where_it_does_not_hold(ckpt):
    """CPU with one intra-op thread only, for now (model/invariant.py says what CUDA still needs)."""
    with pytest.raises(ValueError, match="batch_invariant"):
        LLM(ckpt, batch_invariant=True, cpu_threads=2)


def test_record_batch_invariant_says_so_and_check_re_executes_in_the_mode(ckpt, tmp_path, monkeypatch):
    """`mdi-trace record --batch-invariant`: the header's engine map says batch_invariant, and `check`
    rebuilds its runner in the mode (a replay outside it would not be the recorded computation)."""
    import engine.model_runner as model_runner
    from tracing.execute import check_tokens
    from tracing.reader import open_trace
    from tui.cli import main

    trace = tmp_path / "bi.mdt"
    assert main(["record", "-o", str(trace), "--model", ckpt, "--num-prompts", "4", "--input-len", "40:150",
                 "--output-len", "6:12", "--num-kv-blocks", "4", "--max-num-batched-tokens", "64",
                 "--temperature", "0.8", "--batch-invariant"]) == 0
    t = open_trace(trace)
    assert t.header["engine"]["batch_invariant"] is True
    built = []
    paged = model_runner.PagedModel
    monkeypatch.setattr(model_runner, "PagedModel", lambda *a: built.append(a[-1]) or paged(*a))
    result = check_tokens(t)
    assert result.mismatch is None and result.tokens > 0 and built == [True]
