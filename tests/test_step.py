"""The step record (engine/step.py) and the model runner's public entry points: one layout packs a batch and the
device reads the same columns back; `StepHandle.wait()` gives a typed `StepResult`; `ModelRunner.logits`
re-executes a batch with the inputs `execute` builds, so a checker sees the logits the step sampled from (within
the cross-shape tolerance: it computes every token's)."""
import numpy as np
import torch

from engine import step as layout
from engine.model_runner import ModelRunner, StepResult
from engine.step import COLUMNS, NCOL, ScheduledBatch, ScheduledRow, tables_digest
from model.config import preset
from model.load import load_model
from tracing.compare import TOL_BF16


def _rows():
    return [ScheduledRow(seq_id=3, epoch=1, start=0, token_ids=[5, 6, 7], block_table=[4], state_slot=2,
                         sample=True, seed=11, temperature=0.0, output_position=0),
            ScheduledRow(seq_id=4, epoch=0, start=0, token_ids=[8, 9], block_table=[0, 1], state_slot=0,
                         sample=False, seed=12, temperature=1.0, output_position=0)]


def test_pack_and_split_read_back_every_column_of_every_row():
    batch = ScheduledBatch(7, "prefill", _rows())
    ints = layout.pack(batch, S=3, nb=2, size=3, trash_block=9, trash_slot=5)
    assert ints.shape == (3, NCOL + 3 + 2) and ints.dtype == np.int64
    columns, ids, tables = layout.split(ints, 3)
    named = dict(zip(COLUMNS, columns.tolist()))
    assert named == {"remap": [0, 0, 0], "start": [0, 0, 1], "num_tokens": [3, 2, 1], "state_slot": [2, 0, 5],
                     "sample": [1, 0, 0], "seed": [11, 12, 0], "output_position": [0, 0, 0]}
    assert ids.tolist() == [[5, 6, 7], [8, 9, 0], [0, 0, 0]]       # 0 pads a short row and the padding row
    assert tables.tolist() == [[4, 9], [0, 1], [9, 9]]             # the trash block pads a table
    assert ints[2].tolist() == layout.padding_row(3, 2, 9, 5)


def test_an_in_flight_input_is_marked_for_remap():
    row = ScheduledRow(3, 1, 40, [None], [4], 2, True, 11, 0.0, 5)
    columns, ids, _ = layout.split(layout.pack(ScheduledBatch(8, "decode", [row]), 1, 1, 1, 9, 5), 1)
    assert dict(zip(COLUMNS, columns[:, 0].tolist()))["remap"] == 1 and ids.tolist() == [[0]]


def test_tables_digest_ignores_row_order_and_sees_every_field():
    rows = [(3, 1, 2, [4]), (4, 0, 0, [0, 1])]
    assert tables_digest(rows) == tables_digest(rows[::-1])
    assert tables_digest(rows) != tables_digest([(3, 1, 2, [4]), (4, 0, 0, [0, 2])])


def test_step_result_is_typed_and_logits_reexecute_the_sampled_step(checkpoint):
    weights, _ = load_model(str(checkpoint))
    assert weights.args.vocab_size == preset("micro").vocab_size
    batch = ScheduledBatch(0, "prefill", _rows())
    runner = ModelRunner(weights, num_kv_blocks=8, num_state_slots=4)
    try:
        result = runner.execute(batch).wait()
        sampled = runner.last_logits  # [B, vocab]: the last token of each row, what the sampler drew from
    finally:
        runner.shutdown()
    assert isinstance(result, StepResult) and result.tokens[1] is None  # row 1 does not sample
    assert result.tokens[0] == int(sampled[0].argmax())                # temperature 0: greedy
    start, end = result.device_span
    assert 0 < start <= end
    again = ModelRunner(weights, num_kv_blocks=8, num_state_slots=4)  # fresh KV and state: the same step again
    try:
        logits = again.logits(batch)  # [B, S, vocab], every token
    finally:
        again.shutdown()
    assert logits.shape[:2] == (2, 3)
    last = torch.stack([logits[0, 2], logits[1, 1]])  # each row's last real token
    # all tokens through the head is another GEMM shape than the last ones: bits may differ (ARCHITECTURE.md §6)
    assert (last - sampled).abs().max() <= TOL_BF16 and torch.equal(last.argmax(-1), sampled.argmax(-1))
