"""The performance model's schedule replay on made-up ingredients, and its check against the committed records; the
model of DeepSpeed's step on made-up ingredients, against the committed DeepSpeed records, and on the paper's GH200.
CPU, seconds: pytest tests/unit/test_perf_model.py"""

import csv
import json

import pytest

from megatrain.config import CaseConfig
from megatrain.engine.layout import build_units
from megatrain.engine.uses import use_order
from megatrain.optim.config import OptimConfig
from megatrain.perf_model import deepspeed, deepspeed_check, deepspeed_projection, model_check
from megatrain.perf_model.model import Ingredients, Machine, Model, simulate

MODEL = "qwen2.5-1.5b"


def _ingredients(fwd_ms=10.0, bwd_ms=30.0, head_ms=20.0) -> Ingredients:
    """Round numbers: layer and head times proportional to tokens (at 8192 tokens), attention at seq 1024 and
    4096 growing as seq^2."""
    layers = [{"model": MODEL, "tokens": t, "compiled": c, "fwd_ms": fwd_ms * t / 8192, "bwd_ms": bwd_ms * t / 8192}
              for t in (8192, 32768) for c in (False, True)]
    heads = [{"model": MODEL, "tokens": t, "ms": head_ms * t / 8192} for t in (8192, 32768)]
    attention = [{"model": MODEL, "seq": s, "fwd_ms": (s / 4096) ** 2, "fwd_bwd_ms": 3 * (s / 4096) ** 2}
                 for s in (1024, 4096, 16384)]
    machine = {"gpu_name": "NVIDIA H200", "h2d_gbs": 50.0, "d2h_gbs": 50.0, "both_gbs": 80.0,
               "gemm_bf16_tflops": 1e9, "cpu_adamw_gparams_s": 4.0, "cpu_cores": 16}
    return Ingredients("test", {"machine": machine, "layers": layers, "heads": heads, "attention": attention,
                                "host_adamw_gparams_s": {"bf16": 4.0, "mixed": 3.0},
                                "gpu_adamw_gparams_s": {"bf16": 100.0, "mixed": 100.0}})


def _run(ing, plan=None, **case):
    c = CaseConfig(system="megatrain", model=MODEL, batch=8, seq=1024, device="cuda", dtype="bfloat16",
                   compile=True, **case)
    plan = {"resident_units": [], "offloaded_layers": 0, "recomputed_inputs": 0, **(plan or {})}
    return simulate(c, plan, Model(ing, Machine.from_probe(ing, None, "test")))


def test_compute_bound_step_is_its_compute():
    ing = _ingredients(fwd_ms=100.0, bwd_ms=300.0, head_ms=50.0)
    out = _run(ing)
    layers = 28
    assert out["compute_s"] == pytest.approx(layers * 0.4 + 0.05)
    # only the first layer's load (before any compute) and the last gradients' offload are exposed
    assert 0 < out["exposed_s"] < 0.02 * out["step_s"]


def test_one_weight_slot_exposes_every_load():
    """weight_slots=1 (the double-buffering ablation): each load waits for the use before it, so the step is its
    compute plus every load at the link's rate (each way alone in forward, shared with the gradients in backward)."""
    ing = _ingredients(fwd_ms=100.0, bwd_ms=300.0, head_ms=50.0)
    two, one = _run(ing), _run(ing, options={"weight_slots": 1})
    units = build_units(CaseConfig(model=MODEL).shape())
    # bf16 bytes of every load but the first, which waits for nothing but the embedding either way
    loaded = sum(units[u].numel for u, _, _, load in use_order(28, slots=1)[1:] if load) * 2
    assert one["compute_s"] == pytest.approx(two["compute_s"])
    assert loaded / 50e9 < one["exposed_s"] < two["exposed_s"] + loaded / 40e9


def test_small_batch_waits_for_the_host_optimizer():
    ing = _ingredients(fwd_ms=0.01, bwd_ms=0.03, head_ms=0.01)
    out = _run(ing, precision="mixed")
    n = sum(u.numel for u in build_units(CaseConfig(model=MODEL).shape()))
    # the forward cannot finish before the previous step's update of every unit up to the head has landed
    assert out["step_s"] >= out["host_opt_s"] * 0.95
    assert out["host_opt_s"] == pytest.approx(n / 3e9)


def test_a_delayed_update_waits_for_nothing_until_the_steps_end_at_its_shared_rate():
    from megatrain.perf_model.model import DELAYED_HOST_RATE

    # an update longer than the step's compute: exact, the forward waits on it unit by unit; delayed, the step runs
    # without waiting and then waits for the whole update, run at its rate beside the step's copies
    ing = _ingredients(fwd_ms=5.0, bwd_ms=15.0, head_ms=10.0)
    exact = _run(ing, precision="mixed")
    delayed = _run(ing, precision="mixed", options={"update_delay": 1})
    assert delayed["step_s"] == pytest.approx(exact["host_opt_s"] / DELAYED_HOST_RATE)
    assert exact["step_s"] > exact["host_opt_s"]
    # an update shorter than the step hides whole, delayed: the step is the exact one's without its waits
    quick = _ingredients(fwd_ms=100.0, bwd_ms=300.0, head_ms=50.0)
    hidden = _run(quick, precision="mixed", options={"update_delay": 1})
    assert hidden["step_s"] <= _run(quick, precision="mixed")["step_s"]
    assert hidden["step_s"] > hidden["host_opt_s"] / DELAYED_HOST_RATE


def test_transfer_bound_step_is_the_link():
    ing = _ingredients(fwd_ms=0.001, bwd_ms=0.001, head_ms=0.001)
    ing.data["host_adamw_gparams_s"] = {"bf16": 1e6, "mixed": 1e6}
    out = _run(ing)
    units = build_units(CaseConfig(model=MODEL).shape())
    weights = 2 * (sum(u.numel for u in units) + sum(u.numel for u in units[1:-1]))  # forward, backward loads
    assert out["step_s"] > weights / 80e9 * 0.8


def test_resident_units_move_nothing_and_update_on_the_gpu():
    ing = _ingredients(fwd_ms=0.001, bwd_ms=0.001, head_ms=0.001)
    units = build_units(CaseConfig(model=MODEL).shape())
    every = [u.index for u in units[:-1]]
    out = _run(ing, {"resident_units": every})
    assert out["resident_opt_s"] == pytest.approx(sum(u.numel for u in units[:-1]) / 100e9)
    streamed = _run(ing)
    assert out["step_s"] < streamed["step_s"] / 5


def test_gpu_updated_units_leave_the_host_update_and_pay_their_state_across_pcie():
    """The what-if of issue 29: a streamed unit updated on the GPU costs no host time but its optimizer state
    crosses the link both ways; the same unit resident costs neither."""
    ing = _ingredients(fwd_ms=0.01, bwd_ms=0.03, head_ms=0.01)
    units = build_units(CaseConfig(model=MODEL).shape())
    embedding = units[0].numel
    streamed = _run(ing, precision="mixed")
    gpu = _run(ing, {"gpu_updated_units": [0]}, precision="mixed")
    resident = _run(ing, {"resident_units": [0]}, precision="mixed")
    assert gpu["host_opt_s"] == pytest.approx(streamed["host_opt_s"] - embedding / 3e9)
    assert gpu["resident_opt_s"] == resident["resident_opt_s"] == pytest.approx(embedding / 100e9)
    assert gpu["step_s"] > resident["step_s"]
    # transfer-bound: mixed precision's fp32 master and moments in (12 B) and out with the bf16 weights (14 B)
    ing.data["host_adamw_gparams_s"] = {"bf16": 1e6, "mixed": 1e6}
    gpu, resident = (_run(ing, plan, precision="mixed") for plan in ({"gpu_updated_units": [0]},
                                                                    {"resident_units": [0]}))
    assert gpu["step_s"] > 1.2 * resident["step_s"]  # 26 B/param across the link, much of it not hidden


def test_recomputed_inputs_add_layer_forwards():
    ing = _ingredients()
    base, recomputed = _run(ing), _run(ing, {"recomputed_inputs": 4})
    assert recomputed["compute_s"] - base["compute_s"] == pytest.approx(4 * base["layer_fwd_s"])


def test_long_rows_add_attention_and_a_chunked_mlp_adds_its_recompute():
    ing = _ingredients()
    short = ing.layer_s(CaseConfig(model=MODEL).shape(), 16384, 1024, True)
    long = ing.layer_s(CaseConfig(model=MODEL).shape(), 16384, 16384, True)
    # one 16k row: its attention (16, 48 ms), less the 16 rows of 1024 scaled from the 4096 point (1/16 ms each)
    assert long[0] - short[0] == pytest.approx(16.0e-3 - 16 * (1 / 16) * 1e-3)
    assert long[1] - short[1] == pytest.approx(48.0e-3 - 16 * (3 / 16) * 1e-3)
    cfg = CaseConfig(model=MODEL).shape()
    chunked = ing.layer_s(cfg, 16384, 1024, True, mlp_chunk_tokens=4096)
    mlp_share = 3 * cfg.hidden_size * cfg.intermediate_size / (
        (cfg.matmul_params() - cfg.vocab_size * cfg.hidden_size) / cfg.num_layers)
    assert chunked[1] - short[1] == pytest.approx(short[0] * mlp_share)


def test_missing_shape_says_what_to_measure():
    with pytest.raises(KeyError, match="run megatrain.perf_model.ingredients"):
        _ingredients().layer_s(CaseConfig(model="qwen2.5-7b").shape(), 8192, 1024, True)


def test_committed_validation_meets_the_median_target(tmp_path):
    """The model against every committed engine record on a GPU gives the committed validation
    (results/perf_model/validation.json), and its median absolute error meets the issue's target, 10%."""
    summary = model_check.validate(tmp_path)
    committed = json.loads((model_check.RESULTS / "perf_model" / "validation.json").read_text())
    assert summary["cases"] == committed["cases"] >= 40
    assert summary["median_abs_error_pct"] == pytest.approx(committed["median_abs_error_pct"])
    assert summary["median_abs_error_pct"] <= 10


def test_committed_projections_reproduce_and_count_a_mixture_by_its_active_parameters(tmp_path):
    """The committed paper projections (results/perf_model/projections.csv) are what the model gives from the
    committed ingredients; the paper's 120B is GPT-OSS-120B there, its TFLOPS from the parameters a token uses and the
    all-experts count beside it (~20x: 116.8B of which 5.7B a token uses)."""
    model_check.project(tmp_path)
    ours = (tmp_path / "projections.csv").read_text()
    assert ours == (model_check.RESULTS / "perf_model" / "projections.csv").read_text()
    row = next(r for r in csv.DictReader(ours.splitlines()) if r["model"] == "gpt-oss-120b")
    assert row["fits"] == "True" and "dense-120b" not in ours
    ratio = float(row["projected_tflops_all_experts"]) / float(row["projected_tflops"])
    assert ratio == pytest.approx(float(row["params_b"]) / float(row["active_params_b"]))
    assert 15 < ratio < 25


# DeepSpeed's step (megatrain.perf_model.deepspeed): round host rates, so a hand computation is short
HOST = deepspeed.HostStep(adam_gparams_s=2.0, update_gbs=100.0, copy_gbs=50.0)


def _ds(ing, link_gbs=None, compiled_layers=None, host_call_s=0.0, **case):
    case = {"compile": False, "dtype": "bfloat16", "precision": "mixed", **case}
    c = CaseConfig(system="deepspeed", model=MODEL, batch=8, seq=1024, device="cuda", **case)
    machine = Machine.from_probe(ing, None, "test")
    if link_gbs:
        machine.h2d_gbs = machine.d2h_gbs = link_gbs
        machine.both_gbs = 2 * link_gbs
    return deepspeed.step(c, Model(ing, machine), HOST, compiled_layers, host_call_s)


def _units():
    return build_units(CaseConfig(model=MODEL).shape())


def test_deepspeed_host_step_is_clip_adam_and_cast_at_their_rates():
    n = sum(u.numel for u in _units())
    out = _ds(_ingredients(), link_gbs=1e6)
    assert out["clip_s"] == pytest.approx(n * 8 / 100e9)  # the fp32 gradient read and written
    assert out["adam_s"] == pytest.approx(n / 2e9)
    assert out["cast_s"] == pytest.approx(n * 6 / 50e9)  # fp32 master read, bf16 written


def test_deepspeed_compute_bound_step_is_its_compute_then_the_host_step():
    """A link too fast to matter: the step is the layers' forward and recompute + backward, the head, and the host
    step after them, none of it overlapped."""
    out = _ds(_ingredients(fwd_ms=100.0, bwd_ms=300.0, head_ms=50.0), link_gbs=1e6)
    assert out["step_s"] == pytest.approx(28 * 0.4 + 0.05 + out["host_step_s"], rel=1e-5)


def test_deepspeed_zero3_copies_bound_a_step_without_compute():
    """No compute: the weights come up once in forward (one way), and in backward the gradients leave as bf16 and
    fp32 (6 B/param) while weights and the bf16 gradients come up (4 B/param), each direction at half the both-ways
    rate."""
    n = sum(u.numel for u in _units())
    out = _ds(_ingredients(fwd_ms=1e-6, bwd_ms=1e-6, head_ms=1e-6))
    copies = out["step_s"] - out["host_step_s"]
    forward = 2 * n / 50e9
    assert copies > forward + 6 * n / 40e9
    assert copies < forward + (6 + 4) * n / 40e9 + 2 * 2 * _units()[-1].numel / 50e9


def test_deepspeed_moves_what_stage3_copies():
    """ZeRO-3, per micro-batch: every weight up for the forward and again for the backward (2 + 2 B/param), each
    gradient out as bf16, back up, and at the boundary out as fp32 (2 + 4 out, 2 up); a later micro-batch's partial
    sums up and out (2 + 2). ZeRO-Offload: the fp32 gradients out, the new bf16 weights up."""
    n = sum(u.numel for u in _units())
    ing = _ingredients()
    one, four, offload = _ds(ing), _ds(ing, micro_batch=2), _ds(ing, options={"zero_stage": 2})
    assert (one["h2d_bytes"], one["d2h_bytes"]) == (6 * n, 6 * n)
    assert (four["h2d_bytes"], four["d2h_bytes"]) == (4 * 6 * n, 4 * 2 * n + 4 * n)
    assert (offload["h2d_bytes"], offload["d2h_bytes"]) == (2 * n, 4 * n)


def test_deepspeed_accumulation_copies_every_micro_batch():
    """Each further micro-batch brings every weight up twice again, and its gradients' partial sums up and out."""
    n = sum(u.numel for u in _units())
    ing = _ingredients(fwd_ms=1e-6, bwd_ms=1e-6, head_ms=1e-6)
    one, two = _ds(ing), _ds(ing, micro_batch=4)
    assert two["step_s"] - one["step_s"] > 2 * n / 50e9 + 4 * n / 40e9


def test_zero_offload_keeps_weights_on_the_gpu_and_sends_the_new_ones_up():
    """ZeRO-Offload, one micro-batch: nothing to fetch; each layer's fp32 gradient leaves during the next backward,
    the last layer's and the embedding's after the last, and after the host step the bf16 weights go up."""
    units = _units()
    n = sum(u.numel for u in units)
    out = _ds(_ingredients(fwd_ms=100.0, bwd_ms=300.0, head_ms=50.0), options={"zero_stage": 2})
    assert out["fetch_wait_s"] == 0
    assert out["upload_s"] == pytest.approx(n * 2 / 50e9)
    tail = (units[1].numel + units[0].numel) * 4 / 50e9
    assert out["step_s"] == pytest.approx(28 * 0.4 + 0.05 + tail + out["host_step_s"] + out["upload_s"], rel=1e-6)


def test_deepspeed_compiled_layers_are_the_first_ones():
    """Records of the per-layer compile ran only the first DYNAMO_RECOMPILE_LIMIT layers compiled."""
    ing = _ingredients()
    for row in ing.data["layers"]:
        if row["compiled"]:
            row["fwd_ms"], row["bwd_ms"] = row["fwd_ms"] / 2, row["bwd_ms"] / 2
    out = _ds(ing, link_gbs=1e6, compiled_layers=deepspeed.DYNAMO_RECOMPILE_LIMIT, compile=True)
    assert out["compute_s"] == pytest.approx(8 * 0.02 + 20 * 0.04 + 0.02)


def test_deepspeed_host_call_floor_holds_a_micro_batch_to_the_hooks_pace():
    out = _ds(_ingredients(fwd_ms=1.0, bwd_ms=3.0, head_ms=1.0), link_gbs=1e6, host_call_s=0.01)
    assert out["host_bound_s"] == pytest.approx(28 * (0.01 - 0.004))


def test_deepspeed_partial_offload_steps_its_gpu_share_on_the_gpu_and_writes_it_back_through_the_host():
    """offload_optimizer.ratio 0.5: the first half of the sub-groups (deepspeed_zero3.optimizer_sub_groups) stay on
    the GPU: their fp32 gradients never leave, torch AdamW steps them at the GPU rate, and each updated fp32 sub-group
    goes to its bf16 host partition at the measured rate of that dtype-changing copy (PyTorch converts it on the
    host), pinned where the partition is fp32; the host steps and scales the rest. Ingredients without that rate do
    not predict the mode, and say which rate and where it goes."""
    n = sum(u.numel for u in _units())
    ing = _ingredients(fwd_ms=100.0, bwd_ms=300.0, head_ms=50.0)
    ing.data["gpu_to_host_convert_gbs"] = 5.0
    full, partial = _ds(ing), _ds(ing, options={"optimizer_ratio": 0.5})
    on_gpu = partial["optimizer_params_on_gpu"]
    assert full["optimizer_params_on_gpu"] == 0 and 0.3 * n < on_gpu < 0.7 * n
    assert partial["adam_s"] == pytest.approx((n - on_gpu) / 2e9)
    assert partial["clip_s"] == pytest.approx((n - on_gpu) * 8 / 100e9)
    assert partial["gpu_step_s"] == pytest.approx(on_gpu / 100e9 + on_gpu * 4 / 5e9)
    assert partial["d2h_bytes"] == pytest.approx(full["d2h_bytes"])  # fp32 gradients kept, fp32 master out instead
    assert partial["optimizer_s"] == pytest.approx(partial["host_step_s"] + partial["gpu_step_s"])
    fp32 = _ds(ing, options={"optimizer_ratio": 0.5}, dtype="float32")
    assert fp32["gpu_step_s"] == pytest.approx(on_gpu / 100e9 + on_gpu * 4 / 50e9)  # a pinned copy at the link's
    del ing.data["gpu_to_host_convert_gbs"]
    assert _ds(ing)["step_s"] == full["step_s"]  # ZeRO-3 offload writes nothing back from the GPU
    with pytest.raises(KeyError, match=r"lack its rate \(gpu_to_host_convert_gbs\).*--models ''"):
        _ds(ing, options={"optimizer_ratio": 0.5})


def test_superoffload_steps_after_the_backward_with_clipping_and_beside_it_without():
    """SuperOffload's worker runs Adam on 0.8 of the cores and copies 16 B/param more; with clipping (every case's)
    it steps after the backward as ZeRO-3 does; without, beside the backward, leaving at least the last sub-group's
    step after it."""
    n = sum(u.numel for u in _units())
    ing = _ingredients(fwd_ms=100.0, bwd_ms=300.0, head_ms=50.0)
    zero3, clipped = _ds(ing), _ds(ing, options={"super_offload": True})
    assert clipped["adam_s"] == pytest.approx(n / (2e9 * 0.8))
    assert clipped["cast_s"] == pytest.approx(n * (6 + 16) / 50e9)
    assert clipped["optimizer_s"] == pytest.approx(clipped["host_step_s"])
    assert clipped["host_step_s"] > zero3["host_step_s"]
    assert clipped["forward_s"] + clipped["backward_s"] == pytest.approx(zero3["forward_s"] + zero3["backward_s"])
    speculative = _ds(ing, options={"super_offload": True}, optim=OptimConfig(max_grad_norm=0.0))
    assert speculative["clip_s"] == 0
    one_sub_group = (speculative["adam_s"] + speculative["cast_s"]) * max(
        deepspeed.optimizer_sub_groups(CaseConfig(system="deepspeed", model=MODEL))) / n
    assert speculative["optimizer_s"] == pytest.approx(max(one_sub_group, speculative["adam_s"] + speculative["cast_s"]
                                                           - speculative["backward_s"]))
    assert speculative["step_s"] < clipped["step_s"]


def test_host_step_rates_from_a_probe_or_scaled_from_the_reference():
    reference = {"cpu_adamw_gparams_s": 4.0, "host_mem_gbs": {"update": [50.0, 120.0], "copy": [40.0, 60.0]}}
    own = deepspeed.HostStep.from_probe({"cpu_adamw_gparams_s": 2.0, "host_mem_gbs": {"triad": [90.0],
                                                                                      "copy": [45.0]}}, reference)
    assert own == deepspeed.HostStep(2.0, 90.0, 45.0)  # no update kernel probed: triad's rate
    older = deepspeed.HostStep.from_probe({"cpu_adamw_gparams_s": 2.0}, reference)
    assert older == deepspeed.HostStep(2.0, 60.0, 30.0)  # the reference's rates at half its AdamW rate
    grace = deepspeed.HostStep.at_bandwidth(reference, 240.0)
    assert grace == deepspeed.HostStep(8.0, 240.0, 120.0)
    assert grace.adam_bytes_per_param() == pytest.approx(30.0)  # the reference's 120 GB/s over 4 G params/s


def test_deepspeed_validation_reads_the_records_and_meets_the_target_at_the_papers_batch(tmp_path):
    """The DeepSpeed model against every committed DeepSpeed record gives the committed table
    (results/perf_model/deepspeed_validation.csv); the 14B full-depth records at batch 96 are within the issue's 15%,
    and every miss names what it points at."""
    summary = deepspeed_check.validate(tmp_path)
    committed = model_check.RESULTS / "perf_model"
    assert (tmp_path / "deepspeed_validation.csv").read_text() == (committed / "deepspeed_validation.csv").read_text()
    assert summary["cases"] >= 50
    rows = list(csv.DictReader((tmp_path / "deepspeed_validation.csv").read_text().splitlines()))
    at_96 = [r for r in rows if r["model"] == "qwen2.5-14b" and r["layers"] == "48" and r["batch"] == "96"]
    assert len(at_96) == 4 and all(abs(float(r["error_pct"])) <= deepspeed_check.TARGET_PCT for r in at_96)
    misses = [r for r in rows if r["error_pct"] and abs(float(r["error_pct"])) > deepspeed_check.TARGET_PCT]
    assert misses and all(r["why"] for r in misses)
    assert len(summary["misses"]) == len(misses) == summary["cases"] - summary["within_target"]


def test_deepspeed_projection_reproduces_and_names_its_assumptions(tmp_path):
    """The committed GH200 projection (results/perf_model/deepspeed_projection.json) is what the code gives; its
    ratio, both systems' TFLOPS and every assumption's source are there, and the answer quotes the numbers."""
    ours = deepspeed_projection.project(tmp_path)
    committed = json.loads((model_check.RESULTS / "perf_model" / "deepspeed_projection.json").read_text())
    for key in ("projected", "assumptions", "sensitivity", "to_reach_paper_deepspeed", "answer"):
        assert json.loads(json.dumps(ours[key])) == committed[key]
    ds, mt = ours["projected"]["deepspeed"], ours["projected"]["megatrain"]
    assert ours["projected"]["ratio"] == pytest.approx(ds["step_s"] / mt["step_s"])
    assert all("source" in v for v in ours["assumptions"].values() if isinstance(v, dict))
    assert len(ours["sensitivity"]) == 2 * len(deepspeed_projection.RATES)
    assert f"{ds['tflops']:.0f}" in ours["answer"] and f"{mt['tflops']:.0f}" in ours["answer"]


def test_ingredients_measure_the_rates_asked_for_and_a_later_file_adds_its_rate_alone(tmp_path, monkeypatch):
    """`--rates R --models ''` writes a file of that rate alone (on CPU: the host copy), which, loaded after a GPU
    kind's files, adds the rate without a second sample of the host AdamW; an unknown rate exits 2 naming the rates."""
    import sys

    from megatrain.perf_model import ingredients as measure

    out = tmp_path / "later.json"
    monkeypatch.setitem(measure.RATES, "host_copy_gbs", lambda: measure.host_copy_gbs(2**20))  # 1 MiB, not 2 GiB
    monkeypatch.setattr(sys, "argv", ["ingredients", "--models", "", "--rates", "host_copy_gbs", "--out", str(out)])
    measure.main()
    later = json.loads(out.read_text())
    assert set(later) == {"what", "env", "layers", "heads", "attention", "host_copy_gbs", "elapsed_s"}
    assert later["host_copy_gbs"] > 0
    first = tmp_path / "first.json"
    first.write_text(json.dumps(_ingredients().data | {"host_copy_gbs": 1.0, "env": {"commit": "a"}}))
    joined = Ingredients.load(first, out)
    assert joined.data["host_copy_gbs"] == 1.0 and len(joined.data["host_adamw_runs"]) == 1
    monkeypatch.setattr(sys, "argv", ["ingredients", "--rates", "pcie", "--out", str(out)])
    with pytest.raises(SystemExit) as exc:
        measure.main()
    assert exc.value.code == 2


def test_zero3_with_its_parameters_on_the_gpu_fetches_none_and_writes_its_host_share_up():
    """offload_param=false: no weights cross before a layer's use (no fetch wait, no H2D of weights); after the step
    the host sub-groups' masters go up through PyTorch's host-side cast at its measured rate, in place of the host's
    cast into a pinned partition; with partial offload the GPU share writes on the device. Without that rate: not
    predicted, saying which rate."""
    n = sum(u.numel for u in _units())
    ing = _ingredients(fwd_ms=100.0, bwd_ms=300.0, head_ms=50.0)
    ing.data.update(gpu_to_host_convert_gbs=5.0, gpu_from_host_convert_gbs=8.0)
    offloaded = _ds(ing, link_gbs=1.0)  # a slow link: ZeRO-3's weight copies wait
    on_gpu = _ds(ing, link_gbs=1.0, options={"offload_param": False})
    assert offloaded["fetch_wait_s"] > 0 and on_gpu["fetch_wait_s"] == 0
    assert on_gpu["cast_s"] == pytest.approx(n * 4 / 8e9) and on_gpu["adam_s"] == offloaded["adam_s"]
    assert on_gpu["h2d_bytes"] < offloaded["h2d_bytes"]
    partial = _ds(ing, options={"offload_param": False, "optimizer_ratio": 0.5})
    k = partial["optimizer_params_on_gpu"]
    assert partial["gpu_step_s"] == pytest.approx(k / 100e9) and partial["cast_s"] == pytest.approx((n - k) * 4 / 8e9)
    del ing.data["gpu_from_host_convert_gbs"]
    with pytest.raises(KeyError, match=r"lack its rate \(gpu_from_host_convert_gbs\)"):
        _ds(ing, options={"offload_param": False})
