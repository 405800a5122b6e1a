"""Whether the engine's recompute of a layer in backward computes what its forward computed, at a model's width.

The engine runs a layer's forward without gradients and recomputes it with them in backward; compiled, those are two
Inductor graphs, which fuse the layer otherwise and so round otherwise (3e-8 in fp32 on an H200:
tests/gpu/test_engine_gpu.py, the dropout-mask check). For a dense layer that is a rounding. For a mixture of experts a
rounding can change a token's top-k experts, and then the gradient is that of another routing than the one the loss
saw. GPT-OSS-20B's bf16 curve sits a few percent above native's, systematically, from the first update (FINDINGS,
issue 72), where native's checkpointed recompute repeats its forward's eager kernels bit for bit: this measures whether
the engine's forward and recompute part there. Per decoder layer, on one input (the embedding of random tokens, then
each layer's forward output): the largest difference between the forward's output and the recompute's, and the share of
tokens whose output moved by more than 5% of its own largest magnitude (a token sent to another expert moves by O(1);
a rounding moves it by ~1e-3 in bf16); with the load-balancing loss's routing counts, how many token-expert
assignments differ. Eager beside compiled. Weights from megatrain.models.init (every system's init).
    python scripts/recompute_consistency.py SHAPE [--layers N] [--batch B] [--seq S] [--dtype bfloat16] [--device cuda]
        [--eager-too] [--out FILE]
"""

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MOVED = 0.05  # a token's output moved by more than this share of its largest magnitude: another routing, not rounding


def measure(shape: str, layers: int, batch: int, seq: int, dtype: str, device: str, compiled: bool) -> dict:
    from megatrain.config import CaseConfig
    from megatrain.engine.config import EngineConfig
    from megatrain.engine.layout import Unit
    from megatrain.engine.programs import build_program
    from megatrain.models.init import init_param

    dev = torch.device(device)
    model = CaseConfig(system="megatrain", model=shape, num_layers=layers, batch=batch, seq=seq, dtype=dtype,
                       device=device).shape()
    program = build_program(EngineConfig(model=model, batch=batch, micro_batch=batch, seq=seq, dtype=dtype,
                                         device=device, compile=compiled), dev)
    compute = getattr(torch, dtype)
    units = model.unit_shapes()

    def weights(unit) -> dict:
        out = {}
        for name, size in unit.shapes:
            t = torch.empty(size, dtype=torch.float32, device=dev)
            init_param(name, t, seed=0)
            out[name] = t.to(compute)
        return out

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.vocab_size, (batch, seq), generator=gen).to(dev)
    context = program.contexts(None, 1)[0]
    x = program.embed(weights(units[0]), tokens, context)
    rows = []
    for index, unit_shape in enumerate(units[1:1 + layers], start=1):
        params = weights(unit_shape)
        unit = Unit(index, "layer", (), 0, 0, 0)
        t0 = time.perf_counter()
        with torch.no_grad():
            forward = program.layer(unit, params, x, context)
        # the experts each token went to, where the program reports them (the hand-written mixtures of experts)
        routing = forward[-1] if isinstance(forward, tuple) else None
        row = {"layer": index}
        # the recompute free to route anew (the engine before 2026-12-04), and replaying the forward's routing (since)
        for replay in (False, True) if routing is not None else (False,):
            with torch.enable_grad():
                recomputed = program.layer(unit, {n: p.detach().requires_grad_() for n, p in params.items()},
                                           x.detach().requires_grad_(), context, routing if replay else None)
            f, r = program.hidden(forward).float(), program.hidden(recomputed).detach().float()
            per_token = (f - r).abs().amax(-1) / f.abs().amax(-1).clamp_min(1e-30)
            part = {"max_abs_diff": (f - r).abs().max().item(), "tokens": per_token.numel(),
                    "tokens_differing": int((per_token > 0).sum()), "tokens_moved": int((per_token > MOVED).sum()),
                    "largest_token_move": per_token.max().item()}
            if routing is not None:  # tokens whose set of experts differs between the forward and the recompute
                part["tokens_rerouted"] = int((routing.sort(-1).values != recomputed[-1].sort(-1).values)
                                              .any(-1).sum())
            row.update(part if not replay else {f"replayed_{k}": v for k, v in part.items() if k != "tokens"})
        row["seconds"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
        x = program.hidden(forward)
    return {"shape": shape, "layers": layers, "batch": batch, "seq": seq, "dtype": dtype, "device": device,
            "compiled": compiled, "per_layer": rows}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("shape")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--eager-too", action="store_true", help="also eager (forward and recompute: one kernel set)")
    parser.add_argument("--out", help="append each result as a JSON line (with the environment) to this file")
    args = parser.parse_args(argv)
    from megatrain.bench.env import environment
    from megatrain.bench.record import append_jsonl

    for compiled in (True, False) if args.eager_too else (True,):
        result = measure(args.shape, args.layers, args.batch, args.seq, args.dtype, args.device, compiled)
        for row in result["per_layer"]:
            print(f"{args.shape} {'compiled' if compiled else 'eager'} layer {row['layer']}: max |forward - "
                  f"recompute| {row['max_abs_diff']:.3g}, {row['tokens_differing']} of {row['tokens']} tokens differ, "
                  f"{row['tokens_moved']} by > {MOVED:.0%} of their scale (largest {row['largest_token_move']:.3g})"
                  + (f", {row['tokens_rerouted']} rerouted; replaying the forward's routing: "
                     f"{row['replayed_tokens_moved']} moved, {row['replayed_tokens_rerouted']} rerouted (largest "
                     f"{row['replayed_largest_token_move']:.3g})" if "tokens_rerouted" in row else ""), flush=True)
        if args.out:
            append_jsonl(args.out, {**result, "env": environment()})


if __name__ == "__main__":
    main(sys.argv[1:])
