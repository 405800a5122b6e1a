"""The scripts that probe the engine on the GPU, held on the CPU: what they measure, and that they see it."""

import importlib.util
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_recompute_consistency_sees_a_recompute_that_routes_otherwise(monkeypatch):
    """scripts/recompute_consistency.py (the GPU probe of GPT-OSS's curve offset: does the engine's recompute part from
    its forward?) on the CPU: the engine's forward and recompute of the tiny GPT-OSS are one computation here, and a
    recompute that sends some tokens elsewhere (stood in for by moving them) is counted as such."""
    path = ROOT / "scripts" / "recompute_consistency.py"
    spec = importlib.util.spec_from_file_location("recompute_consistency", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    same = probe.measure("tiny-gpt-oss", 2, 2, 64, "float32", "cpu", compiled=False)["per_layer"]
    assert [(r["tokens_differing"], r["routed_assignments_differing"]) for r in same] == [(0, 0), (0, 0)]

    from megatrain.engine.programs.handwritten import HandWrittenProgram
    layer = HandWrittenProgram.layer

    def rerouted(self, unit, params, x, context):
        y = layer(self, unit, params, x, context)
        if not torch.is_grad_enabled():
            return y
        hidden, routed, probs = y
        moved = hidden.clone()
        moved[0, :3] += hidden[0, :3].abs().amax(-1, keepdim=True)  # three tokens' outputs moved by their own scale
        return moved, routed.roll(1), probs

    monkeypatch.setattr(HandWrittenProgram, "layer", rerouted)
    [first, _] = probe.measure("tiny-gpt-oss", 2, 2, 64, "float32", "cpu", compiled=False)["per_layer"]
    assert first["tokens_moved"] == 3 and first["routed_assignments_differing"] > 0
