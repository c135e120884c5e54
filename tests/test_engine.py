"""The engine's promises (ARCHITECTURE.md §2) on CPU, with the `micro` model.

Promise 3: a token depends only on the sequence's seed, its output position and its logits, so reversed
prompt order, ZOS off, recomputation after preemption and other chunk sizes give the same tokens, and
cancelling one request leaves the others' tokens unchanged. Promise 1: a step's input is the explicit
ScheduledBatch. On CPU the paged model is batch-invariant in practice (tests/test_model.py), so the
comparisons here are exact; a failure would be reported with the step and request.
"""
import pytest
import torch

from engine import LLM, SamplingParams
from engine.tracer import MemoryTracer
from kernels.sampling import gumbel_noise
from model.checkpoint import init_checkpoint
from model.reference import ReferenceModel
from tracing.compare import TOL_BF16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("micro")
    init_checkpoint("micro", 0, path)
    return str(path)


def prompts(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(20, 300, (n,), generator=g).tolist()
    return [torch.randint(3, 1024, (k,), generator=g).tolist() for k in lengths]


def run(ckpt, ps, params, **kw):
    llm = LLM(ckpt, **kw)
    outs = llm.generate(ps, params, progress=False)
    llm.engine.shutdown()
    return [o.token_ids for o in outs], llm


def assert_same_tokens(llm, ps, params, a_runs, b_runs):
    """Tokens of two runs, compared per request up to the first near tie (ARCHITECTURE.md §6): where
    they first differ, the two candidates' sampling scores (logits/T + Gumbel noise, or the logits when
    greedy), recomputed by the reference, must be within the bf16 logit tolerance. Returns the number
    of tokens compared."""
    ref, compared = ReferenceModel(llm.engine.runner.model.weights), 0
    for p, sp, a, b in zip(ps, params, a_runs, b_runs):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        compared += same
        if same == len(a) == len(b):
            continue
        assert same < min(len(a), len(b)), f"one run stopped early at output {same}"
        scores = ref.forward(p + a[:same])[-1]
        if sp.temperature > 0:
            noise = gumbel_noise(torch.tensor([sp.seed]), torch.tensor([same]), scores.numel())[0]
            scores = scores / sp.temperature + noise.to(scores.device)
        gap = float((scores[a[same]] - scores[b[same]]).abs())
        limit = TOL_BF16 / max(sp.temperature, 1.0) if sp.temperature > 0 else TOL_BF16
        assert gap <= 2 * limit, f"output {same} of a {len(p)}-token prompt: {a[same]} vs {b[same]}, gap {gap:.3g}"
    return compared


SAMPLED = [SamplingParams(temperature=t, seed=s, max_tokens=24, ignore_eos=True)
           for t, s in [(1.0, 11), (0.8, 12), (0.0, None), (1.3, 14), (1.0, 15), (0.5, 16)]]


def test_greedy_engine_tokens_are_the_reference_argmax(ckpt):
    ps = prompts(4, seed=1)
    tokens, llm = run(ckpt, ps, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), max_num_seqs=4)
    ref = ReferenceModel(llm.engine.runner.model.weights)
    for p, out in zip(ps, tokens):
        logits = ref.forward(p + out)[len(p) - 1:-1]  # the logits that chose each output token
        top2 = logits.topk(2, dim=-1).values
        for i, t in enumerate(out):
            if top2[i, 0] - top2[i, 1] < 1e-3:  # a near tie: later tokens are downstream of it
                break
            assert t == int(logits[i].argmax()), f"output {i} of a {len(p)}-token prompt"


def test_reversed_prompt_order_gives_the_same_tokens(ckpt):
    ps = prompts()
    forward, _ = run(ckpt, ps, SAMPLED)
    backward, _ = run(ckpt, ps[::-1], SAMPLED[::-1])
    assert forward == backward[::-1]


def test_zos_off_gives_the_same_tokens(ckpt):
    ps = prompts(seed=2)
    on, _ = run(ckpt, ps, SAMPLED)
    off, _ = run(ckpt, ps, SAMPLED, enable_zos=False)
    assert on == off


def test_recomputation_after_preemption_reproduces_the_discarded_tokens(ckpt):
    """Six requests of up to 2 blocks each share 5 blocks: decode preempts the longest outputs. The
    token a preempted sequence had in flight is discarded (stale epoch); recomputing its prompt and
    outputs in a later prefill must draw that same token at the same position."""
    ps = [p[:200] for p in prompts(seed=3)]
    params = [SamplingParams(temperature=1.0, seed=20 + i, max_tokens=70, ignore_eos=True) for i in range(6)]
    tracer = MemoryTracer()
    tokens, _ = run(ckpt, ps, params, num_kv_blocks=5, tracer=tracer)
    assert len(tracer.kinds("preempt")) >= 2, "the pool was meant to force preemption"
    kept = {(e[2], e[4]): e[5] for e in tracer.kinds("token") if e[6]}  # (seq, position) -> token
    redrawn = [(e[5], kept[(e[2], e[4])]) for e in tracer.kinds("token")
               if not e[6] and (e[2], e[4]) in kept]
    assert len(redrawn) >= 2 and all(a == b for a, b in redrawn), redrawn
    assert [len(t) for t in tokens] == [70] * 6


@pytest.mark.parametrize("chunk", [128, 200])
def test_chunk_size_does_not_change_the_tokens(ckpt, chunk):
    ps = prompts(seed=4)
    whole, llm = run(ckpt, ps, SAMPLED, max_num_batched_tokens=2048)
    chunked, _ = run(ckpt, ps, SAMPLED, max_num_batched_tokens=chunk)
    assert assert_same_tokens(llm, ps, SAMPLED, whole, chunked) >= 100


def test_cancelling_one_request_leaves_the_others_unchanged(ckpt):
    ps = prompts(seed=5)
    full, _ = run(ckpt, ps, SAMPLED)
    llm = LLM(ckpt)
    ids = [llm.engine.add_request(p, s) for p, s in zip(ps, SAMPLED)]
    done = {}
    for step in range(1000):
        if step == 4:
            llm.engine.abort(ids[2])
        for seq in llm.engine.step():
            done[seq.seq_id] = seq
        if not llm.engine.has_unfinished():
            break
    llm.engine.shutdown()
    assert done[ids[2]].finish_reason == "abort"
    assert [done[i].output_token_ids for i in ids if i != ids[2]] == [t for i, t in enumerate(full) if i != 2]


def test_finish_reasons_and_text(ckpt):
    llm = LLM(ckpt)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = llm.generate(["hello"], greedy, progress=False)[0]
    stop_at = first.token_ids[3]
    outs = llm.generate(["hello", "hello"], [greedy, SamplingParams(temperature=0, max_tokens=8,
                                                                    stop_token_ids=(stop_at,))], progress=False)
    assert outs[0].finish_reason == "length" and len(outs[0].token_ids) == 8
    assert outs[1].finish_reason == "stop" and outs[1].token_ids == first.token_ids[:first.token_ids.index(stop_at) + 1]
    assert outs[0].prompt_token_ids == llm.tokenizer.encode("hello") and isinstance(outs[0].text, str)
    with pytest.raises(ValueError, match="exceeds max_model_len 2048"):
        llm.generate([[5] * 2040], SamplingParams(max_tokens=16), progress=False)


def test_a_checkpoint_tokenizer_json_is_used(ckpt, tmp_path):
    """A checkpoint folder that brings tokenizer.json: prompts are encoded and outputs decoded with it."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path / "with-tokenizer"
    shutil.copytree(ckpt, folder)
    vocab = {"<｜begin▁of▁sentence｜>": 0, "<｜end▁of▁sentence｜>": 1, "<pad>": 2, "[UNK]": 3,
             **{w: 10 + i for i, w in enumerate("the quick brown fox jumps over lazy dog".split())}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    llm = LLM(str(folder))
    out = llm.generate(["the quick brown fox"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       progress=False)[0]
    llm.engine.shutdown()
    assert out.prompt_token_ids == [10, 11, 12, 13]
    assert out.text == tok.decode(out.token_ids)
