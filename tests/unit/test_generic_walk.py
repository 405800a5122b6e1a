"""Every *ForCausalLM of the installed transformers through the generic path at a tiny size, one engine step against
transformers' own loss and gradient norm (megatrain.checks.walk), and the published checkpoints' configs at the same
tiny widths with their switches as published. CPU: a few families and checkpoints in seconds; the walks over all of
them (marked slow) a few minutes each, printing the count and writing the families' table where
MEGATRAIN_GENERIC_WALK names a directory (scripts/walk_transformers.py [--published] writes results/generic/):
    pytest tests/unit/test_generic_walk.py -m slow -s"""

import json
import os
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from megatrain.checks.walk import (  # noqa: E402
    as_dicts,
    band_excess,
    causal_lm_types,
    curve_depth,
    curve_family,
    published_at_depth,
    tiny_published,
    try_family,
    try_published,
    walk,
)
from megatrain.models.published import Published, get_published, published  # noqa: E402

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
    # its layers take the encoder's states, positionally (None in a causal LM, which carries nothing since Gemma 4's
    # large checkpoints pass their absent per-layer input so); its decoder's forward adds learned positions the head
    # check cannot run apart from it
    refused = try_family("bart", types["bart"])
    assert refused.status == "refused" and "causal-LM forward reads more" in refused.detail


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


def test_the_band_lets_a_learnt_batch_wander_as_natives_own_runs_do_but_not_the_steps_before():
    """Gemma-4-E4B's published curve on the H200 (16315c0): the batch learnt by step 2, native's own run with its
    gradient sums in another order rose to 0.82 at step 3 where the first stayed at 1e-3, and the engine's rose at
    steps 3, 5 and 6 by as much: inside the suite's band. The same wandering at an unlearnt step leaves it."""
    native = [12.9901, 0.8125, 0.0044, 0.001, 0.0001, 0.0001, 0.0, 0.0]
    reordered = [12.9813, 0.6543, 0.0133, 0.825, 0.0147, 0.0001, 0.0001, 0.0002]
    engine = [12.9618, 0.8388, 0.0174, 0.9221, 0.0116, 0.2103, 0.4516, 0.0006]
    assert band_excess(native, reordered, engine) <= 0
    assert band_excess(native, reordered, [engine[0], 0.8388 * 2.5, *engine[2:]]) > 0  # step 1: 0.81 unlearnt


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


def test_a_published_config_keeps_its_switches_at_the_tiny_widths():
    """Gemma 4 as published: the 31B without per-layer inputs and with keys equal to values, the 26B with experts
    beside its MLP, the E2B with per-layer inputs and its last layers reusing earlier ones' keys and values; the depth
    holds a full-attention layer after Gemma's 5 sliding ones (Gemma 3's pattern built by its config class), Llama 4's
    NoPE layer (not its 48 MoE layer indices); longrope's factors are cut with the head."""
    dense = tiny_published(get_published("google/gemma-4-31B-it").config)
    assert (dense["hidden_size"], dense["hidden_size_per_layer_input"], dense["attention_k_eq_v"]) == (64, 0, True)
    assert dense["layer_types"][-1] == "full_attention" and dense["global_head_dim"] != dense["head_dim"]
    moe = tiny_published(get_published("google/gemma-4-26B-A4B-it").config)
    assert (moe["enable_moe_block"], moe["num_experts"], moe["top_k_experts"]) == (True, 4, 2)
    edge = tiny_published(get_published("google/gemma-4-E2B-it").config)
    assert edge["hidden_size_per_layer_input"] == 8 and 0 < edge["num_kv_shared_layers"] < edge["num_hidden_layers"]
    kinds_before_shared = edge["layer_types"][:edge["num_hidden_layers"] - edge["num_kv_shared_layers"]]
    assert set(kinds_before_shared) == {"sliding_attention", "full_attention"}
    assert tiny_published(get_published("google/gemma-3-1b-it").config)["num_hidden_layers"] == 6
    scout = tiny_published(get_published("meta-llama/Llama-4-Scout-17B-16E-Instruct").config)
    assert (scout["num_hidden_layers"], scout["no_rope_layers"]) == (4, [1, 1, 1, 0])
    mini = tiny_published(get_published("microsoft/Phi-4-mini-instruct").config)
    assert len(mini["rope_scaling"]["long_factor"]) == round(16 * mini["partial_rotary_factor"]) // 2
    wide = published_at_depth(get_published("google/gemma-4-31B-it").config)  # the GPU column's: widths as published
    assert (wide["hidden_size"], wide["num_hidden_layers"], wide["layer_types"][5]) == (5376, 6, "full_attention")


def test_the_gpu_columns_depth_counts_the_layer_kinds_transformers_gives_a_cut():
    """Gemma 4 makes a cut's last layer full: 2 layers of its 26B-A4B and 31B hold both kinds (the published
    pattern's first full layer is the sixth, which held 5.6B parameters of 26B-A4B, over the column's 5B, so it was
    skipped); its E-sizes share keys and values from later layers and keep published_depth's; Gemma 3 forces nothing."""
    from megatrain.checks.walk import CURVE_LEAST_LAYERS, published_depth

    depths = {h: curve_depth(get_published(h).config) for h in ("google/gemma-4-26B-A4B-it", "google/gemma-4-31B-it",
                                                                  "google/gemma-4-E2B-it", "google/gemma-3-27b-it")}
    assert depths == {"google/gemma-4-26B-A4B-it": 2, "google/gemma-4-31B-it": 2, "google/gemma-4-E2B-it": 10,
                      "google/gemma-3-27b-it": published_depth(get_published("google/gemma-3-27b-it").config,
                                                               CURVE_LEAST_LAYERS)}, depths
    assert depths["google/gemma-3-27b-it"] == 6


def test_published_checkpoints_train_at_the_tiny_widths():
    """Those that the walk could not build before: SmolLM3 (its class's token ids outside the tiny vocabulary),
    Hunyuan (no head width in its config.json nor a default in its class), Llama 4 Scout (NoPE and chunked layers,
    which the depth keeps), Falcon-H1 and Granite 4 (Mamba-2 heads cut to the tiny width without their inner width:
    Falcon-H1's own, Granite's twice the hidden size, which their config classes check)."""
    for hub_id in ("HuggingFaceTB/SmolLM3-3B", "tencent/Hunyuan-7B-Instruct",
                   "meta-llama/Llama-4-Scout-17B-16E-Instruct", "tiiuae/Falcon-H1-0.5B-Instruct",
                   "ibm-granite/granite-4.0-h-350m"):
        result = try_published(get_published(hub_id))
        assert result.status == "trains", result


def test_a_checkpoint_of_a_model_type_transformers_lacks_is_refused_naming_the_one_its_architecture_is():
    """Kimi K2's config.json says model_type kimi_k2, which transformers does not know, and DeepSeek-V3's class: the
    walk refuses it (it was unbuilt: its class defaults were read first) saying which model type that class is, and
    with that model type it trains."""
    row = get_published("moonshotai/Kimi-K2-Instruct")
    refused = try_published(row)
    assert refused.status == "refused" and "set model_type to 'deepseek_v3'" in refused.detail, refused
    as_v3 = Published(row.hub_id, row.source, json.dumps({**row.config, "model_type": "deepseek_v3"}))
    assert try_published(as_v3).status == "trains"


@pytest.mark.slow
def test_every_published_checkpoint_trains_or_is_refused():
    results = [try_published(row) for row in published()]
    for r in results:
        print(f"  {r.hub_id}: {r.status}: {r.detail[:120]}")
    assert len(results) >= 30
    assert {r.status for r in results} <= {"trains", "refused"}, [r for r in results if r.status not in
                                                                  ("trains", "refused")]


def test_curves_run_again_for_some_families_keep_the_others_and_name_their_own_machine():
    """scripts/walk_transformers.py --curves --only: one family's GPU curve again (Kimi-Linear's, after its tile fix)
    without walking the 89 again; its row carries the machine and commit it ran at, the others keep the record's."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("walk_script", root / "scripts" / "walk_transformers.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    old = {"env": {"commit": "a" * 40, "gpu": "H100", "device": "cuda", "torch": "2.11.0"}, "steps": 8,
           "families": [{"model_type": "llama", "causal_lm": "LlamaForCausalLM", "status": "tracks", "detail": "ok"},
                        {"model_type": "kimi_linear", "causal_lm": "KimiLinearForCausalLM", "status": "fails",
                         "detail": "RuntimeError: expected data_ptr to be aligned to 16 bytes"}]}
    env = {"commit": "b" * 40, "gpu": "NVIDIA H200", "device": "cuda", "torch": "2.11.0"}
    again = [{"model_type": "kimi_linear", "causal_lm": "KimiLinearForCausalLM", "status": "tracks", "detail": "fine"}]
    merged = script.merge_curves(old, again, env, ["kimi_linear", "llama"])
    assert merged["env"] == old["env"] and merged["steps"] == 8
    assert [c["model_type"] for c in merged["families"]] == ["kimi_linear", "llama"]
    assert merged["families"][0] == {**again[0], "env": env} and merged["families"][1] == old["families"][0]
    results = [script.FamilyResult(model_type=t, causal_lm=c, status="trains", detail="")
               for t, c in (("kimi_linear", "KimiLinearForCausalLM"), ("llama", "LlamaForCausalLM"))]
    table = script.markdown(results, "5.17.0", merged)
    assert "| kimi_linear | KimiLinearForCausalLM | tracks | fine (run again at bbbbbbb on NVIDIA H200) |" in table
    assert "| llama | LlamaForCausalLM | tracks | ok |" in table
    assert "commit aaaaaaa" in table and "2 tracks" in table


def test_the_published_gpu_column_goes_on_where_a_call_was_cut_and_only_runs_rows_again(tmp_path, monkeypatch):
    """scripts/walk_transformers.py --published --curves: each checkpoint's curve lands as it ends, naming its machine
    and commit; run again at the same commit it goes on past those (a device call's 10-minute limit cut it), with
    --only it runs those again beside the rest; without the CPU column of that transformers it exits 2."""
    import importlib.util
    import json
    from pathlib import Path

    import megatrain.bench.env

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("walk_script", root / "scripts" / "walk_transformers.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    stem = "published-transformers-5.17.0"
    env = {"commit": "c" * 40, "dirty": False, "gpu": "NVIDIA H200", "device": "cuda", "torch": "2.11.0"}
    monkeypatch.setattr(megatrain.bench.env, "environment", lambda: dict(env))
    with pytest.raises(SystemExit) as refused:
        script.walk_published("cuda", None, tmp_path, stem)
    assert refused.value.code == 2
    rows = [("google/gemma-3-1b-it", "gemma3_text", "trains"), ("Qwen/Qwen3-8B", "qwen3", "trains"),
            ("moonshotai/Kimi-K2-Instruct", "kimi_k2", "refused")]
    (tmp_path / f"{stem}.json").write_text(json.dumps(
        [{"hub_id": h, "model_type": t, "status": s, "detail": "", "walked": "here"} for h, t, s in rows]))
    ran, cuts = [], [1]

    class Cut(Exception):
        """The device call's limit, after the first checkpoint landed."""

    def curve_published(hub_id, device):
        if hub_id == "Qwen/Qwen3-8B" and cuts:
            raise Cut(cuts.pop())
        ran.append(hub_id)
        return {"hub_id": hub_id, "model_type": "m", "num_layers": 2, "status": "tracks", "detail": f"run {len(ran)}"}

    monkeypatch.setattr(script, "curve_published", curve_published)
    with pytest.raises(Cut):
        script.walk_published("cuda", None, tmp_path, stem)
    record = json.loads((tmp_path / f"{stem}-curves.json").read_text())
    assert [c["hub_id"] for c in record["checkpoints"]] == ["google/gemma-3-1b-it"]
    script.walk_published("cuda", None, tmp_path, stem)  # the next call: the rest only
    assert ran == ["google/gemma-3-1b-it", "Qwen/Qwen3-8B"]
    script.walk_published("cuda", ["google/gemma-3-1b-it"], tmp_path, stem)
    assert ran[2:] == ["google/gemma-3-1b-it"]
    record = json.loads((tmp_path / f"{stem}-curves.json").read_text())
    assert [(c["hub_id"], c["detail"]) for c in record["checkpoints"]] == [("google/gemma-3-1b-it", "run 3"),
                                                                           ("Qwen/Qwen3-8B", "run 2")]
    assert all(c["env"] == env for c in record["checkpoints"]) and "done_here" not in record
    env["commit"] = "d" * 40  # another commit: every row again
    script.walk_published("cuda", None, tmp_path, stem)
    assert ran[3:] == ["google/gemma-3-1b-it", "Qwen/Qwen3-8B"]
    table = (tmp_path / f"{stem}.md").read_text()
    assert "2 tracks" in table and "run 2 at NVIDIA H200, commit ddddddd, torch 2.11.0" in table
    assert "| moonshotai/Kimi-K2-Instruct | kimi_k2 | refused |  | " in table and "| not run |" in table
    # rows that name their code's digest: a later commit of records alone (the same digest) goes on past them
    record = json.loads((tmp_path / f"{stem}-curves.json").read_text())
    for c in record["checkpoints"]:
        c["env"]["code_sha256"] = "a" * 64
    record["checkpoints"] = record["checkpoints"][:1]
    (tmp_path / f"{stem}-curves.json").write_text(json.dumps(record))
    env.update(commit="e" * 40, code_sha256="a" * 64)
    script.walk_published("cuda", None, tmp_path, stem)
    assert ran[5:] == ["Qwen/Qwen3-8B"]
