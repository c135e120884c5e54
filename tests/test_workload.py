"""tracing/workload.py: the seeded workload `mdi-trace record` and the benchmarks draw, and the harness that
runs it with cancellations and a stop flag."""
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.llm_engine import LLMEngine
from tracing.reader import open_trace
from tracing.workload import FIRST_TOKEN_ID, Workload, WorkloadError, WorkloadSpec, draw, read_prompts, run

EXAMPLE = Path(__file__).resolve().parent.parent / "traces" / "examples" / "micro-preempt-cancel.mdt"


def llm_like(vocab_size=1024, max_model_len=2048, num_kv_blocks=16):
    """What `draw` reads of an LLM: the engine's public limits and its check_request, no model."""
    engine = SimpleNamespace(vocab_size=vocab_size, max_model_len=max_model_len,
                             config=SimpleNamespace(num_kv_blocks=num_kv_blocks))
    engine.check_request = partial(LLMEngine.check_request, engine)
    return SimpleNamespace(engine=engine, tokenizer=None)


def test_the_same_seed_draws_the_same_workload_within_the_vocabulary_and_the_ranges():
    spec = WorkloadSpec(num_prompts=12, input_len=(5, 40), output_len=(2, 9), cancel_rate=0.5, seed=3)
    a, b = draw(spec, llm_like(vocab_size=50)), draw(spec, llm_like(vocab_size=50))
    assert a == b and len(a.requests) == 12 and a.cancel_at
    for ids, params in a.requests:
        assert 5 <= len(ids) <= 40 and 2 <= params.max_tokens <= 9
        assert all(FIRST_TOKEN_ID <= t < 50 for t in ids)
    assert all(0 <= k < a.requests[i].params.max_tokens for i, k in a.cancel_at.items())
    other = draw(WorkloadSpec(num_prompts=12, input_len=(5, 40), output_len=(2, 9), cancel_rate=0.5, seed=4),
                 llm_like(vocab_size=50))
    assert other.requests != a.requests


def test_record_s_defaults_at_seed_6_draw_the_committed_example_s_requests():
    """The example was recorded by `mdi-trace record --model micro --seed 6 --num-kv-blocks 16`: the same
    spec draws its prompts and max_tokens, and its cancelled request is one the draw cancels."""
    with open_trace(EXAMPLE) as t:
        model, engine = t.header["model"], t.header["engine"]
        events = list(t.events())
    added = [e for e in events if type(e).__name__ == "RequestAdded"]
    cancelled = {e.seq_id for e in events if type(e).__name__ == "Cancel"}
    w = draw(WorkloadSpec(seed=6),
             llm_like(model["vocab_size"], model["max_seq_len"], engine["num_kv_blocks"]))
    assert [(list(ids), p.max_tokens, p.temperature) for ids, p in w.requests] == \
           [(list(e.prompt_token_ids), e.max_tokens, e.temperature) for e in added]
    assert cancelled and cancelled <= set(w.cancel_at)


def test_a_prompts_file_line_over_the_context_is_refused_in_one_sentence(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": [5, 6], "max_tokens": 4}\n{"prompt": [7, 8, 9, 10], "max_tokens": 30}\n')
    spec = WorkloadSpec(prompts=read_prompts(path))
    with pytest.raises(WorkloadError) as e:
        draw(spec, llm_like(max_model_len=32))
    assert str(e.value) == "prompt (4) plus max_tokens (30) exceeds max_model_len 32; raise max_model_len."
    assert draw(spec, llm_like(max_model_len=34)).requests[1].params.max_tokens == 30


def test_a_random_prompt_of_max_model_len_is_refused_before_its_ids_are_drawn():
    with pytest.raises(WorkloadError, match=r"^--input-len 32:32 drew a prompt of 32 tokens; max_model_len "
                                            r"is 32 \(--max-model-len\)\.$"):
        draw(WorkloadSpec(num_prompts=1, input_len=(32, 32)), llm_like(max_model_len=32))


@pytest.fixture(scope="module")
def llm(checkpoint):
    from engine import LLM
    return LLM(str(checkpoint), max_num_seqs=4, num_kv_blocks=8)


def finish_reasons(llm, workload: Workload, **kwargs) -> tuple[object, dict[int, str]]:
    finished = {}
    engine_step = llm.engine.step

    def step():
        done = engine_step()
        finished.update((s.seq_id - first, s.finish_reason) for s in done)
        return done
    first = llm.engine.next_id
    llm.engine.step = step
    try:
        outcome = run(llm.engine, workload, **kwargs)
    finally:
        del llm.engine.step
    return outcome, finished


def test_a_stop_cancels_every_request_and_run_cancels_one_at_its_drawn_token_count(llm):
    w = draw(WorkloadSpec(num_prompts=3, input_len=(20, 40), output_len=(6, 6)), llm)
    outcome, reasons = finish_reasons(llm, w, stop=lambda: True)
    assert outcome.stopped and reasons == {0: "abort", 1: "abort", 2: "abort"}
    outcome, reasons = finish_reasons(llm, Workload(w.requests, {1: 2}))  # ids 3-5 now: cancel_at is by index
    assert not outcome.stopped and reasons == {0: "length", 1: "abort", 2: "length"}
