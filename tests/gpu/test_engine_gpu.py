"""Streaming engine vs native on the GPU in bf16 (loss curves). Needs CUDA: pytest tests/gpu -m gpu"""

import pytest
import torch

from megatrain.bench.case import run_case
from megatrain.config import CaseConfig

pytestmark = pytest.mark.gpu


def _losses(system, precision, model="qwen2.5-0.5b", steps=20, options=None):
    case = CaseConfig(system=system, model=model, batch=4, micro_batch=2, seq=256, steps=steps, device="cuda",
                      dtype="bfloat16", precision=precision, seed=0, options=options or {})
    record = run_case(case)
    assert record["status"] == "ok", record.get("error")
    return torch.tensor(record["losses"])


@pytest.mark.parametrize("precision,options", [("mixed", {}), ("bf16", {}),
                                               ("mixed", {"resident_embedding": True, "resident_layers": 4})],
                         ids=["mixed", "bf16", "mixed-resident-embedding-and-4-layers"])
def test_bf16_loss_curve_matches_native(precision, options):
    ref = _losses("native", precision)
    ours = _losses("megatrain", precision, options=options)
    rel = ((ours - ref).abs() / ref.abs()).max().item()
    print(f"{precision} {options}: max per-step relative loss difference {rel:.2e}")
    assert rel < 2e-2
    assert ours[-1] < ours[0]  # it trains


def test_tiny_fp32_on_gpu_matches_native_tightly():
    ref = _losses("native", "mixed", model="tiny", steps=10)
    case = CaseConfig(system="megatrain", model="tiny", batch=4, micro_batch=2, seq=256, steps=10, device="cuda",
                      dtype="float32", seed=0)
    ours = torch.tensor(run_case(case)["losses"])
    ref32 = torch.tensor(run_case(CaseConfig(system="native", model="tiny", batch=4, micro_batch=2, seq=256, steps=10,
                                             device="cuda", dtype="float32", seed=0))["losses"])
    torch.testing.assert_close(ours, ref32, rtol=1e-4, atol=0)
    assert ref.shape == ours.shape
