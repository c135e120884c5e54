"""Issue #11's batch-invariant mode on CUDA: the promises of tests/test_batch_invariant.py on the GPU.

- model level, micro and tiny-68m: a request's logits are bitwise the same alone and among random
  neighbours, its prompt chunked 37/128/200, decode included (eager forwards);
- engine level, micro: `LLM(device="cuda", batch_invariant=True)` gives every position the same logits in
  order with chunks of 200 and ZOS on, reversed with chunks of 37, ZOS off and a pool small enough to
  preempt, and alone; decode steps replay CUDA graphs padded to their batch buckets;
- the same checks without the mode find a difference, so none of them passes vacuously.

What makes the CUDA path invariant is in model/invariant.py: the GEMMs (cuBLAS picks its kernel by the
shape) in fixed row tiles, the grouped MoE passes in tiles of MOE_ROW_TILE rows, and the Triton kernels
(RMSNorm, hc, RoPE, quantisation sims, sparse attention), which give each row one program with a
reduction order fixed by the row's own sizes. Skipped without CUDA (not a pass).
"""
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from test_batch_invariant import PROMPT, differing, request, target_logits, workload  # noqa: E402

from engine import LLM  # noqa: E402
from engine.tracer import MemoryTracer  # noqa: E402
from model.checkpoint import init_checkpoint, init_weights  # noqa: E402
from model.config import preset  # noqa: E402
from model.transformer import Transformer  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CASES = [(37, 63, 1), (128, 8, 2), (200, 2, 3), (20, 8, 4)]  # 20: a chunk ending before the window size


def cuda_model(name: str) -> Transformer:
    m = Transformer(preset(name))
    init_weights(m.named_parameters(), seed=0)
    return m.cuda()


@pytest.fixture(scope="module", params=["micro", "tiny-68m"])
def model(request):
    return cuda_model(request.param)


@pytest.fixture(scope="module")
def alone(model):
    return target_logits(model, request(model), PROMPT, True, None, 0, 0)


@pytest.mark.parametrize("chunk,neighbours,seed", CASES)
def test_cuda_logits_are_bitwise_the_same_alone_and_among_random_neighbours(model, alone, chunk, neighbours, seed):
    got = target_logits(model, request(model), PROMPT, True, chunk, neighbours, seed)
    differ = (got != alone).any(-1).nonzero().flatten().tolist()
    assert not differ, f"positions {differ[:10]} differ (of {len(differ)})"


def test_cuda_default_mode_differs_with_the_batch(model):
    """The comparison is not vacuous on CUDA either: without the mode the same check finds a difference."""
    tokens = request(model)
    base = target_logits(model, tokens, PROMPT, False, None, 0, 0)
    assert not torch.equal(target_logits(model, tokens, PROMPT, False, 37, 63, 1), base)


# ---- the engine on CUDA: graphs, ZOS on and off, chunked prefill, preemption ----------------------------

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("micro-ckpt-cuda")
    init_checkpoint("micro", 0, path)
    return str(path)


def cuda_engine_logits(ckpt, prompts, params, order, **kw) -> tuple[dict, list, MemoryTracer, int]:
    """As test_batch_invariant.engine_logits, on CUDA: each step's logits (an eager forward's, or the static
    output of the graph it replayed) are copied on the runner's stream right after the step is queued, so
    the copy is of that step's logits whatever runs next. Returns (logits, tokens, tracer, graph replays)."""
    tracer = MemoryTracer()
    llm = LLM(ckpt, device="cuda", tracer=tracer, **kw)
    runner, seen, replays, copies = llm.engine.runner, defaultdict(list), [0], []
    execute, forward, replay = runner.execute, runner.forward, runner._replay
    rows_of = {}

    def logged_execute(batch):
        rows_of["rows"] = batch.rows
        return execute(batch)

    def logged(step, graph):
        def run(inputs):
            tokens = step(inputs)  # on the runner's stream (ModelRunner._launch_cuda)
            replays[0] += graph
            copies.append((rows_of["rows"], runner.last_logits[:inputs.num_rows].clone()))
            return tokens
        return run

    runner.execute, runner.forward, runner._replay = logged_execute, logged(forward, 0), logged(replay, 1)
    outs = llm.generate([prompts[i] for i in order], [params[i] for i in order], progress=False)
    llm.engine.shutdown()
    torch.cuda.synchronize()
    for rows, logits in copies:
        for row, row_logits in zip(rows, logits.cpu()):
            seen[order[row.seq_id], row.start + row.num_tokens - 1].append(row_logits)
    tokens = [None] * len(prompts)
    for i, out in zip(order, outs):
        tokens[i] = out.token_ids
    return seen, tokens, tracer, replays[0]


def test_cuda_engine_logits_are_bitwise_the_same_across_batching_chunking_zos_and_preemption(ckpt):
    prompts, params = workload(16)
    n = len(prompts)
    a, tok_a, _, graphs_a = cuda_engine_logits(ckpt, prompts, params, list(range(n)), batch_invariant=True,
                                               max_num_batched_tokens=200)
    b, tok_b, tracer, graphs_b = cuda_engine_logits(ckpt, prompts, params, list(range(n))[::-1],
                                                    batch_invariant=True, max_num_batched_tokens=37,
                                                    enable_zos=False, num_kv_blocks=6)
    c, tok_c, _, _ = cuda_engine_logits(ckpt, prompts[:1], params[:1], [0], batch_invariant=True,
                                        max_num_batched_tokens=128)
    assert graphs_a and graphs_b, "decode was meant to replay CUDA graphs"
    assert len(tracer.kinds("preempt")) >= 2, "the pool was meant to force preemption"
    assert any(len(v) > 1 for v in b.values()), "no position was recomputed"
    assert len(a.keys() & b.keys()) >= sum(p.max_tokens for p in params), "the runs share too few positions"
    assert not differing(a, b), differing(a, b)[:10]
    assert not differing(a, c) and len(a.keys() & c.keys()) == params[0].max_tokens, differing(a, c)
    assert tok_a == tok_b and tok_a[0] == tok_c[0]


def test_cuda_engine_without_the_mode_finds_a_difference(ckpt):
    prompts, params = workload(12, seed=1)
    order = list(range(len(prompts)))
    a, *_ = cuda_engine_logits(ckpt, prompts, params, order, max_num_batched_tokens=200)
    b, *_ = cuda_engine_logits(ckpt, prompts, params, order[::-1], max_num_batched_tokens=37, enable_zos=False)
    assert differing(a, b), "the default mode was batch-invariant here: the engine test proves nothing"
