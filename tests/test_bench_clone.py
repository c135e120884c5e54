"""benchmarks/clone.py: a clone of a prefilled sequence decodes what the sequence itself decodes (issue #20 item 2
times decode at long contexts over clones, so a wrong copy would time rows that are not what they claim)."""
import sys
import time
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from model.checkpoint import init_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import clone  # noqa: E402

PROMPT = [3 + (i * 37) % 1000 for i in range(301)]  # past the window of 32, into a third KV block, an open group


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("micro-ckpt")
    init_checkpoint("micro", 0, path)
    return str(path)


def decode_logits(ckpt, seeds: list[int], steps: int, until_parted: bool = False):
    """Prefill PROMPT once (seed 5), clone it once per seed, then `steps` decode steps of all rows: each step's
    logits [rows, vocab] in row order (source first) and every row's tokens. until_parted: stop after the
    first step whose clone's logits differ from the source's."""
    llm = LLM(ckpt, enable_zos=False, batch_invariant=True, num_kv_blocks=64, max_num_seqs=8)
    engine = llm.engine
    source = engine.add_request(PROMPT, SamplingParams(temperature=1.0, seed=5, max_tokens=steps + 2, ignore_eos=True))
    engine.step()  # the prefill: it samples the first token
    ids = [source] + clone.clone_prefilled(engine, source, seeds)
    order = {seq_id: i for i, seq_id in enumerate(ids)}
    seqs = [engine.scheduler.seqs[i] for i in ids]
    logits = []
    for _ in range(steps):
        engine.step()
        rows = torch.tensor([order[s.seq_id] for s in engine.scheduler.running if s.seq_id in order])
        logits.append(engine.runner.last_logits[rows.argsort()].clone())  # the last step's rows, in ids' order
        if until_parted and not torch.equal(logits[-1][1], logits[-1][0]):
            break
    tokens = [list(s.token_ids) for s in seqs]
    engine.shutdown()
    return logits, tokens


def test_a_clone_with_the_source_seed_decodes_the_source_bit_for_bit_and_another_seed_parts(ckpt):
    """Every copied tensor matters: a missing ring, entry, index key, tail or history changes the
    clone's logits. Steps cross a KV block (position 384) so the clone's own new blocks are written and read."""
    logits, tokens = decode_logits(ckpt, [5, 6], steps=90)
    for step, rows in enumerate(logits):
        assert torch.equal(rows[1], rows[0]), f"the seed-5 clone's logits left the source's at decode step {step}"
    assert tokens[1] == tokens[0]
    assert tokens[2][:len(PROMPT) + 1] == tokens[0][:len(PROMPT) + 1], "a clone starts from the source's first token"
    assert tokens[2] != tokens[0], "the seed-6 clone sampled the source's tokens: its seed was not used"


@pytest.mark.parametrize("part", ["ring", "entries", "tails", "history"])
def test_a_clone_missing_one_part_of_the_state_is_caught(ckpt, monkeypatch, part):
    """The test above, with one part of the copy left out (zeros where the clone's copy should be)."""
    real = clone._copy

    def partial(model, runner, source, seq, dev):
        saved = {"ring": [model.ring], "entries": [t for p in model.entries.values() for t in p],
                 "tails": [t for p in model.tails.values() for t in p], "history": [model.history]}[part]
        before = [t.clone() for t in saved]
        real(model, runner, source, seq, dev)
        for t, b in zip(saved, before):
            t.copy_(b)  # the part as it was before the copy: the clone's share of it left unwritten

    monkeypatch.setattr(clone, "_copy", partial)
    logits, _ = decode_logits(ckpt, [5], steps=90, until_parted=True)
    assert any(not torch.equal(rows[1], rows[0]) for rows in logits), f"a clone without its {part} went unnoticed"


def test_cloning_a_sequence_that_has_not_prefilled_is_refused(ckpt):
    llm = LLM(ckpt, enable_zos=False, num_kv_blocks=64)
    engine = llm.engine
    seq_id = engine.add_request(PROMPT, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="after its prefill"):
        clone.clone_prefilled(engine, seq_id, [1])
    engine.shutdown()


def test_cloned_decode_run_times_full_decode_steps_of_every_row(ckpt):
    from bench_decode import SpanTracer, routed_experts

    tracer = SpanTracer()
    llm = LLM(ckpt, tracer=tracer, num_kv_blocks=64, max_num_seqs=4)  # ZOS on
    r = clone.cloned_decode_run(llm.engine, batch=4, context=300, warmup=2, steps=3, seed=1, probe=routed_experts)
    llm.engine.shutdown()
    assert sum(kind == ("decode", 4) for kind in tracer.kinds.values()) >= 2 + 3 + 1  # warm-up, timed, the probe
    assert [kind for kind in tracer.kinds.values() if kind[0] == "prefill"] == [("prefill", 1)], "one prompt prefilled"
    assert r["ms_per_step"] > 0 and 0 < r["busy"] <= 1 and r["prefill_tokens_per_s"] == 300 / r["prefill_s"]
    args = llm.engine.runner.model.args
    assert args.n_activated_experts <= r["experts_per_layer"] <= args.n_routed_experts


@pytest.mark.parametrize("zos", [True, False])
def test_the_timed_window_opens_with_a_step_in_flight_under_zos(ckpt, monkeypatch, zos):
    """After the caller's synchronize no step is in flight, so a window opened at once would return from its first
    call without waiting and N calls would hold N - 1 steps of the device (bench_slice.py's 4-step windows read
    8.4 ms for a 10.4 ms step on an H100): under ZOS timed_decode runs one step before it reads the clock."""
    import types

    import bench_decode

    llm = LLM(ckpt, tracer=bench_decode.SpanTracer(), num_kv_blocks=64, max_num_seqs=2, enable_zos=zos)
    engine = llm.engine
    for i in range(2):
        engine.add_request(PROMPT[:40], SamplingParams(temperature=1.0, seed=i, max_tokens=12, ignore_eos=True))
    while engine.tracer.kinds.get(engine.scheduler.step - 1) != ("decode", 2):
        engine.step()
    calls, step = [], engine.step
    monkeypatch.setattr(engine, "step", lambda: calls.append("step") or step())
    clock = types.SimpleNamespace(perf_counter_ns=lambda: calls.append("clock") or time.perf_counter_ns())
    monkeypatch.setattr(bench_decode, "time", clock)
    bench_decode.timed_decode(engine, 2, 3)
    llm.engine.shutdown()
    assert calls[:calls.index("clock")] == (["step"] if zos else []), calls
    assert calls.count("clock") == 2 and calls[calls.index("clock") + 1:][:4] == ["step"] * 3 + ["clock"]


def test_the_routed_experts_probe_counts_each_layers_distinct_picks_on_the_same_rows(ckpt):
    """bench_decode.py `routed_experts`: one eager decode step of the rows, each layer's distinct experts. Right
    after cloning, the 4 rows are the same row (the same first token at the same position): exactly k experts a
    layer, not 4k; after they part (their own seeds), more. Hooks removed and the graphs setting kept after."""
    from bench_decode import SpanTracer, routed_experts

    llm = LLM(ckpt, tracer=SpanTracer(), enable_zos=False, num_kv_blocks=64, max_num_seqs=4)
    engine = llm.engine
    args = engine.runner.model.args
    E, k = args.n_routed_experts, args.n_activated_experts
    source = engine.add_request(PROMPT, SamplingParams(temperature=1.0, seed=5, max_tokens=20, ignore_eos=True))
    engine.step()
    clone.clone_prefilled(engine, source, [6, 7, 8])
    alike = routed_experts(engine)
    assert alike["experts_per_layer"] == k and abs(alike["experts_expected"] - E * (1 - (1 - k / E) ** 4)) < 1e-9
    layers = len(engine.runner.model.weights.layers)
    assert alike["rows_per_expert"] == [[4] * k] * layers  # each of the k experts gets all 4 rows
    assert [len(ids) for ids in alike["ids"]] == [4] * layers and all(len(set(map(tuple, ids))) == 1
                                                                     for ids in alike["ids"])
    for _ in range(3):
        engine.step()
    parted = routed_experts(engine)
    assert k < parted["experts_per_layer"] <= min(E, 4 * k)
    assert all(sum(layer) == 4 * k and layer == sorted(layer, reverse=True) for layer in parted["rows_per_expert"])
    gate = engine.runner.model.weights.layers[0].ffn.gate
    assert not gate._forward_hooks and engine.runner.use_cuda_graphs is True
    engine.shutdown()
