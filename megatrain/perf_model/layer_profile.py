"""Profile one decoder layer on the GPU: forward, recompute+backward, and the pieces, against the GEMM peak.

python -m megatrain.perf_model.layer_profile --model qwen2.5-7b --tokens 16384
Prints a table and, last, one JSON line. Variants: eager vs torch.compile of the layer, SDPA with
enable_gqa vs K/V expanded to all heads.

python -m megatrain.perf_model.layer_profile --model qwen2.5-7b --long 524288 --mlp-chunk-tokens 16384 [--out FILE]
One sequence of that length through the engine's own compiled layer template, timed once each (forward; recompute
and backward), then one profiled forward + recompute + backward with the GPU's kernel time split into attention
forward and backward, matmuls, compiled elementwise and the rest: where a long-context step's time goes.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from megatrain.bench.env import environment
from megatrain.engine.templates import LayerTemplate
from megatrain.models import DecoderLayer, model_shape, rotary_tables
from megatrain.models.flops import attention_flops_per_seq
from megatrain.models.init import init_module
from megatrain.models.masks import attended_pairs


def bench_ms(fn, warmup=3, iters=10) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def gemm_peak_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ b)
    return 2 * n**3 / ms / 1e9


def profile(model: str, tokens: int, seq: int) -> dict:
    cfg = model_shape(model)
    dev, dt = torch.device("cuda"), torch.bfloat16
    layer = DecoderLayer(cfg).to(dev)
    init_module(layer, 0, prefix="layers.0.")
    layer.to(dt)
    b = tokens // seq
    x = torch.randn(b, seq, cfg.hidden_size, device=dev, dtype=dt)
    dy = torch.randn_like(x)
    cos, sin = rotary_tables(cfg, seq, dev, dt)
    params = list(layer.parameters())
    layer_mm = cfg.layer_matmul_params()
    attn = 2 * 2.0 * attended_pairs(seq) * cfg.num_heads * cfg.head_dim * b  # layer 0, timed without a mask
    fwd_flops = 2.0 * layer_mm * tokens + attn
    out = {"model": model, "tokens": tokens, "seq": seq, "gemm_peak_tflops": gemm_peak_tflops()}

    def fwd(fn):
        with torch.no_grad():
            fn(x, cos, sin)

    def fwd_bwd(fn):
        xr = x.detach().requires_grad_()
        y = fn(xr, cos, sin)
        torch.autograd.grad(y, [xr, *params], dy)

    variants = {"eager": layer}
    try:
        variants["compiled"] = torch.compile(layer, dynamic=False)
    except Exception as exc:  # recorded, the eager numbers still stand
        out["compile_error"] = str(exc)[:500]
    for name, fn in variants.items():
        try:
            f_ms = bench_ms(lambda fn=fn: fwd(fn))
            fb_ms = bench_ms(lambda fn=fn: fwd_bwd(fn))
            out[name] = {"fwd_ms": f_ms, "recompute_bwd_ms": fb_ms, "fwd_tflops": fwd_flops / f_ms / 1e9,
                         "fwd_bwd_tflops": 3 * fwd_flops / fb_ms / 1e9,
                         "layer_step_tflops": 4 * fwd_flops / (f_ms + fb_ms) / 1e9}
        except Exception as exc:
            out[name] = {"error": str(exc)[:500]}
    # attention alone: enable_gqa vs expanded K/V
    q = torch.randn(b, cfg.num_heads, seq, cfg.head_dim, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(b, cfg.num_kv_heads, seq, cfg.head_dim, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    rep = cfg.num_heads // cfg.num_kv_heads

    def sdpa_gqa():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=rep > 1)
        torch.autograd.grad(o, [q, k, v], torch.ones_like(o))

    def sdpa_expand():
        ke, ve = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        o = F.scaled_dot_product_attention(q, ke, ve, is_causal=True)
        torch.autograd.grad(o, [q, k, v], torch.ones_like(o))

    out["attn_fwd_bwd_ms"] = {"enable_gqa": bench_ms(sdpa_gqa), "expand_kv": bench_ms(sdpa_expand)}
    out["attn_share_of_flops"] = attn / fwd_flops
    return out


# kernel name fragments of each category, matched in order (lower case)
KERNEL_CATEGORIES = [
    ("attention_bwd", ("flash_bwd", "fmha_bwd", "bprop", "attention_backward")),
    ("attention_fwd", ("flash_fwd", "fmha_fwd", "fprop", "flash", "fmha", "sdpa", "attention")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "matmul", "sm90_", "sm80_")),
    ("compiled_elementwise", ("triton",)),
]


def kernel_category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, keys in KERNEL_CATEGORIES if any(k in low for k in keys)), "other")


def engine_layer(cfg, rows: int, seq: int, compiled: bool, mlp_chunk_tokens: int = 0, accumulate: bool = False):
    """One decoder layer as the engine calls it, bf16 on the GPU, on `rows` rows of `seq` tokens: (template, forward,
    recompute + backward). The forward runs without grad; the backward recomputes the layer with grad on its weights
    and takes the input's and weights' gradients; with `accumulate` it also adds the weight gradients to fp32 buffers
    and reads their squared norm back, as the engine's backward does."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    source = DecoderLayer(cfg).to(dev)
    init_module(source, 0, prefix="layers.0.")
    params = {n: p.detach().to(dt) for n, p in source.named_parameters()}
    del source
    tensors = list(params.values())
    gacc = [torch.zeros(p.shape, dtype=torch.float32, device=dev) for p in tensors] if accumulate else []
    layer = LayerTemplate(cfg, compile_layer=compiled, mlp_chunk_tokens=mlp_chunk_tokens)
    x = torch.randn(rows, seq, cfg.hidden_size, device=dev, dtype=dt)
    dy = torch.randn_like(x)
    cos, sin = rotary_tables(cfg, seq, dev, dt)

    def fwd():
        with torch.no_grad():
            layer(params, x, cos, sin)

    def recompute_bwd():
        for p in tensors:
            p.requires_grad_()
        xr = x.detach().requires_grad_()
        with torch.enable_grad():
            y = layer(params, xr, cos, sin)
            grads = torch.autograd.grad(y, [xr, *tensors], dy)
        if accumulate:
            torch._foreach_add_(gacc, list(grads[1:]))
            sum(torch.linalg.vector_norm(g).square() for g in gacc).item()
        for p in tensors:
            p.requires_grad_(False)

    return layer, fwd, recompute_bwd


def profile_long(model: str, seq: int, mlp_chunk_tokens: int) -> dict:
    """One sequence of `seq` tokens through one compiled decoder layer as the engine runs it (bf16)."""
    cfg = model_shape(model)
    layer, fwd, recompute_bwd = engine_layer(cfg, 1, seq, True, mlp_chunk_tokens)

    def timed_s(fn) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    first = {"fwd_s": timed_s(fwd), "recompute_bwd_s": timed_s(recompute_bwd)}  # compiles
    torch.cuda.reset_peak_memory_stats()
    fwd_s, bwd_s = timed_s(fwd), timed_s(recompute_bwd)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fwd()
        recompute_bwd()
        torch.cuda.synchronize()
    # kernels only: an op's self device time is its own kernels', so ops that launched them count zero
    kernels = sorted((e for e in prof.key_averages() if e.self_device_time_total > 0),
                     key=lambda e: -e.self_device_time_total)
    by_cat: dict[str, float] = {}
    for e in kernels:
        by_cat[kernel_category(e.key)] = by_cat.get(kernel_category(e.key), 0.0) + e.self_device_time_total / 1e3
    total_ms = sum(by_cat.values())
    layer_mm = cfg.layer_matmul_params()
    attn_fwd = attention_flops_per_seq(cfg, seq) / cfg.num_layers
    mm_fwd = 2.0 * layer_mm * seq
    return {
        "model": model, "seq": seq, "mlp_chunk_tokens": mlp_chunk_tokens, "compiled": layer.compiled,
        "first_call_s": first,  # includes torch.compile
        "fwd_s": fwd_s, "recompute_bwd_s": bwd_s, "layer_step_s": fwd_s + bwd_s,
        "peak_gpu_alloc_gib": torch.cuda.max_memory_allocated() / 2**30,
        "hw_tflops_fwd": (mm_fwd + attn_fwd) / fwd_s / 1e12,
        "hw_tflops_recompute_bwd": 3 * (mm_fwd + attn_fwd) / bwd_s / 1e12,
        "attention_share_of_hw_flops": attn_fwd / (mm_fwd + attn_fwd),
        "kernel_ms": by_cat, "kernel_share": {k: v / total_ms for k, v in by_cat.items()},
        "kernels_top": [{"name": e.key[:120], "category": kernel_category(e.key), "ms": e.self_device_time_total / 1e3,
                         "calls": e.count} for e in kernels[:12]],
        "env": environment(),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--long", type=int, default=0, metavar="SEQ", help="profile one sequence of SEQ tokens instead")
    p.add_argument("--mlp-chunk-tokens", type=int, default=16384)
    p.add_argument("--out", type=Path, help="also write the JSON here")
    args = p.parse_args()
    result = profile_long(args.model, args.long, args.mlp_chunk_tokens) if args.long else \
        profile(args.model, args.tokens, args.seq)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    for k, v in result.items():
        print(f"{k:22s} {v}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
