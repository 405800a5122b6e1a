"""Micro-benchmarks of the engine's hot paths, on one decoder layer's worth of data.

Run: nox -s bench   (pytest tests/bench --benchmark-only). Outside --benchmark-only they skip.
CPU benchmarks run anywhere; the PCIe copy needs CUDA. The layer is that of MEGATRAIN_BENCH_MODEL
(default qwen2.5-7b with CUDA, qwen2.5-0.5b without: a 7B layer's AdamW state is 3.7 GB).
Each benchmark stores its rate (GB/s or G params/s, from the median time) in extra_info.
"""

import os

import pytest
import torch

from megatrain.models.registry import model_shape

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
MODEL = os.environ.get("MEGATRAIN_BENCH_MODEL", "qwen2.5-7b" if torch.cuda.is_available() else "qwen2.5-0.5b")
LAYER_NUMEL = model_shape(MODEL).layer_params()


@pytest.fixture(autouse=True)
def _only_when_benchmarking(request):
    if not request.config.getoption("benchmark_only"):
        pytest.skip("hot-path benchmarks run with --benchmark-only (nox -s bench)")


def _rate(benchmark, amount: float, key: str) -> None:
    benchmark.extra_info.update(model=MODEL, layer_numel=LAYER_NUMEL)
    benchmark.extra_info[key] = amount / benchmark.stats.stats.median / 1e9


@cuda
def test_h2d_copy_of_a_pinned_layer(benchmark):
    host = torch.empty(LAYER_NUMEL, dtype=torch.bfloat16, pin_memory=True)
    dev = torch.empty(LAYER_NUMEL, dtype=torch.bfloat16, device="cuda")

    def copy():
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()

    benchmark(copy)
    _rate(benchmark, host.numel() * host.element_size(), "gb_per_s")


def test_cpu_fused_adamw_step_on_a_layer(benchmark):
    param = torch.nn.Parameter(torch.zeros(LAYER_NUMEL))
    param.grad = torch.full_like(param, 1e-3)
    opt = torch.optim.AdamW([param], lr=1e-4, fused=True)
    opt.step()  # allocate the moments outside the timing
    benchmark(opt.step)
    _rate(benchmark, LAYER_NUMEL, "gparams_per_s")


@pytest.mark.parametrize("src_dtype, dst_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)],
                         ids=["fp32_to_bf16", "bf16_to_fp32"])
def test_dtype_conversion_of_a_layer_tile(benchmark, src_dtype, dst_dtype):
    src = torch.randn(LAYER_NUMEL).to(src_dtype)
    dst = torch.empty(LAYER_NUMEL, dtype=dst_dtype)
    benchmark(dst.copy_, src)
    _rate(benchmark, src.numel() * (src.element_size() + dst.element_size()), "gb_per_s")


@pytest.mark.parametrize("precision", ["mixed", "bf16"])
def test_one_pass_host_adamw_on_a_layer(benchmark, precision):
    """mixed: fp32 master in, bf16 copy out (28 B/param); bf16: bf16 weights updated in place (22 B/param)."""
    from megatrain.optim import fused

    if not fused.available():
        pytest.skip("no C++ compiler for the one-pass kernel")
    m, v = torch.zeros(LAYER_NUMEL), torch.zeros(LAYER_NUMEL)
    g = torch.full((LAYER_NUMEL,), 1e-3, dtype=torch.bfloat16)
    w = torch.zeros(LAYER_NUMEL, dtype=torch.bfloat16)
    p = torch.zeros(LAYER_NUMEL) if precision == "mixed" else w
    benchmark(fused.fused_adamw, p, g, m, v, None if p is w else w, 1, 1.0, 1e-4, 0.9, 0.95, 1e-8, 0.1)
    _rate(benchmark, LAYER_NUMEL, "gparams_per_s")


@pytest.mark.parametrize("requires_grad", [False, True], ids=["forward", "backward"])
def test_bind_a_layer_template(benchmark, requires_grad):
    """Binding = building the views a template call receives; it must cost microseconds, not a copy."""
    from megatrain.engine.layout import build_units
    from megatrain.engine.templates import bind

    unit = build_units(model_shape(MODEL))[1]
    flat = torch.empty(unit.numel, dtype=torch.bfloat16)
    views = benchmark(bind, unit, flat, requires_grad)
    assert all(v.data_ptr() >= flat.data_ptr() for v in views.values())  # views into the buffer, no copies
    benchmark.extra_info["bind_us"] = benchmark.stats.stats.median * 1e6
