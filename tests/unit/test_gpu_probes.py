"""The scripts that probe the engine on the GPU, held on the CPU: what they measure, and that they see it."""

import importlib.util
from pathlib import Path

from engine_helpers import rerouting

ROOT = Path(__file__).resolve().parents[2]


def test_recompute_consistency_sees_a_recompute_that_routes_otherwise(monkeypatch):
    """scripts/recompute_consistency.py (the GPU probe of GPT-OSS's curve offset: does the engine's recompute part from
    its forward?) on the CPU: the engine's forward and recompute of the tiny GPT-OSS are one computation here; a
    recompute free to route anew that sends three tokens to other experts is counted as such, and the engine's, which
    replays the forward's routing, is not moved by it."""
    path = ROOT / "scripts" / "recompute_consistency.py"
    spec = importlib.util.spec_from_file_location("recompute_consistency", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    same = probe.measure("tiny-gpt-oss", 2, 2, 64, "float32", "cpu", compiled=False)["per_layer"]
    assert [(r["tokens_differing"], r["tokens_rerouted"], r["replayed_tokens_differing"]) for r in same] == \
        [(0, 0, 0), (0, 0, 0)]

    from megatrain.models.handwritten import moe

    monkeypatch.setattr(moe, "route", rerouting(moe.route))  # three tokens sent to other experts
    [first, _] = probe.measure("tiny-gpt-oss", 2, 2, 64, "float32", "cpu", compiled=False)["per_layer"]
    assert first["tokens_rerouted"] == 3 and first["tokens_differing"] >= 3
    assert first["replayed_tokens_rerouted"] == 0 and first["replayed_tokens_differing"] == 0


def test_recompute_consistency_measures_transformers_own_mixtures_of_experts_without_routing():
    """A mixture of experts through transformers' own modules (the generic program) reports no routing beside its
    output: the probe compares its forward and recompute as a dense layer's, and counts no rerouting it cannot see."""
    path = ROOT / "scripts" / "recompute_consistency.py"
    spec = importlib.util.spec_from_file_location("recompute_consistency", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    rows = probe.measure("tiny-hf-deepseek-v3", 2, 1, 16, "float32", "cpu", compiled=False)["per_layer"]
    assert [(r["tokens"], r["tokens_differing"]) for r in rows] == [(16, 0), (16, 0)]
    assert not any("tokens_rerouted" in r for r in rows)
