"""The engine's GPU correctness suite: what the CPU parity tests cannot see (on CPU every stream is the host).
Needs CUDA; about 8 minutes on one H100 or H200, every check recorded where MEGATRAIN_GPU_CHECKS names a file:
    MEGATRAIN_GPU_CHECKS=results/gpu_checks/records.jsonl pytest tests/gpu/test_engine_gpu.py -m gpu

1. fp32 parity, tight (TF32 off): the engine against native on the same seed, 10 steps, clipping active and
   inactive, for each engine option and their useful combinations: losses to 1e-5 relative, every parameter within
   1e-5 of its tensor's largest magnitude (or 10x native's own run-to-run difference where that is larger).
2. Stream stress: the same parity under random busy-waits queued on every stream at every hand-off
   (option stream_stress=SEED), several seeds: a missing cross-stream wait then breaks parity every time.
3. PyTorch's CUDA stream sanitizer (TORCH_CUDA_SANITIZER=1, in a subprocess) over a few steps of every option, bf16,
   both precisions, eager (it sees only kernels launched through the dispatcher, not Inductor's).
4. bf16 loss curves on a repeated batch, two shapes: per step within 3x native's own run-to-run spread plus 1% of
   the loss, in both precisions and every option; the loss never rises where native's falls.
5. A NaN gradient skips the update on the GPU too: weights, moments and step counts untouched.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_helpers import assert_nan_step_skipped, train, train_with_nan_gradient

from megatrain.bench.case import run_case
from megatrain.config import CaseConfig, OptimConfig

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True, scope="module")
def _no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# ---- 1 and 2: fp32 parity, plain and under stream stress ---------------------------------------------------------
FP32_STEPS = 10
FP32_BASE = dict(model="tiny", num_layers=4, batch=4, micro_batch=2, seq=256, dtype="float32", device="cuda")
CLIPPING = {"clip-active": OptimConfig(lr=1e-3, max_grad_norm=0.05),
            "clip-inactive": OptimConfig(lr=1e-3, max_grad_norm=0.0)}
# name -> (case fields over FP32_BASE, engine options). Compile is on by default on CUDA.
FP32_SETS = {
    "compiled": ({}, {}),
    "eager": ({}, {"compile": False}),
    "no-accumulation": ({"micro_batch": 4}, {}),
    "torch-optimizer-kernel": ({}, {"optimizer_kernel": "torch"}),
    "tied": ({"model": "tiny-tied", "num_layers": 3}, {}),
    "resident-embedding": ({}, {"resident_embedding": True}),
    "resident-embedding-2-layers": ({}, {"resident_embedding": True, "resident_layers": 2}),
    "tied-all-resident": ({"model": "tiny-tied", "num_layers": 3}, {"resident_embedding": True, "resident_layers": 3}),
    "offload-activations": ({}, {"offload_activations": True}),
    "mlp-chunks": ({}, {"mlp_chunk_tokens": 128}),
    "offload-mlp-chunks-1-resident-eager": ({}, {"offload_activations": True, "mlp_chunk_tokens": 128,
                                                 "resident_layers": 1, "compile": False}),
}
STRESS_SETS = ["compiled", "tied", "resident-embedding-2-layers", "offload-activations",
               "offload-mlp-chunks-1-resident-eager"]
STRESS_SEEDS = [1, 2, 3]
_native_runs: dict[str, list] = {}


def _native_twice(steps: int, **kw) -> list:
    """Two native runs of a case (the reference and its own run-to-run spread), cached per case."""
    key = json.dumps(kw, sort_keys=True, default=str)
    if key not in _native_runs:
        _native_runs[key] = [train("native", steps, **kw) for _ in range(2)]
    return _native_runs[key]


def _fp32_compare(losses, params, native) -> dict:
    (ref_l, ref_p, _), (again_l, again_p, _) = native
    ref_l, again_l, losses = (torch.tensor(x, dtype=torch.float64) for x in (ref_l, again_l, losses))
    loss_rel = ((losses - ref_l).abs() / ref_l.abs()).max().item()
    native_loss_rel = ((again_l - ref_l).abs() / ref_l.abs()).max().item()
    loss_tol = max(1e-5, 10 * native_loss_rel)
    worst_frac, worst_name, params_ok = 0.0, None, True
    for name, ref in ref_p.items():
        scale = ref.abs().max().item()
        diff = (params[name] - ref).abs().max().item()
        native_diff = (again_p[name] - ref).abs().max().item()
        params_ok &= diff <= max(1e-5 * scale, 10 * native_diff)
        if diff / scale >= worst_frac:
            worst_frac, worst_name = diff / scale, name
    return {"max_loss_rel_diff": loss_rel, "native_loss_rel_diff": native_loss_rel, "loss_tol": loss_tol,
            "max_param_diff_of_max": worst_frac, "worst_param": worst_name, "params_ok": params_ok,
            "loss_ok": loss_rel <= loss_tol}


def _fp32_check(check: dict, name: str, clipping: str, extra_options: dict) -> None:
    fields, options = FP32_SETS[name]
    kw = {**FP32_BASE, **fields, "optim": CLIPPING[clipping]}
    native = _native_twice(FP32_STEPS, **kw)
    options = {**options, **extra_options}
    losses, params, metrics = train("megatrain", FP32_STEPS, options=options, **kw)
    result = _fp32_compare(losses, params, native)
    check.update(case={k: v for k, v in kw.items() if k != "optim"}, optim=vars(CLIPPING[clipping]),
                 options=options, losses=losses, native_losses=native[0][0], grad_norms=metrics["grad_norms"],
                 **result)
    assert result["loss_ok"], f"losses differ from native by {result['max_loss_rel_diff']:.2e} relative"
    assert result["params_ok"], f"{result['worst_param']} differs from native by " \
                                f"{result['max_param_diff_of_max']:.2e} of its largest magnitude"
    if clipping == "clip-active":
        assert max(metrics["grad_norms"]) > CLIPPING[clipping].max_grad_norm  # clipping really acted


@pytest.mark.parametrize("clipping", CLIPPING)
@pytest.mark.parametrize("name", FP32_SETS)
def test_fp32_engine_matches_native_tightly(name, clipping, check):
    _fp32_check(check, name, clipping, {})


@pytest.mark.parametrize("seed", STRESS_SEEDS)
@pytest.mark.parametrize("name", STRESS_SETS)
def test_fp32_parity_holds_under_stream_stress(name, seed, check):
    _fp32_check(check, name, "clip-active", {"stream_stress": seed})


# ---- 3: the CUDA stream sanitizer ---------------------------------------------------------------------------------
SANITIZER_BASE = dict(model="tiny", num_layers=3, batch=4, micro_batch=2, seq=128, steps=3, warmup=0,
                      device="cuda", dtype="bfloat16", optim=dict(lr=1e-3, max_grad_norm=0.05))
SANITIZER_SETS = {
    "default": ({}, {}),
    "tied": ({"model": "tiny-tied"}, {}),
    "torch-optimizer-kernel": ({}, {"optimizer_kernel": "torch"}),
    "resident-embedding-2-layers": ({}, {"resident_embedding": True, "resident_layers": 2}),
    "tied-all-resident": ({"model": "tiny-tied"}, {"resident_embedding": True, "resident_layers": 3}),
    "offload-activations-mlp-chunks": ({}, {"offload_activations": True, "mlp_chunk_tokens": 64}),
}
_SANITIZED_RUNS = """
import json, sys
from megatrain.bench.case import run_case
from megatrain.config import CaseConfig
for name, case in json.loads(sys.argv[1]).items():
    record = run_case(CaseConfig.from_dict(case))
    print(json.dumps({"set": name, "status": record["status"], "error": record["error"], "losses": record["losses"]}),
          flush=True)
"""


@pytest.mark.parametrize("precision", ["mixed", "bf16"])
def test_cuda_stream_sanitizer_finds_no_unsynchronised_access(precision, check):
    cases = {}
    for name, (fields, options) in SANITIZER_SETS.items():
        cases[name] = {**SANITIZER_BASE, **fields, "system": "megatrain", "precision": precision,
                       "options": {**options, "compile": False}}
    proc = subprocess.run([sys.executable, "-c", _SANITIZED_RUNS, json.dumps(cases)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "TORCH_CUDA_SANITIZER": "1"})
    runs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    check.update(precision=precision, sets=cases, runs=runs, returncode=proc.returncode,
                 stderr_tail=proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CSAN" not in proc.stderr, proc.stderr[-3000:]
    assert [r["set"] for r in runs] == list(cases)
    for r in runs:
        assert r["status"] == "ok", (r["set"], r["error"])


# ---- 4: bf16 loss curves ------------------------------------------------------------------------------------------
CURVE_STEPS = 16
CURVE_SHAPES = {
    "qwen2.5-0.5b-b8-s1024": dict(model="qwen2.5-0.5b", batch=8, seq=1024),
    "small-b8-mb4-s512": dict(model="small", batch=8, micro_batch=4, seq=512),
}
# name -> (precision, case fields over the shape, engine options)
CURVE_SETS = {
    "mixed": ("mixed", {}, {}),
    "bf16": ("bf16", {}, {}),
    "mixed-torch-kernel": ("mixed", {}, {"optimizer_kernel": "torch"}),
    "bf16-torch-kernel": ("bf16", {}, {"optimizer_kernel": "torch"}),
    "mixed-eager": ("mixed", {}, {"compile": False}),
    "mixed-micro-batch-2": ("mixed", {"micro_batch": 2}, {}),
    "mixed-resident-auto": ("mixed", {}, {"resident_embedding": True, "resident_layers": "auto"}),
    "bf16-resident-embedding-4-layers": ("bf16", {}, {"resident_embedding": True, "resident_layers": 4}),
    "mixed-offload-activations": ("mixed", {}, {"offload_activations": True}),
    "bf16-offload-mlp-chunks": ("bf16", {}, {"offload_activations": True, "mlp_chunk_tokens": 2048}),
    "mixed-stress": ("mixed", {}, {"stream_stress": 1}),
    "bf16-offload-stress": ("bf16", {}, {"offload_activations": True, "stream_stress": 2}),
}
CURVE_CASES = [("qwen2.5-0.5b-b8-s1024", name) for name in CURVE_SETS] + [
    ("small-b8-mb4-s512", name) for name in ("mixed", "bf16", "mixed-offload-activations", "mixed-resident-auto",
                                             "bf16-offload-stress")]
_native_curves: dict[tuple[str, str], list[list[float]]] = {}


def _curve(system: str, shape: str, precision: str, fields: dict | None = None, options: dict | None = None):
    case = CaseConfig(system=system, device="cuda", dtype="bfloat16", precision=precision, steps=CURVE_STEPS,
                      repeat_batch=True, seed=0, **{**CURVE_SHAPES[shape], **(fields or {})}, options=options or {})
    record = run_case(case)
    assert record["status"] == "ok", (record["error"], record.get("traceback"))
    return record["losses"]


@pytest.mark.parametrize("shape,name", CURVE_CASES, ids=[f"{s}-{n}" for s, n in CURVE_CASES])
def test_bf16_loss_curve_tracks_native(shape, name, check):
    precision, fields, options = CURVE_SETS[name]
    if (shape, precision) not in _native_curves:
        _native_curves[shape, precision] = [_curve("native", shape, precision) for _ in range(2)]
    ref, again = (torch.tensor(c, dtype=torch.float64) for c in _native_curves[shape, precision])
    ours = torch.tensor(_curve("megatrain", shape, precision, fields, options), dtype=torch.float64)
    spread = (again - ref).abs()
    tol = 3 * spread + 0.01 * ref.abs()
    excess = ((ours - ref).abs() - tol).max().item()
    native_falls = (ref[1:] < ref[:-1]) & (again[1:] < again[:-1])
    rises = [i + 1 for i in range(len(ours) - 1)
             if native_falls[i] and ours[i + 1] > ours[i] + 3 * max(spread[i], spread[i + 1])]
    check.update(shape=CURVE_SHAPES[shape], precision=precision, fields=fields, options=options,
                 losses=ours.tolist(), native_losses=ref.tolist(), native_again=again.tolist(),
                 max_abs_diff=(ours - ref).abs().max().item(), max_native_spread=spread.max().item(),
                 max_excess_over_tol=excess, rising_steps=rises)
    assert excess <= 0, f"loss leaves native's band by {excess:.4f} (curve {ours.tolist()} vs {ref.tolist()})"
    assert not rises, f"loss rises at steps {rises} where native's falls: {ours.tolist()}"


# ---- 5: a non-finite gradient norm skips the update -------------------------------------------------------------
NAN_SETS = {"megatrain-mixed": ("megatrain", "mixed", {}),
            "megatrain-bf16-resident": ("megatrain", "bf16", {"resident_embedding": True, "resident_layers": 1}),
            "megatrain-mixed-offload-stress": ("megatrain", "mixed", {"offload_activations": True, "stream_stress": 1}),
            "native-mixed": ("native", "mixed", {})}


@pytest.mark.parametrize("name", NAN_SETS)
def test_nan_gradient_skips_the_update_on_gpu(name, check):
    system, precision, options = NAN_SETS[name]
    run = train_with_nan_gradient(system, nan_step=2, steps=4, model="tiny", batch=2, seq=64, device="cuda",
                                  dtype="bfloat16", precision=precision, options=options)
    check.update(system=system, precision=precision, options=options, losses=run["losses"],
                 skipped_steps=run["skipped_steps"])
    assert_nan_step_skipped(run)
