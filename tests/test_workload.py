"""tracing/workload.py: the seeded workload `mdi-trace record` and the benchmarks draw, and the harness that
runs it with cancellations and a stop flag."""
import time
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


def test_poisson_arrivals_are_seeded_drawn_after_the_prompts_and_scale_with_the_rate():
    spec = dict(num_prompts=6, input_len=(5, 20), output_len=(2, 5), cancel_rate=0.5, seed=3)
    plain = draw(WorkloadSpec(**spec), llm_like())
    a, b = (draw(WorkloadSpec(**spec, arrivals="poisson:10"), llm_like()) for _ in range(2))
    assert plain.arrivals is None and a.arrivals == b.arrivals
    assert (a.requests, a.cancel_at) == (plain.requests, plain.cancel_at)   # today's seeds give today's prompts
    assert a.arrivals[0] == 0 and all(x < y for x, y in zip(a.arrivals, a.arrivals[1:]))
    fast = draw(WorkloadSpec(**spec, arrivals="poisson:20"), llm_like()).arrivals
    assert fast == pytest.approx([x / 2 for x in a.arrivals])   # the same exponential draws, at twice the rate


def test_a_prompts_file_s_arrivals_and_sampling_parameters(tmp_path):
    path = tmp_path / "served.jsonl"   # what `serve --prompts-out` writes, two lines out of arrival order
    path.write_text('{"prompt": [5, 6], "max_tokens": 2, "temperature": 0.5, "seed": 9, "ignore_eos": true, '
                    '"stop_token_ids": [7], "arrival": 0.25}\n'
                    '{"prompt": [8], "max_tokens": 3, "temperature": 0, "seed": null, "ignore_eos": false, '
                    '"stop_token_ids": [], "arrival": 0.1}\n')
    w = draw(WorkloadSpec(prompts=read_prompts(path), cancel_rate=0), llm_like())
    assert w.arrivals == [0.1, 0.25] and [r.prompt_token_ids for r in w.requests] == [[8], [5, 6]]
    p = w.requests[1].params
    assert (p.temperature, p.seed, p.max_tokens, p.ignore_eos, p.stop_token_ids) == (0.5, 9, 2, True, (7,))
    with pytest.raises(WorkloadError, match="gives every request its arrival; drop --arrivals"):
        draw(WorkloadSpec(prompts=read_prompts(path), arrivals="poisson:5"), llm_like())


@pytest.mark.parametrize("line", ['"arrival": -1', '"arrival": "soon"', '"temperature": -0.5', '"seed": 1.5',
                                  '"ignore_eos": 1', '"stop_token_ids": [-1]', '"max_tokens": 0'])
def test_a_bad_value_in_a_prompts_line_is_one_sentence_with_its_number(tmp_path, line):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": [5]}\n{"prompt": [6], ' + line + '}\n')
    with pytest.raises(WorkloadError, match=r"^\S+ line 2 is not \{\"prompt\".*\}\.$"):
        read_prompts(path)


def test_a_prompts_file_gives_every_line_an_arrival_or_none(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": [5], "arrival": 0}\n\n{"prompt": [6]}\n')
    with pytest.raises(WorkloadError, match=r"line 3 lacks an arrival and line 1 gives one; give every line an "
                                            r"arrival, or none\.$"):
        read_prompts(path)


def adds(llm, workload: Workload):
    """(arrival_ns - the run's start, when it was added - start, the engine's steps before it) per request run."""
    engine, seen, steps = llm.engine, [], [0]
    add, step = engine.add_request, engine.step

    def add_request(ids, params, arrival_ns=None):
        seen.append((arrival_ns, time.perf_counter_ns(), steps[0]))
        return add(ids, params, arrival_ns)

    def counted_step():
        steps[0] += 1
        return step()
    engine.add_request, engine.step = add_request, counted_step
    start = time.perf_counter_ns()
    try:
        run(engine, workload)
    finally:
        del engine.add_request, engine.step
    return [(a - start, t - start, k) for a, t, k in seen]


def test_run_adds_each_request_once_it_has_arrived_and_idles_until_the_next(llm):
    w = draw(WorkloadSpec(num_prompts=3, input_len=(8, 8), output_len=(2, 2), cancel_rate=0), llm)
    w.arrivals = [0.0, 0.02, 0.3]   # the third arrives long after the first two are done: the run sleeps
    seen = adds(llm, w)
    for (arrival, added, _), offset in zip(seen, w.arrivals):
        assert abs(arrival - offset * 1e9) < 2e6 and added >= arrival   # start + arrival, added after it
    assert seen[2][1] >= 0.3e9


def test_a_virtual_clock_adds_each_request_at_the_same_step_every_time(llm):
    w = draw(WorkloadSpec(num_prompts=3, input_len=(8, 8), output_len=(4, 4), cancel_rate=0), llm)
    w.arrivals, w.virtual_clock_ms = [0.0, 0.025, 5.0], 10.0   # 10 ms a step: request 1 joins after 3 steps
    first, again = adds(llm, w), adds(llm, w)
    assert [k for *_, k in first] == [k for *_, k in again] == [0, 3, first[2][2]] and first[2][2] > 3
    assert all(added >= arrival for arrival, added, _ in first)   # the trace's arrivals: real, at the add
