"""The performance model against measurement, and ahead of it.

python -m megatrain.perf_model.model_check validate [--out results/perf_model]
    Predicts every engine record on a GPU in results/ (not dev/ nor gpu_checks/) from its case, the placement its
    plan chose (system_config) and its machine's probe, with the ingredients of its GPU kind; writes
    validation.csv and validation.json (the summary: median and largest absolute error). H100 records are also
    predicted from the H200's ingredients scaled by the published specs (the projection method, checked).
python -m megatrain.perf_model.model_check predict SUITE [--only REGEX] --out FILE
    Before a suite runs (on its machine: the plan needs it): the model's step time, TFLOPS and memory for each
    engine case, one JSON line each, stamped with the time, commit and ingredients.
python -m megatrain.perf_model.model_check project [--out results/perf_model]
    The paper's cases on the hardware of megatrain/hardware_specs.toml (published figures), planned for
    that machine's memory: projections.csv.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import re
import statistics
import time
from pathlib import Path

from megatrain.analysis.tables import compiled
from megatrain.bench.env import environment
from megatrain.cli import regex
from megatrain.config import CaseConfig
from megatrain.engine.plan import CheckedPlan, check_fits
from megatrain.hardware import LENT, get_profile, gpu_kind, specs
from megatrain.memory import GIB, Budget
from megatrain.models.flops import model_flops
from megatrain.models.kinds import kind_of
from megatrain.optim.state_bytes import adamw_traffic_bytes_per_param, state_bytes_per_param
from megatrain.perf_model.model import Ingredients, Machine, Model, simulate
from megatrain.systems.megatrain import engine_config
from megatrain.workspace import WORKSPACE

RESULTS = WORKSPACE / "results"
SKIP_DIRS = {"dev", "gpu_checks", "smoke-local", "perf_model", "ingredients"}


def ingredients(kind: str) -> Ingredients | None:
    paths = [RESULTS / "ingredients" / name for name in LENT[kind].ingredients]
    owed = [p for p in (RESULTS / "ingredients" / name for name in LENT[kind].owed) if p.exists()]
    return Ingredients.load(*paths, *owed) if all(p.exists() for p in paths) else None


# Host AdamW on a machine we cannot rent (an assumption, stated in the report): memory-bound at this share of the
# published host memory bandwidth (a typical STREAM share), and no faster per core than the lent host's achieved
# rate; the engine's one-pass kernel moves these bytes per parameter (megatrain.optim.state_bytes: 22 and 28).
HOST_STREAM_SHARE = 0.6
ADAMW_BYTES_PER_PARAM = {p: adamw_traffic_bytes_per_param(state_bytes_per_param(2, p)) for p in ("bf16", "mixed")}


def projected_machine(base: Ingredients, spec: dict, probe: dict | None = None) -> Machine:
    """A machine we have no ingredients of, from the base GPU's ingredients and published figures: matmul time by
    the ratio of dense bf16 rates, the rest of a layer and the GPU AdamW by the ratio of memory bandwidths. With no
    probe of it either: the link at the base's measured share of its nominal rate, the host AdamW as above."""
    ref = specs()[LENT[gpu_kind(base.machine["gpu_name"])].spec]
    machine = Machine.from_probe(base, probe, spec.get("gpu", ""))
    machine.gemm_scale = ref["gpu_bf16_dense_tflops"] / spec["gpu_bf16_dense_tflops"]
    machine.bandwidth_scale = ref["gpu_mem_bw_tbs"] / spec["gpu_mem_bw_tbs"]
    machine.gpu_adamw_gparams_s = {p: r / machine.bandwidth_scale for p, r in machine.gpu_adamw_gparams_s.items()}
    if probe is None:
        link = spec["link_gbs"] / ref["link_gbs"]
        machine.h2d_gbs, machine.d2h_gbs, machine.both_gbs = (getattr(machine, k) * link for k in
                                                              ("h2d_gbs", "d2h_gbs", "both_gbs"))
        rates = {}
        for p, r in base.data["host_adamw_gparams_s"].items():
            per_core = r * ADAMW_BYTES_PER_PARAM[p] / base.machine["cpu_cores"]
            gbs = min(HOST_STREAM_SHARE * spec["host_mem_bw_gbs"], per_core * spec["host_cores"])
            rates[p] = gbs / ADAMW_BYTES_PER_PARAM[p]
        machine.host_adamw_gparams_s = rates
    return machine


def record_plan(r: dict) -> dict:
    """The placement a record ran with (its system_config), for records from before some keys existed."""
    sc = r.get("system_config") or {}
    opts = (r.get("config") or {}).get("options") or {}
    offloaded = sc.get("offloaded_layers")
    if offloaded is None:
        offloaded = r["num_layers"] if opts.get("offload_activations") is True else 0
    return {"resident_units": sc.get("resident_units") or [], "offloaded_layers": offloaded,
            "recomputed_inputs": sc.get("recomputed_inputs") or 0}


def record_case(r: dict) -> CaseConfig:
    """The record's case, with `compile` as it ran (megatrain.analysis.tables.compiled reads records of every age)."""
    cfg = dict(r["config"])
    cfg["options"] = {k: v for k, v in (cfg.get("options") or {}).items() if k != "compile"}  # once an option
    cfg["compile"] = compiled(r)
    return CaseConfig.from_dict(cfg)


def write_csv(path: Path, rows: list[dict], last: tuple[str, ...] = ()) -> None:
    """Rows of differing keys: every key that any row has, in first-seen order, those named in `last` at the end (a
    table's columns stay where they were when a row of another kind comes first)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = [k for k in dict.fromkeys(k for row in rows for k in row) if k not in last]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, keys + [k for k in last if any(k in row for row in rows)])
        w.writeheader()
        w.writerows(rows)


def gpu_records(system: str = "megatrain") -> list[tuple[str, dict]]:
    """(path under results/, record) of every ok record of `system` on a GPU, outside SKIP_DIRS."""
    out = []
    for path in sorted(RESULTS.rglob("*.jsonl")):
        rel = path.relative_to(RESULTS)
        if rel.parts[0] in SKIP_DIRS:
            continue
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if r.get("system") == system and r.get("status") == "ok" and r["config"].get("device") == "cuda":
                out.append((str(rel), r))
    return out


def unmodelled(r: dict) -> str | None:
    """What of a record's case the model leaves out, if anything: compact AdamW moments (the host kernel's rate for
    them is no ingredient), several ranks (the model is one GPU's; the ranks' reduce-scatter and sharded updates are
    no ingredient), a family trained through transformers' modules (its layers are profiled as the hand-written
    ones are not)."""
    if ((r.get("config") or {}).get("optim") or {}).get("moments", "fp32") != "fp32":
        return "compact AdamW moments"
    if (r.get("config") or {}).get("ranks", 1) > 1:
        return "several ranks"
    return generic_path(r)


def generic_path(r: dict) -> str | None:
    """Why a record trained through transformers' own modules is not modelled (by this model and DeepSpeed's), or
    None for a hand-written model."""
    if not kind_of(record_case(r).shape()).profiled:
        return "transformers' own modules (the generic path: no layer profile is an ingredient)"
    return None


def predict_record(r: dict, ing: Ingredients, machine: Machine) -> dict:
    return simulate(record_case(r), record_plan(r), Model(ing, machine))


def validate(out: Path) -> dict:
    bases = {k: ingredients(k) for k in LENT}
    rows = []
    for rel, r in gpu_records():
        probe = (r.get("suite") or {}).get("machine")
        kind = gpu_kind((probe or {}).get("gpu_name") or r["env"].get("gpu"))
        ing = bases.get(kind)
        probe = probe or (ing.machine if ing else None)  # a `bench` record keeps no probe: its kind's rates
        row = {"file": rel, "run": (r.get("suite") or {}).get("run_id", ""), "commit": r["env"]["commit"][:7],
               "gpu": kind, "model": r["model"], "layers": r["num_layers"], "batch": r["batch"],
               "micro_batch": r["micro_batch"], "seq": r["seq"], "precision": r["precision"],
               "compiled": record_case(r).compile, **{k: v for k, v in record_plan(r).items()},
               "measured_step_s": r["step_time_s"], "timed_steps": r.get("timed_steps")}
        row["resident_units"] = len(row["resident_units"])
        if reason := unmodelled(r):
            row["error"] = f"not modelled: {reason}"
            rows.append(row)
            continue
        if ing is None:
            row["error"] = f"no ingredients for {kind}"
            rows.append(row)
            continue
        try:
            p = predict_record(r, ing, Machine.from_probe(ing, probe, kind))
            row.update(predicted_step_s=p["step_s"], error_pct=100 * (p["step_s"] / r["step_time_s"] - 1),
                       predicted_exposed_s=p["exposed_s"], predicted_compute_s=p["compute_s"])
        except KeyError as exc:  # a layer shape not profiled on this GPU (a family's new width): stated, not predicted
            row["error"] = exc.args[0]
        # the projection method: this GPU from the H200's ingredients (which profile more shapes than its own)
        if kind != "H200" and bases.get("H200"):
            spec = specs()[LENT[kind].spec]
            try:
                q = predict_record(r, bases["H200"], projected_machine(bases["H200"], spec, probe))
                row.update(projected_from_h200_s=q["step_s"],
                           projected_error_pct=100 * (q["step_s"] / r["step_time_s"] - 1))
            except KeyError:
                pass
        plan = (r.get("suite") or {}).get("plan") or ((r.get("system_config") or {}).get("plan")) or {}
        if plan.get("host_bytes") and r.get("peak_host_rss_gib"):
            row.update(planned_host_gib=plan["host_bytes"] / GIB, measured_host_gib=r["peak_host_rss_gib"],
                       host_error_pct=100 * (plan["host_bytes"] / GIB / r["peak_host_rss_gib"] - 1))
        if plan.get("gpu_bytes") and r.get("peak_gpu_reserved_gib"):
            row.update(planned_gpu_gib=plan["gpu_bytes"] / GIB, measured_gpu_reserved_gib=r["peak_gpu_reserved_gib"],
                       gpu_error_pct=100 * (plan["gpu_bytes"] / GIB / r["peak_gpu_reserved_gib"] - 1))
        rows.append(row)
    errors = [abs(x["error_pct"]) for x in rows if "error_pct" in x]
    summary = {"cases": len(errors), "median_abs_error_pct": statistics.median(errors),
               "max_abs_error_pct": max(errors), "over_25_pct": sum(e > 25 for e in errors),
               "ingredients": {k: v.path for k, v in bases.items() if v},
               "env": environment()}
    proj = [abs(x["projected_error_pct"]) for x in rows if "projected_error_pct" in x]
    if proj:
        summary.update(projected_cases=len(proj), projected_median_abs_error_pct=statistics.median(proj),
                       projected_max_abs_error_pct=max(proj))
    write_csv(out / "validation.csv", rows)
    (out / "validation.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def predict_suite(suite: str, only: str | None, out: Path) -> list[dict]:
    """The model's numbers for a suite's engine cases on this machine, before they run."""
    from megatrain.bench.suite import load_suite
    from megatrain.probe import measure

    found = measure()
    probe = found.to_dict()
    kind = gpu_kind(probe["gpu_name"])
    ing = ingredients(kind)
    machine = Machine.from_probe(ing, probe, kind)
    limits = Budget.of(probe["host_available_gib"], probe["gpu_mem_gib"])
    rows = []
    for case in load_suite(suite).cases:
        name = f"{case.group} {case.name} {case.case_id}"
        if case.config.system != "megatrain" or (only and not re.search(only, name)) or \
                get_profile(case.hardware).mismatch(found):
            continue
        plan = check_fits(engine_config(case.config), limits)
        row = {"case_id": case.case_id, "name": case.name, "fits": plan.fits, "reason": plan.reason,
               "planned_host_gib": plan.host_need_bytes / GIB, "planned_gpu_gib": plan.gpu_bytes / GIB,
               "resident_units": len(plan.resident_units), "offloaded_layers": plan.offloaded_layers,
               "recomputed_inputs": plan.recomputed_inputs}
        if plan.fits:
            p = simulate(case.config, dataclasses.asdict(plan), Model(ing, machine))
            row.update(predicted_step_s=p["step_s"], predicted_tflops=p["tflops"], predicted_exposed_s=p["exposed_s"])
        rows.append(row)
    out.parent.mkdir(parents=True, exist_ok=True)
    stamp = {"predicted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "ingredients": ing.path,
             "machine": probe, "env": environment()}
    out.write_text("".join(json.dumps({**row, **stamp}) + "\n" for row in rows))
    return rows


# The paper's machines and cases to project (label, model, layers, batch, seq, profile); every case in bf16 precision
# (the paper's layout), seq 1024 unless noted. Batch 96 is the paper's stated batch (its ablation); on 24 GB cards
# the projection takes 16. The paper's 120B is GPT-OSS-120B (a mixture of experts: 117B parameters, 5.1B a token
# uses), projected from its layer and head timed on the lent H200 (results/ingredients/h200-141g-128g-moe.json).
PAPER_CASES = [
    *[(f"GH200 {m}", f"qwen2.5-{m.lower()}", None, 96, 1024, "gh200-96g") for m in ("7B", "14B", "32B")],
    *[(f"GH200 7B depth {d}", "qwen2.5-7b", d, 96, 1024, "gh200-96g") for d in (28, 56, 132, 180)],
    *[(f"GH200 7B {s // 1024}k", "qwen2.5-7b", None, 1, s, "gh200-96g")
      for s in (1024, 8192, 32768, 131072, 262144, 524288)],
    *[(f"H200 1.5 TB {m}", name, None, 96, 1024, "h200-sxm-1.5tb")
      for m, name in (("32B", "qwen2.5-32b"), ("72B", "qwen2.5-72b"), ("GPT-OSS-120B", "gpt-oss-120b"))],
    *[(f"A100 PCIe {m}", f"qwen2.5-{m.lower()}", None, 96, 1024, "a100-pcie-80g") for m in ("7B", "14B", "32B")],
    *[(f"{gpu} {m}", f"qwen2.5-{m.lower()}", None, 16, 1024, profile)
      for gpu, profile in (("RTX 3090", "rtx-3090"), ("RTX 4090", "rtx-4090")) for m in ("3B", "7B", "14B")],
]
PAPER_HARDWARE = {"gh200-96g": "GH200", "a100-pcie-80g": "A100 PCIe", "rtx-3090": "RTX 3090"}


def paper_tflops(model: str, layers: int | None, seq: int, profile: str) -> float | None:
    """The paper's MegaTrain TFLOPS for this case on this machine, where it states one."""
    from megatrain.analysis.paper import CLAIMS

    hw = PAPER_HARDWARE.get(profile)
    return next((c.tflops for c in CLAIMS if hw and c.hardware.startswith(hw) and c.system == "megatrain"
                 and c.model == model and c.seq == seq and c.num_layers in (None, layers)
                 and (c.num_layers is not None) == (layers is not None) and c.batch in (None, 96, 1)), None)


def fitted_plan(case: CaseConfig, limits: Budget) -> tuple[CaseConfig, CheckedPlan]:
    """The engine's plan of `case` on a machine of these limits, the micro-batch halved while the GPU is what does
    not fit (gradient accumulation over smaller micro-batches): the case as planned, and its plan."""
    plan = check_fits(engine_config(case), limits)
    while not plan.fits and case.micro_batch > 1 and plan.host_need_bytes <= limits.host_bytes:
        case = dataclasses.replace(case, micro_batch=case.micro_batch // 2)
        plan = check_fits(engine_config(case), limits)
    return case, plan


def project(out: Path) -> list[dict]:
    base = ingredients("H200")
    rows = []
    precision = "bf16"
    for label, model, layers, batch, seq, profile in PAPER_CASES:
        spec = specs()[profile]
        # the plan places saved inputs (GPU, host, recomputed) as that machine's memory allows; long rows chunk the MLP
        opts = {"offload_activations": "auto", "recompute_inputs": "auto",
                **({"mlp_chunk_tokens": 16384} if seq > 32768 else {})}
        case = CaseConfig(system="megatrain", model=model, num_layers=layers, batch=batch, seq=seq,
                          precision=precision, device="cuda", dtype="bfloat16", compile=True, options=opts)
        case, plan = fitted_plan(case, Budget.of(spec["host_mem_gib"], spec["gpu_mem_gib"], "published"))
        cfg = case.shape()
        row = {"label": label, "profile": profile, "model": model, "layers": cfg.num_layers,
               "params_b": cfg.num_params() / 1e9, "active_params_b": cfg.active_params() / 1e9,
               "batch": batch, "micro_batch": case.micro_batch,
               "seq": seq, "precision": precision, "fits": plan.fits, "reason": plan.reason,
               "planned_host_gib": plan.host_need_bytes / GIB, "planned_gpu_gib": plan.gpu_bytes / GIB,
               "resident_units": len(plan.resident_units), "offloaded_layers": plan.offloaded_layers,
               "recomputed_inputs": plan.recomputed_inputs}
        if plan.fits:
            p = simulate(case, dataclasses.asdict(plan), Model(base, projected_machine(base, spec)))
            # TFLOPS from the parameters a token uses (6 x active x tokens); all experts counted beside, for sources
            # that count that way
            row.update(projected_step_s=p["step_s"], projected_tflops=p["tflops"],
                       projected_tflops_all_experts=model_flops(cfg.num_params(), batch * seq) / p["step_s"] / 1e12,
                       exposed_s=p["exposed_s"], host_opt_s=p["host_opt_s"])
            if seq > 1024:  # the paper's long-context convention (megatrain.models.flops.paper_flops)
                from megatrain.models.flops import paper_flops
                row["projected_paper_tflops"] = paper_flops(cfg, batch, seq) / p["step_s"] / 1e12
        row["paper_tflops"] = paper_tflops(model, layers, seq, profile)
        rows.append(row)
    write_csv(out / "projections.csv", rows)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("validate")
    v.add_argument("--out", type=Path, default=RESULTS / "perf_model")
    s = sub.add_parser("predict")
    s.add_argument("suite")
    s.add_argument("--only", type=regex)
    s.add_argument("--out", type=Path, required=True)
    j = sub.add_parser("project")
    j.add_argument("--out", type=Path, default=RESULTS / "perf_model")
    args = p.parse_args()
    if args.cmd == "validate":
        print(json.dumps(validate(args.out), indent=1))
    elif args.cmd == "predict":
        for row in predict_suite(args.suite, args.only, args.out):
            print(json.dumps(row))
    else:
        for row in project(args.out):
            print(json.dumps(row))


if __name__ == "__main__":
    main()
