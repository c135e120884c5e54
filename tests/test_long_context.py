"""Long contexts (issue #19 item 4): `max_model_len` past the checkpoint's max_seq_len, and a KV pool sized from
a memory budget (engine/kv_budget.py).

The recorded run on `micro` (CPU) goes past the checkpoint's 2,048 positions, where every attention mechanism
is in its long-context regime (windows wrap, more compressed entries than the index top-k, more candidate
blocks than the candidate top-k), and re-executes clean against the plain reference, which computes every
position from 0 with RoPE tables of the recorded length."""
import os
import random

import pytest
import torch

from engine.kv_budget import memory_budget, size_pool
from model.config import BLOCK_SIZE, cdiv, preset
from model.paged import PagedModel, allocate_caches, bytes_per_block, bytes_per_slot, cache_bytes
from tracing.reader import open_trace
from tui.cli import main

# Positions of the long request: 4,096, twice micro's max_seq_len, where every mechanism below already binds
# (the first test asserts it): about 45 s on 2 cores. MDI_LONG_CONTEXT=16384, the length, takes about
# 7 min and 8 GB on CI's 2-core AVX2 CPU (the reference's [1, S, heads, entries] bf16 index scores, with no
# native bf16 GEMM there); it kept CI's whole suite past 15 minutes, so it is the opt-in run.
LONG = int(os.environ.get("MDI_LONG_CONTEXT", "4096"))
SHORT, MAX_TOKENS = 300, 3


@pytest.fixture(scope="module")
def long_trace(checkpoint, tmp_path_factory):
    from tracing.workload import PromptLine, WorkloadSpec, record, recorded_llm

    path = tmp_path_factory.mktemp("long") / "long.mdt"
    rng = random.Random(19)
    prompts = [PromptLine([rng.randrange(3, 1024) for _ in range(n)], MAX_TOKENS) for n in (LONG - MAX_TOKENS, SHORT)]
    llm = recorded_llm(path, argv=["test_long_context"], model=str(checkpoint), max_model_len=LONG,
                       max_num_seqs=2, max_num_batched_tokens=512, seed=19)
    outcome = record(llm, WorkloadSpec(prompts=prompts, cancel_rate=0.0, seed=19))
    assert not outcome.stopped
    return path, llm


def test_a_run_past_the_checkpoint_s_max_seq_len_binds_every_long_context_mechanism(long_trace, checkpoint):
    from model.config import ModelArgs

    path, llm = long_trace
    with open_trace(path) as t:
        header, events = t.header, list(t.events())
    a = ModelArgs.from_dict(header["model"])
    checkpoint_len = ModelArgs.load(checkpoint / "config.json").max_seq_len
    assert a.max_seq_len == LONG > checkpoint_len  # the header carries the effective length
    end = max(e.position for e in events if e.kind == "token") + 1  # positions the long request reached
    assert end == LONG
    assert end > 2 * a.window_size  # every ring wrapped
    for r in {r for r in a.compress_ratios if r}:
        assert end // r > a.index_topk  # more compressed entries than the top-k keeps
    per_block = a.candidate_block_size
    candidate_entries = end // a.compress_ratios[a.candidate_source_layer]
    assert cdiv(candidate_entries, per_block) > a.candidate_topk_blocks  # candidate selection binds
    # the pool came from the budget (4 GiB on CPU at most): capped at both requests at max_model_len
    assert llm.kv_pool is not None and header["engine"]["num_kv_blocks"] == 2 * cdiv(LONG, BLOCK_SIZE)
    assert llm.kv_pool.num_kv_blocks * llm.kv_pool.bytes_per_block + llm.kv_pool.state_bytes <= llm.kv_pool.budget


def test_the_long_run_checks_clean_against_the_reference(long_trace, checkpoint, capsys):
    path, _ = long_trace
    code = main(["check", str(path), "--against", "reference", "--model", str(checkpoint)])
    out = capsys.readouterr()
    assert code == 0, out.out[-2000:] + out.err
    assert "no divergence" in out.out, out.out[-2000:]


@pytest.mark.parametrize("value", [0, "long", 1 << 30])
def test_a_header_max_seq_len_that_cannot_be_rebuilt_is_one_sentence(long_trace, checkpoint, tmp_path, value):
    import msgpack
    from test_verify import read_log, write_log

    from tracing.execute import check_tokens
    from tracing.reader import TraceError

    header, events = read_log(long_trace[0])
    h = msgpack.unpackb(header, raw=False)
    h["model"]["max_seq_len"] = value
    edited = write_log(tmp_path / "edited.mdt", msgpack.packb(h, use_bin_type=True), events)
    with pytest.raises(TraceError, match=r"^the trace's header has max_seq_len .*, not a number of positions "
                                         r"between 1 and 2,097,152\.$"):
        check_tokens(open_trace(edited), model=str(checkpoint))


# ---- the KV budget --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["micro", "tiny-68m"])
def test_bytes_per_block_and_slot_are_the_allocated_tensors(name):
    a = preset(name)
    c = allocate_caches(a, 5, 3, torch.bfloat16, "meta")
    total = sum(t.numel() * t.element_size() for t in c.tensors())
    assert total == cache_bytes(a, 5, 3) == cache_bytes(a, 0, 0) + 5 * bytes_per_block(a) + 3 * bytes_per_slot(a)
    entries = sum(BLOCK_SIZE // a.compress_ratios[s] * (a.head_dim + a.index_head_dim) for s in a.kv_source_layers)
    assert bytes_per_block(a) == 2 * entries  # bf16 compressed KV and index keys, nothing else per block
    assert bytes_per_block(a, torch.float32) == 2 * bytes_per_block(a)


def test_a_budget_sizes_the_pool_within_it_and_caps_it_at_max_num_seqs_full_requests():
    a = preset("micro")
    per_block, slots = bytes_per_block(a), cache_bytes(a, 0, 4)
    budget = slots + 100 * per_block + per_block - 1
    pool = size_pool(a, torch.bfloat16, budget, "test", 4, 64, 4096)
    assert pool.num_kv_blocks == 100 and pool.bytes_per_block == per_block
    assert cache_bytes(a, pool.num_kv_blocks, 4) <= budget < cache_bytes(a, pool.num_kv_blocks + 1, 4)
    assert size_pool(a, torch.bfloat16, 1 << 40, "test", 4, 3, 4096).num_kv_blocks == 3 * 32  # the cap
    with pytest.raises(ValueError, match=r"holds 31 KV blocks .* fewer than the 32 one request of max_model_len "
                                         r"4,096 needs; lower max_model_len"):
        size_pool(a, torch.bfloat16, slots + 31 * per_block, "test", 4, 64, 4096)
    b, source = memory_budget(torch.device("cpu"), kv_cache_memory=12345)
    assert b == 12345 and "12,345" in source
    b, _ = memory_budget(torch.device("cpu"))
    assert 0 < b <= 4 << 30


def test_an_explicit_pool_and_an_explicit_max_model_len_reach_the_engine(checkpoint):
    from engine import LLM, SamplingParams

    llm = LLM(str(checkpoint), num_kv_blocks=3, max_model_len=5000, max_num_seqs=2)
    assert llm.kv_pool is None and llm.engine.config.num_kv_blocks == 3 and llm.max_model_len == 5000
    runner = llm.engine.runner
    assert isinstance(runner.model, PagedModel) and runner.model.weights.rope(1, "cpu").size(0) == 5000
    llm.engine.shutdown()
    llm = LLM(str(checkpoint), max_model_len=1000, max_num_seqs=2, kv_cache_memory=64 << 20)
    assert llm.engine.config.num_kv_blocks == 2 * 8 and llm.kv_pool.budget == 64 << 20
    with pytest.raises(ValueError, match=r"exceeds max_model_len 1000"):
        llm.engine.check_request([5] * 990, SamplingParams(max_tokens=11))
    llm.engine.shutdown()


@pytest.mark.parametrize("kw, sentence", [
    (dict(max_model_len=0), "max_model_len must be a whole number of at least 1, not 0."),
    (dict(max_model_len=1 << 30), "max_model_len must be at most 2,097,152 positions, not 1,073,741,824."),
    (dict(num_kv_blocks=0), "num_kv_blocks must be a whole number of at least 1, not 0."),
    (dict(kv_cache_memory=1000), "holds 0 KV blocks"),
    (dict(kv_cache_memory=1 << 30, num_kv_blocks=4), "num_kv_blocks fixes the KV pool, so kv_cache_memory has no "
                                                      "effect; drop one of the two."),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization must be a fraction above 0 and at most 1, not 1.5."),
])
def test_bad_engine_values_are_one_sentence(checkpoint, kw, sentence):
    from engine import LLM

    with pytest.raises(ValueError) as e:
        LLM(str(checkpoint), **kw)
    assert sentence in str(e.value) and str(e.value).count(". ") == 0 and str(e.value).endswith(".")


# ---- the command line ---------------------------------------------------------------------------------
@pytest.mark.parametrize("args, sentence", [
    (["--max-model-len", "0"], "argument --max-model-len: expected a number of positions between 1 and 2,097,152, "
                               "not '0'"),
    (["--max-model-len", "lots"], "argument --max-model-len: expected a number of positions"),
    (["--kv-cache-memory", "4XB"], "argument --kv-cache-memory: expected a size in bytes such as 4GiB"),
    (["--kv-cache-memory", "0"], "argument --kv-cache-memory: expected a size in bytes"),
    (["--gpu-memory-utilization", "0"], "argument --gpu-memory-utilization: expected a fraction above 0 and at "
                                        "most 1, not '0'"),
    (["--gpu-memory-utilization", "0.5"], "--gpu-memory-utilization sizes the KV pool on cuda; on cpu give "
                                          "--kv-cache-memory BYTES."),
    (["--num-kv-blocks", "8", "--kv-cache-memory", "1GiB"], "--num-kv-blocks fixes the KV pool, so "
                                                            "--kv-cache-memory has no effect; drop one of the two."),
    (["--kv-cache-memory", "1000", "--model", "micro"], "holds 0 KV blocks"),
])
@pytest.mark.parametrize("command", ["record", "generate"])
def test_bad_engine_options_are_one_sentence_exit_2(command, args, sentence, capsys, tmp_path):
    extra = ["-o", str(tmp_path / "x.mdt")] if command == "record" else []
    try:
        code = main([command, *extra, *args])
    except SystemExit as e:  # argparse's own exit, after its message
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and sentence in err and err.count("\n") == 1, err
    assert not (tmp_path / "x.mdt").exists()


@pytest.mark.parametrize("text, n", [("4GiB", 4 << 30), ("512MiB", 512 << 20), ("1.5G", 3 << 29), ("1000", 1000),
                                     ("2GB", 2 * 10**9), ("64k", 64 << 10)])
def test_kv_cache_memory_sizes(text, n):
    from tui.cli import _bytes
    assert _bytes(text) == n


def test_engine_options_reach_llm_keywords():
    """The reusable pair (`add_engine_options`, `engine_kwargs`): record's fixed default pool, the budget on
    request, and every option by LLM's keyword name."""
    import argparse

    from tui.cli import add_engine_options, engine_kwargs

    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    add_engine_options(p, max_num_seqs=8, num_kv_blocks=24)
    kw = engine_kwargs(p.parse_args([]))
    assert kw["num_kv_blocks"] == 24 and kw["max_model_len"] is None and kw["max_num_seqs"] == 8
    kw = engine_kwargs(p.parse_args(["--kv-cache-memory", "1GiB", "--max-model-len", "16384", "--no-zos"]))
    assert kw["num_kv_blocks"] is None and kw["kv_cache_memory"] == 1 << 30 and kw["max_model_len"] == 16384
    assert kw["enable_zos"] is False
    kw = engine_kwargs(p.parse_args(["--device", "cuda", "--gpu-memory-utilization", "0.5"]))
    assert kw["num_kv_blocks"] is None and kw["gpu_memory_utilization"] == 0.5
    q = argparse.ArgumentParser()
    add_engine_options(q)
    assert engine_kwargs(q.parse_args([]))["num_kv_blocks"] is None  # serve's and generate's: the budget
