"""Measure the performance model's ingredients on this machine, as the engine runs them (one JSON file).

python -m megatrain.perf_model.ingredients --out results/ingredients/h200-141g-128g.json
    [--models qwen2.5-0.5b,...] [--tokens 8192,32768] [--long-seqs 8192,32768,131072] [--rates machine,...]

- the machine probe (megatrain.probe.measure: pinned PCIe each way and both, bf16 GEMM, torch's fused CPU
  AdamW), and the host's copy rate (one 2 GiB tensor into another: GB copied per second);
- the engine's own host AdamW kernel (megatrain.probe.engine_adamw_gparams_s) in both precisions, in
  G params/s over 128M parameters;
- the GPU AdamW of a resident unit (the engine's torch_adamw_unit on one 7B layer's tiles on the GPU, clipped), in
  G params/s per precision, and the GPU's copy rate (GB copied per second);
- a blocking copy of fp32 on the GPU into a pinned bf16 host tensor (GB/s of fp32): PyTorch converts it on the
  host through a pageable temporary; DeepSpeed's partial optimizer offload writes its GPU sub-groups back so; and the
  other way, pinned fp32 on the host into bf16 on the GPU (ZeRO-3 with its parameters on the GPU writes its host
  sub-groups back so);
- per model shape, at seq 1024 and each token count, eager and compiled: one decoder layer's forward (no grad, as
  the engine's forward) and its recompute + backward with the fp32 gradient accumulation and squared norm the
  engine adds (`bwd_ms`), through the engine's LayerTemplate; the head (final norm, chunked LM-head loss, and its
  backward: the engine's fused head use);
- attention alone (SDPA, causal, enable_gqa, as the layer calls it) per sequence, forward and forward + backward,
  at seq 1024 for every shape and at the long sequences for the shapes given with --long-models.

Each measurement that fails (out of memory) is recorded with its error; the file is rewritten after each shape, so
a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from megatrain.bench.env import environment
from megatrain.engine.host_optimizer import torch_adamw_unit
from megatrain.engine.layout import build_units
from megatrain.engine.store import OPT_CHUNK
from megatrain.engine.templates import HeadTemplate
from megatrain.memory import GIB
from megatrain.models import model_shape
from megatrain.optim.compact import Moments
from megatrain.optim.config import OptimConfig
from megatrain.optim.host_adamw import FlatAdamW
from megatrain.perf_model.layer_profile import bench_ms, engine_layer
from megatrain.probe import _median_s, engine_adamw_gparams_s, measure

SHAPES = ["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b", "qwen2.5-72b",
          "dense-120b"]


def host_copy_gbs(nbytes: int = 2 * GIB, repeats: int = 3) -> float:
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def gpu_adamw_gparams_s(precision: str, model: str = "qwen2.5-7b") -> float:
    """A resident unit's update on the GPU as the engine runs it (Schedule._update_resident), one 7B layer."""
    unit = build_units(model_shape(model))[1]
    dev = torch.device("cuda")
    w = torch.zeros(unit.numel, dtype=torch.bfloat16, device=dev)
    g = torch.full((unit.numel,), 1e-3, dtype=torch.float32, device=dev)
    master = torch.zeros(unit.numel, dtype=torch.float32, device=dev) if precision == "mixed" else None
    moments = Moments(torch.zeros(unit.numel, device=dev), torch.zeros(unit.numel, device=dev))
    scratch = torch.empty(min(OPT_CHUNK, unit.numel), dtype=torch.float32, device=dev) if master is None else None
    adamw = FlatAdamW(OptimConfig())

    def step():
        torch_adamw_unit(adamw, unit, w, g, master, moments, 0.5, 0.1, None, scratch, 1e-4)

    return unit.numel / (bench_ms(step, warmup=2, iters=5) / 1e3) / 1e9


def gpu_copy_gbs(nbytes: int = 4 * GIB) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return nbytes / (bench_ms(lambda: dst.copy_(src), warmup=2, iters=5) / 1e3) / 1e9


def convert_copy_gbs(to_host: bool, numel: int = 2**28, repeats: int = 3) -> float:
    """GB/s, counted in fp32's bytes, of a blocking copy that changes dtype across the link, 1 GiB of fp32:
    to_host, fp32 on the GPU into a pinned bf16 host tensor, as DeepSpeed's partial optimizer offload writes each GPU
    sub-group's updated master into its bf16 parameter partition on the host
    (stage3._reassign_or_swap_out_partitioned_parameters); else pinned fp32 on the host into bf16 on the GPU, as
    ZeRO-3 with its parameter partitions on the GPU (deepspeed option offload_param=false) writes its host
    sub-groups'. PyTorch converts a blocking copy that changes dtype on the host (copy_kernel_cuda): to the host
    through a fresh pageable fp32 temporary, from the host through a fresh pageable bf16 cast; not a pinned copy at
    the link's rate. Each repeat makes its temporary afresh, as each of DeepSpeed's steps does."""
    host = torch.empty(numel, dtype=torch.bfloat16 if to_host else torch.float32, pin_memory=True).fill_(1)
    gpu = torch.ones(numel, dtype=torch.float32 if to_host else torch.bfloat16, device="cuda")
    dst, src = (host, gpu) if to_host else (gpu, host)

    def copy():
        dst.copy_(src)
        torch.cuda.synchronize()

    copy()
    return numel * 4 / _median_s(copy, repeats) / 1e9


def layer_times(model: str, tokens: int, compiled: bool, seq: int = 1024) -> dict:
    """One decoder layer of `model` on `tokens` tokens (rows of `seq`) as the engine runs it, bf16: forward, and
    recompute + backward + fp32 gradient accumulation + squared norm."""
    layer, fwd, bwd = engine_layer(model_shape(model), tokens // seq, seq, compiled, accumulate=True)
    out = {"model": model, "seq": seq, "tokens": tokens, "compiled": compiled}
    out["fwd_ms"], out["bwd_ms"] = bench_ms(fwd, warmup=2, iters=5), bench_ms(bwd, warmup=2, iters=5)
    out["compiled_ran"] = layer.compiled  # False when compilation failed and the layer fell back to eager
    return out


def head_times(model: str, tokens: int, seq: int = 1024) -> dict:
    """The engine's head use: final norm, chunked LM-head cross-entropy, and its backward to h, norm and head."""
    cfg = model_shape(model)
    dev, dt = torch.device("cuda"), torch.bfloat16
    head = HeadTemplate(cfg)
    norm_w = torch.ones(cfg.hidden_size, device=dev, dtype=dt, requires_grad=True)
    head_w = (torch.randn(cfg.vocab_size, cfg.hidden_size, device=dev, dtype=dt) * 0.02).requires_grad_()
    h = torch.randn(tokens // seq, seq, cfg.hidden_size, device=dev, dtype=dt, requires_grad=True)
    labels = torch.randint(0, cfg.vocab_size, (tokens // seq, seq), device=dev)

    def run():
        with torch.enable_grad():
            loss = head.loss(norm_w, head_w, h, labels, tokens)
            torch.autograd.grad(loss, [h, norm_w, head_w])

    return {"model": model, "seq": seq, "tokens": tokens, "ms": bench_ms(run, warmup=2, iters=5)}


def attention_times(model: str, seq: int) -> dict:
    """SDPA on one sequence with this model's heads, as the layer calls it: forward, and forward + backward."""
    cfg = model_shape(model)
    dev, dt = torch.device("cuda"), torch.bfloat16
    q = torch.randn(1, cfg.num_heads, seq, cfg.head_dim, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(1, cfg.num_kv_heads, seq, cfg.head_dim, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    gqa = cfg.num_heads != cfg.num_kv_heads
    iters = 5 if seq <= 32768 else 2

    def fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    def fwd_bwd():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        torch.autograd.grad(o, [q, k, v], torch.ones_like(o))

    return {"model": model, "seq": seq, "fwd_ms": bench_ms(fwd, warmup=1, iters=iters),
            "fwd_bwd_ms": bench_ms(fwd_bwd, warmup=1, iters=iters)}


def attempt(fn, *args) -> dict:
    """fn(*args), or the error it raised (an out-of-memory is a result too), with the GPU memory released."""
    try:
        return fn(*args)
    except Exception as exc:  # recorded; the other measurements go on
        return {"args": [str(a) for a in args], "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    finally:
        torch.cuda.empty_cache()


# each rate a file may hold, measured in this order: the machine probe (megatrain.probe.measure) and the rest
RATES = {
    "machine": lambda: measure().to_dict(),
    "host_copy_gbs": host_copy_gbs,
    "host_adamw_gparams_s": lambda: {p: engine_adamw_gparams_s(p, 2**27) for p in ("bf16", "mixed")},
    "gpu_copy_gbs": gpu_copy_gbs,
    "gpu_to_host_convert_gbs": lambda: convert_copy_gbs(to_host=True),
    "gpu_from_host_convert_gbs": lambda: convert_copy_gbs(to_host=False),
    "gpu_adamw_gparams_s": lambda: {p: gpu_adamw_gparams_s(p) for p in ("bf16", "mixed")},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--models", default=",".join(SHAPES), help="shapes to time ('' for none: the rates only)")
    p.add_argument("--tokens", default="8192,32768", help="tokens per layer call at seq 1024")
    p.add_argument("--long-models", default="qwen2.5-1.5b,qwen2.5-7b")
    p.add_argument("--long-seqs", default="8192,32768,131072,262144")
    p.add_argument("--rates", default=",".join(RATES),
                   help="which rates to measure (all by default); a file of one rate learnt later (--models '' "
                        "--rates gpu_to_host_convert_gbs) adds it beside a GPU kind's files without a second sample "
                        "of the others")
    args = p.parse_args()
    rates = [r for r in args.rates.split(",") if r]
    if unknown := sorted(set(rates) - set(RATES)):
        p.error(f"--rates: unknown {', '.join(unknown)}; the rates are {', '.join(RATES)}")
    torch._dynamo.config.cache_size_limit = 64  # one compile per shape and token count, all of one function
    t0 = time.perf_counter()
    result = {"what": "performance model ingredients (megatrain.perf_model.ingredients)", "env": environment(),
              "layers": [], "heads": [], "attention": []}
    for rate in rates:
        result[rate] = RATES[rate]()
    print(json.dumps({k: result[k] for k in rates}), flush=True)

    def save():
        result["elapsed_s"] = time.perf_counter() - t0
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")

    tokens = [int(t) for t in args.tokens.split(",")]
    for model in [m for m in args.models.split(",") if m]:
        for t in tokens:
            for compiled in (False, True):
                result["layers"].append(row := attempt(layer_times, model, t, compiled))
                print(json.dumps(row), flush=True)
            result["heads"].append(attempt(head_times, model, t))
        seqs = [1024] + ([int(s) for s in args.long_seqs.split(",")] if model in args.long_models.split(",") else [])
        result["attention"] += [attempt(attention_times, model, s) for s in seqs]
        print(json.dumps(result["heads"][-len(tokens):] + result["attention"][-len(seqs):]), flush=True)
        save()
    save()


if __name__ == "__main__":
    main()
