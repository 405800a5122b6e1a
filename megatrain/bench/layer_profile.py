"""Profile one decoder layer on the GPU: forward, recompute+backward, and the pieces, against the GEMM peak.

python -m megatrain.bench.layer_profile --model qwen2.5-7b --tokens 16384
Prints a table and, last, one JSON line. Variants: eager vs torch.compile of the layer, SDPA with
enable_gqa vs K/V expanded to all heads.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from megatrain.models import DecoderLayer, get_model_config, rotary_tables
from megatrain.models.init import init_module


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
    cfg = get_model_config(model)
    dev, dt = torch.device("cuda"), torch.bfloat16
    layer = DecoderLayer(cfg).to(dev)
    init_module(layer, 0, prefix="layers.0.")
    layer.to(dt)
    b = tokens // seq
    x = torch.randn(b, seq, cfg.hidden_size, device=dev, dtype=dt)
    dy = torch.randn_like(x)
    cos, sin = rotary_tables(cfg, seq, dev, dt)
    params = list(layer.parameters())
    mm = cfg.matmul_params() - cfg.vocab_size * cfg.hidden_size
    layer_mm = mm // cfg.num_layers
    attn = 2 * (2.0 * seq * seq * cfg.num_heads * cfg.head_dim) / 2 * b
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--seq", type=int, default=1024)
    args = p.parse_args()
    result = profile(args.model, args.tokens, args.seq)
    for k, v in result.items():
        print(f"{k:22s} {v}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
