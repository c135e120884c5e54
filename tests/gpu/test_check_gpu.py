"""`mdi-trace check` on a trace recorded on the GPU (issue #6 items 1 and 5): the recording re-executes to
identical tokens on the same device, an unbroken run shows no divergence from the reference on CUDA, and a
planted fault is found at its step and module on CUDA as on the CPU (tests/test_planted_faults.py)."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from test_planted_faults import FAULTS, record  # noqa: E402

from tracing.divergence import check_against_reference  # noqa: E402
from tracing.execute import check_tokens  # noqa: E402
from tracing.verify import verify  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_a_cuda_run_checks_clean_against_itself_and_the_reference(checkpoint, tmp_path):  # conftest's micro
    trace = record(checkpoint, tmp_path / "run.mdt", device="cuda")
    assert verify(trace) == []
    r = check_tokens(trace, device="cuda")
    assert r.mismatch is None and r.same_platform and r.tokens > 20
    a = check_against_reference(trace, device="cuda")
    assert a.divergence is None and a.rows > 100, a.divergence


@pytest.mark.parametrize("fault", ["window ring one position off after a wrap", "Engram history not reset for a new owner"])
def test_a_planted_fault_is_found_on_cuda(checkpoint, tmp_path, monkeypatch, fault):
    plant, first_step, modules = FAULTS[fault]
    with monkeypatch.context() as m:
        plant(m)
        trace = record(checkpoint, tmp_path / "broken.mdt", device="cuda")
        d = check_against_reference(trace, device="cuda").divergence
    assert d is not None and d.step == first_step(trace), d
    assert d.module is not None and d.module.module in modules, d.module
