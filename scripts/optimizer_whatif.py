"""Issue 29's question, asked of the performance model before any engine code: at batch 16, streamed, how much of
the exposed host optimizer can AdamW on the GPU for some streamed units hide, against making the same units resident
(the plan's existing answer), and against a faster host kernel?

    python scripts/optimizer_whatif.py OUT.json [--gpu H200] [--host-speedup 1.0 1.5]

The case is the issue's: Qwen2.5-7B width at 14 layers, seq 1024, compiled, bf16 dtype, nothing resident, mixed and
bf16 precision at batch 16 (batch 64 for the ratio). For each, a greedy search adds the unit whose GPU update most
raises the predicted TFLOPS (megatrain.perf_model.model.simulate, plan key gpu_updated_units), then the same units
are made resident instead. Predictions from measured ingredients (results/ingredients), not measurements.
"""

import argparse
import dataclasses
import json
from pathlib import Path

from megatrain.bench.env import environment
from megatrain.config import CaseConfig
from megatrain.engine.layout import build_units
from megatrain.perf_model.model import Machine, Model, simulate
from megatrain.perf_model.model_check import ingredients

STREAMED = {"resident_units": [], "offloaded_layers": 0, "recomputed_inputs": 0}


def case(batch: int, precision: str) -> CaseConfig:
    return CaseConfig(system="megatrain", model="qwen2.5-7b", num_layers=14, batch=batch, seq=1024,
                      precision=precision, dtype="bfloat16", compile=True, device="cuda",
                      options={"resident_layers": 0, "resident_embedding": False})


def greedy_gpu_updated(c: CaseConfig, model: Model) -> tuple[list[int], dict]:
    """Units added one at a time while the predicted TFLOPS rises."""
    chosen, best = [], simulate(c, STREAMED, model)
    units = range(len(build_units(c.shape())))
    while True:
        trials = [(u, simulate(c, {**STREAMED, "gpu_updated_units": chosen + [u]}, model))
                  for u in units if u not in chosen]
        if not trials:
            return chosen, best
        u, p = max(trials, key=lambda t: t[1]["tflops"])
        if p["tflops"] <= best["tflops"]:
            return chosen, best
        chosen, best = chosen + [u], p


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--gpu", default="H200", help="the ingredients' GPU kind (results/ingredients)")
    p.add_argument("--host-speedup", type=float, nargs="+", default=[1.0, 1.5],
                   help="host AdamW kernel rates to try, as multiples of the measured one")
    args = p.parse_args()
    ing = ingredients(args.gpu)
    measured = Machine.from_probe(ing, None, args.gpu)
    rows = []
    for speedup in args.host_speedup:
        machine = dataclasses.replace(measured, host_adamw_gparams_s={
            k: v * speedup for k, v in measured.host_adamw_gparams_s.items()})
        model = Model(ing, machine)
        batch64 = simulate(case(64, "mixed"), STREAMED, model)
        for precision in ("mixed", "bf16"):
            c = case(16, precision)
            streamed = simulate(c, STREAMED, model)
            chosen, gpu = greedy_gpu_updated(c, model)
            resident = simulate(c, {**STREAMED, "resident_units": chosen}, model)
            numel = sum(u.numel for u in build_units(c.shape()) if u.index in chosen)
            row = {"host_speedup": speedup, "precision": precision, "batch": 16, "streamed_tflops": streamed["tflops"],
                   "streamed_exposed": streamed["exposed_s"] / streamed["step_s"],
                   "gpu_updated_units": chosen, "gpu_updated_params": numel, "gpu_updated_tflops": gpu["tflops"],
                   "gpu_updated_exposed": gpu["exposed_s"] / gpu["step_s"], "same_units_resident_tflops":
                   resident["tflops"], "batch64_mixed_tflops": batch64["tflops"],
                   "best_over_batch64": max(gpu["tflops"], resident["tflops"]) / batch64["tflops"]}
            rows.append(row)
            print(f"host x{speedup} {precision} b16: streamed {row['streamed_tflops']:.0f} TFLOPS "
                  f"({row['streamed_exposed']:.0%} exposed); GPU AdamW for units {chosen} ({numel / 1e9:.2f}B) "
                  f"{row['gpu_updated_tflops']:.0f}; the same units resident {row['same_units_resident_tflops']:.0f}; "
                  f"batch 64 mixed {row['batch64_mixed_tflops']:.0f} ({row['best_over_batch64']:.2f}x)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"what": __doc__.split("\n\n")[0], "ingredients": ing.path,
                                    "machine": dataclasses.asdict(measured), "rows": rows, "env": environment()},
                                   indent=1) + "\n")


if __name__ == "__main__":
    main()
