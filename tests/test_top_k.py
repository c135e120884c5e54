"""The index top-k's selection rule (model/attention.py `_top`, spec §7.4-2): the k largest scores of a row,
equal scores to the lower index, exactly the set a stable descending sort's first k gives, with its
temporaries bounded whatever the rows times entries (a 1M-entry context's prefill chunk)."""
import pytest
import torch

import model.attention as attention


def by_stable_sort(scores: torch.Tensor, k: int) -> torch.Tensor:
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k].sort(-1).values


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kept_set_is_a_stable_sort_s_first_k_under_every_kind_of_tie(dtype, monkeypatch):
    g = torch.Generator().manual_seed(0)
    for trial in range(150):
        E = int(torch.randint(1, 200, (1,), generator=g))
        k = int(torch.randint(1, E + 1, (1,), generator=g))
        # few distinct values, so most rows are all ties; -inf (masked), -0.0 beside +0.0, +inf (a forced block)
        s = torch.randint(-3, 4, (2, 4, E), generator=g).float() / 2
        for value, share in ((-torch.inf, 0.2), (-0.0, 0.1), (torch.inf, 0.05)):
            s[torch.rand(s.shape, generator=g) < share] = value
        if trial % 4 == 0:
            s = s * 1e-40  # subnormal fp32 (flushed in bf16: all ties)
        monkeypatch.setattr(attention, "_TOP_ELEMENTS", int(torch.randint(1, 3 * E, (1,), generator=g)))
        s = s.to(dtype)
        assert torch.equal(attention._top(s, k).sort(-1).values, by_stable_sort(s, k)), (trial, E, k)


def test_a_selection_keys_at_most_its_budget_of_scores_at_once(monkeypatch):
    seen = []
    topk = torch.Tensor.topk
    monkeypatch.setattr(torch.Tensor, "topk", lambda t, *a, **kw: seen.append(t.numel()) or topk(t, *a, **kw))
    monkeypatch.setattr(attention, "_TOP_ELEMENTS", 1000)
    scores = torch.randn(3, 50, 300)
    got = attention._top(scores, 7)
    assert max(seen) <= 1000 and sum(seen) == scores.numel()  # 3 rows of 300 per slice
    assert torch.equal(got.sort(-1).values, by_stable_sort(scores, 7))  # a sort: no topk call
    monkeypatch.setattr(attention, "_TOP_ELEMENTS", 10)  # below one row: a row at a time
    seen.clear()
    attention._top(scores, 7)
    assert set(seen) == {300}


def test_no_rows_select_nothing():
    assert attention._top(torch.empty(2, 0, 9), 3).shape == (2, 0, 3)
