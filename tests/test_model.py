"""The paged batched model against the plain reference (issue #2; ARCHITECTURE.md §6 rules).

Every test runs sequences through model/paged.py in some batching and chunking, then compares each
position's logits with the reference's single-shot forward of the whole sequence: choices first
(a near tie ends the comparison, a clear-gap difference fails), then logits within 0.05 (bf16).
Uses the `micro` and `stress` presets so that CI stays fast.
"""
from dataclasses import dataclass

import pytest
import torch

from model.checkpoint import init_weights
from model.config import BLOCK_SIZE, cdiv, preset
from model.paged import ForwardBatch, PagedModel
from model.reference import ReferenceModel
from model.transformer import Transformer
from tracing.compare import Choices, compare_rows, explain, first_rounding_flip, tolerance


@pytest.fixture(scope="module", params=["micro"])
def model(request):
    m = Transformer(preset(request.param))
    init_weights(m.named_parameters(), seed=0)
    return m


@pytest.fixture(scope="module")
def stress():
    m = Transformer(preset("stress"))
    init_weights(m.named_parameters(), seed=1)
    return m


@dataclass
class Row:
    logits: torch.Tensor
    choices: Choices
    row: int  # flattened [B, S] row in that step's capture


class Paged:
    """Drives PagedModel with explicit rows (seq, start, tokens); each sequence owns distinct blocks."""

    def __init__(self, model: Transformer, n_seqs: int, max_len: int = 1024):
        self.model, self.blocks_per_seq = model, cdiv(max_len, BLOCK_SIZE)
        self.paged = PagedModel(model, num_blocks=n_seqs * self.blocks_per_seq, num_slots=n_seqs)
        self.out: dict[int, dict[int, Row]] = {}

    def step(self, rows: list[tuple[int, int, torch.Tensor]]) -> None:
        S = max(len(t) for *_, t in rows)
        ids = torch.zeros(len(rows), S, dtype=torch.long)
        for i, (*_, t) in enumerate(rows):
            ids[i, :len(t)] = t
        tables = [[seq * self.blocks_per_seq + k for k in range(self.blocks_per_seq)] for seq, *_ in rows]
        dev = self.model.head.weight.device
        tensor = lambda x: torch.tensor(x, device=dev)  # noqa: E731
        batch = ForwardBatch(ids.to(dev), tensor([s for _, s, _ in rows]), tensor([len(t) for *_, t in rows]),
                             tensor(tables), tensor([seq for seq, *_ in rows]),
                             max(s + len(t) for _, s, t in rows), all(len(t) == 1 and s > 0 for _, s, t in rows))
        choices = Choices(self.model.args)
        hooks = choices.hooks(self.model)
        logits = self.paged.forward(batch, all_logits=True, capture=choices.capture)
        for h in hooks:
            h.remove()
        for b, (seq, start, t) in enumerate(rows):
            for i in range(len(t)):
                self.out.setdefault(seq, {})[start + i] = Row(logits[b, i].cpu(), choices, b * S + i)

    def compare(self, seq: int, tokens: torch.Tensor):
        """This sequence's recorded positions against the reference over `tokens`."""
        ref_choices = Choices(self.model.args)
        hooks = ref_choices.hooks(self.model)
        ref = ReferenceModel(self.model).forward(tokens, capture=ref_choices.capture).cpu()
        for h in hooks:
            h.remove()
        positions = sorted(self.out[seq])
        rows = [(ref_choices, p, self.out[seq][p].choices, self.out[seq][p].row) for p in positions]
        got = torch.stack([self.out[seq][p].logits for p in positions])
        return compare_rows(ref[positions], got, tolerance(self.model), lambda i: explain(*rows[i]),
                            lambda i: first_rounding_flip(rows[:i + 1]))


def prompts(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def assert_agrees(result, at_least: int):
    print(f"compared {result.compared} rows, max |diff| {result.max_diff:.3g}, first near tie: {result.near_tie}")
    assert result.ok, result.failures
    assert result.compared >= at_least, f"only {result.compared} rows compared before {result.near_tie}"


def test_one_batch_prefill_of_four_prompts_matches_reference(model):
    seqs = prompts([37, 130, 300, 520], model.args.vocab_size)
    run = Paged(model, 4)
    run.step([(i, 0, t) for i, t in enumerate(seqs)])
    for i, t in enumerate(seqs):
        assert_agrees(run.compare(i, t), at_least=min(len(t), 100))


@pytest.mark.parametrize("chunk", [128, 200, 37])
def test_chunked_prefill_matches_reference(model, chunk):
    """Chunks of 37 and 200 put ratio-2 groups and KV block boundaries across chunk boundaries."""
    (t,) = prompts([520], model.args.vocab_size, seed=chunk)
    run = Paged(model, 1)
    for s in range(0, len(t), chunk):
        run.step([(0, s, t[s:s + chunk])])
    assert_agrees(run.compare(0, t), at_least=100)


def test_prefill_then_decode_with_rows_at_different_positions(model):
    lengths = [37, 130, 255, 300]
    seqs = prompts([n + 40 for n in lengths], model.args.vocab_size, seed=7)
    run = Paged(model, 4)
    run.step([(i, 0, t[:n]) for i, (t, n) in enumerate(zip(seqs, lengths))])
    for k in range(40):  # teacher-forced decode: one batch, four positions
        run.step([(i, n + k, t[n + k:n + k + 1]) for i, (t, n) in enumerate(zip(seqs, lengths))])
    for i, t in enumerate(seqs):
        assert_agrees(run.compare(i, t), at_least=37)


def test_mixed_step_of_a_later_chunk_and_a_fresh_prompt(model):
    a, b = prompts([400, 150], model.args.vocab_size, seed=3)
    run = Paged(model, 2)
    run.step([(0, 0, a[:201])])
    run.step([(0, 201, a[201:]), (1, 0, b)])
    assert_agrees(run.compare(0, a), at_least=100)
    assert_agrees(run.compare(1, b), at_least=100)


def test_stress_window_wraps_many_times(stress):
    """Window 16: the ring wraps every 16 positions through a chunked prefill and 60 decode steps."""
    (t,) = prompts([197 + 60], stress.args.vocab_size, seed=5)
    run = Paged(stress, 1)
    for s in range(0, 197, 37):
        run.step([(0, s, t[s:min(s + 37, 197)])])
    for p in range(197, len(t)):
        run.step([(0, p, t[p:p + 1])])
    assert_agrees(run.compare(0, t), at_least=60)


def test_fp32_debug_mode_matches_reference_within_1e_3(model):
    """The fp32 debugging mode (activations fp32, quantisation sims on): chunked prefill and decode."""
    m = Transformer(preset("micro"))
    m.load_state_dict(model.state_dict())
    m.to_fp32()
    seqs = prompts([300, 137], m.args.vocab_size, seed=3)
    fp32, bf16 = (ReferenceModel(x).forward(seqs[1]) for x in (m, model))
    assert m.embed.weight.dtype == torch.float32 and not torch.equal(fp32, bf16), "fp32 mode must compute in fp32"
    run = Paged(m, 2)
    run.step([(0, 0, seqs[0][:200]), (1, 0, seqs[1][:97])])
    run.step([(0, 200, seqs[0][200:280]), (1, 97, seqs[1][97:120])])
    for k in range(17):
        run.step([(0, 280 + k, seqs[0][280 + k:281 + k]), (1, 120 + k, seqs[1][120 + k:121 + k])])
    for i, t in enumerate(seqs):
        result = run.compare(i, t)
        assert_agrees(result, at_least=100)
        assert result.max_diff <= 1e-3


def test_a_corrupted_state_slot_is_caught(model):
    """The comparison is not vacuous: damaging one layer's window ring after prefill must fail."""
    (t,) = prompts([120], model.args.vocab_size, seed=11)
    run = Paged(model, 1)
    run.step([(0, 0, t[:100])])
    run.paged.ring[0, 0] *= 1.5
    for p in range(100, 120):
        run.step([(0, p, t[p:p + 1])])
    result = run.compare(0, t)
    assert not result.ok and result.compared == 100, result


@pytest.fixture(scope="module")
def tiny():
    m = Transformer(preset("tiny-68m"))
    init_weights(m.named_parameters(), seed=0)
    return m


def test_tiny_68m_batch_of_four_prompts_then_decode(tiny):
    """The real tiny config (vocab 129280, window 128, top-k 64, 16 candidate blocks): one batch of
    four prompts from 37 to 520 tokens, then 8 decode steps with the rows at four positions."""
    lengths = [37, 130, 300, 520]
    seqs = prompts([n + 8 for n in lengths], tiny.args.vocab_size, seed=2)
    run = Paged(tiny, 4)
    run.step([(i, 0, t[:n]) for i, (t, n) in enumerate(zip(seqs, lengths))])
    for k in range(8):
        run.step([(i, n + k, t[n + k:n + k + 1]) for i, (t, n) in enumerate(zip(seqs, lengths))])
    for i, (t, n) in enumerate(zip(seqs, lengths)):
        assert_agrees(run.compare(i, t), at_least=min(n, 100))


def test_layer_by_layer_comparison_localises_a_changed_weight(model):
    """Teacher forcing (ARCHITECTURE.md §6, per module with identical inputs): a 1% change of one
    layer's shared expert shows in that layer only, and identical weights show nothing."""
    from tracing.compare import compare_layers

    changed = Transformer(preset("micro"))
    changed.load_state_dict(model.state_dict())
    (tokens,) = prompts([300], model.args.vocab_size, seed=1)
    same = compare_layers(ReferenceModel(model), ReferenceModel(changed), tokens, 1e-5)
    assert all(r.max_rel == 0 and not r.failures for r in same)
    with torch.no_grad():
        changed.layers[5].ffn.shared_experts.w2.weight.mul_(1.01)
    results = compare_layers(ReferenceModel(model), ReferenceModel(changed), tokens, 1e-5)
    assert [r.layer for r in results if r.failures] == [5]
