"""ModelArgs: the presets, the spec §1.3 constraints (one clear sentence each), and the JSON round trip."""
import dataclasses

import pytest
import torch

from model.config import ConfigError, ModelArgs, preset
from model.transformer import Transformer


def test_tiny_68m_has_the_spec_parameter_count():
    with torch.device("meta"):
        model = Transformer(preset("tiny-68m"))
    assert sum(p.numel() for p in model.parameters()) == 68_297_760


@pytest.mark.parametrize("name", ["micro", "stress"])
def test_small_presets_keep_the_tiny_layer_roles(name):
    tiny, small = preset("tiny-68m"), preset(name)
    for field in ("compress_ratios", "kv_source_layers", "index_source_layers", "candidate_source_layer",
                  "engram_layer_ids", "hc_mult"):
        assert getattr(small, field) == getattr(tiny, field)
    assert small.vocab_size < tiny.vocab_size and (name != "stress" or small.window_size == 16)


@pytest.mark.parametrize("change,words", [
    (dict(kv_source_layers=(2, 4, 6, 7)), "kv source layer must also be an index source"),
    (dict(candidate_source_layer=7), "candidate source layer must be an index source"),
    (dict(compress_ratios=(0, 0, 1, 2, 2, 2, 1, 1, 1, 1, 1, 1)), "share its compress ratio"),
    (dict(kv_source_layers=(4, 6), index_source_layers=(4, 6, 8, 10)), "first compressed layer must be a kv source"),
    (dict(candidate_topk_blocks=4), "candidate_topk_blocks"),
    (dict(compress_ratios=(0, 0, 2)), "compress_ratios has 3 entries"),
    (dict(head_dim=100), "multiples of 32"),
    (dict(n_mtp_layers=1), "out of scope"),
])
def test_each_constraint_is_one_clear_sentence(change, words):
    args = dataclasses.replace(preset("tiny-68m"), **change)
    with pytest.raises(ConfigError) as e:
        args.check()
    message = str(e.value)
    assert words in message and message.count(". ") == 0 and message.endswith(".")


def test_json_round_trip_and_unknown_fields(tmp_path):
    args = preset("micro")
    args.save(tmp_path / "config.json")
    assert ModelArgs.load(tmp_path / "config.json") == args
    (tmp_path / "bad.json").write_text('{"dim": 64, "no_such_field": 1}')
    with pytest.raises(ConfigError, match="unknown field"):
        ModelArgs.load(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="unknown model preset"):
        preset("huge")
