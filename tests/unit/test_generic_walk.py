"""Every *ForCausalLM of the installed transformers through the generic path at a tiny size, one engine step against
transformers' own loss and gradient norm (megatrain.checks.walk). CPU: the two families in seconds; the walk
over all of them (marked slow) a few minutes, printing the count and writing its table where
MEGATRAIN_GENERIC_WALK names a directory (scripts/walk_transformers.py writes results/generic/):
    pytest tests/unit/test_generic_walk.py -m slow -s"""

import os
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from megatrain.checks.walk import as_dicts, band_excess, causal_lm_types, curve_family, try_family, walk  # noqa: E402

# the families of issue 44's done-when, and issue 59's (per-layer inputs): the walk must find each trains
MUST_TRAIN = ("gemma3_text", "mixtral", "phi3", "deepseek_v3", "qwen3_next", "llama4_text", "glm4_moe", "olmo2",
              "granite", "gemma4_text", "gemma4_unified_text")


def test_a_family_trains_and_one_that_reads_another_layers_state_is_refused():
    types = causal_lm_types()
    assert try_family("olmo2", types["olmo2"]).status == "trains"
    assert try_family("gemma4_text", types["gemma4_text"]).status == "trains"  # its per-layer inputs cross layers
    # in train mode: Seed-OSS's class defaults draw attention and residual dropout, equal to transformers' own
    drawn = try_family("seed_oss", types["seed_oss"])
    assert drawn.status == "trains" and "attention_dropout=0.1, residual_dropout=0.1" in drawn.detail
    refused = try_family("bart", types["bart"])  # its layers take the encoder's states, positionally
    assert refused.status == "refused" and "positional inputs" in refused.detail


def test_the_walks_bf16_curve_tracks_transformers_and_its_band_sees_a_wrong_one():
    """The walk's GPU column (scripts/walk_transformers.py --curves cuda), here on the CPU: a family with its dropout
    drawn tracks transformers' own bf16 run; a curve 3% off native's, or one gone non-finite, leaves the band."""
    curve = curve_family("seed_oss", causal_lm_types()["seed_oss"], "cpu")
    assert curve["status"] == "tracks", curve
    native = curve["native_losses"]  # the spread: native's reordering of the model without its dropout
    reordered = [n + r - q for n, r, q in zip(native, curve["native_reordered_losses"], curve["native_undrawn_losses"],
                                              strict=True)]
    assert band_excess(native, reordered, curve["losses"]) == curve["max_excess_over_band"] <= 0
    assert band_excess(native, reordered, [x * 1.03 for x in native]) > 0
    assert band_excess(native, reordered, native[:-1] + [float("nan")]) == float("inf")


@pytest.mark.slow
def test_every_transformers_decoder_through_the_generic_path():
    results = walk()
    by_type = {r.model_type: r for r in results}
    trains = sum(r.status == "trains" for r in results)
    print(f"\n{trains} of {len(results)} text decoders of transformers {transformers.__version__} train")
    for r in results:
        if r.status != "trains":
            print(f"  {r.model_type}: {r.status}: {r.detail[:120]}")
    if out := os.environ.get("MEGATRAIN_GENERIC_WALK"):
        import json

        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"transformers-{transformers.__version__}.json").write_text(json.dumps(as_dicts(results)))
    assert {t: by_type[t].status for t in MUST_TRAIN} == dict.fromkeys(MUST_TRAIN, "trains")
    assert not [r for r in results if r.status == "differs"], "a family that runs must compute transformers' loss"


def test_a_layer_buffer_meets_the_compute_dtype_in_bf16():
    """MiniMax's lightning attention multiplies bf16 activations by its decay buffers: the engine kept them fp32
    (a matmul of fp32 and bf16 raised), where transformers' bf16 model holds them in bf16; DeepSeek-V3's router
    correction, which transformers keeps in fp32, beside it."""
    types = causal_lm_types()
    for family in ("minimax", "deepseek_v3"):
        curve = curve_family(family, types[family], "cpu")
        assert curve["status"] == "tracks", curve
