"""DeepSpeed's step model (megatrain.perf_model.deepspeed) against our DeepSpeed records.

python -m megatrain.perf_model.deepspeed_check [--out results/perf_model]
    Predicts every ok DeepSpeed record on a GPU in results/ (not dev/ nor gpu_checks/) from its case, its probe and
    the ingredients of its GPU kind (the H200's, scaled by the published specs, where its own kind lacks the layer
    shape): deepspeed_validation.csv, one row a record, and deepspeed_validation.json, the summary (errors by mode:
    ZeRO-3 offload, ZeRO-Offload, SuperOffload, partial offload; which ingredient each miss points at, or, where the
    record timed DeepSpeed's forward, backward and step calls, which of them holds the miss; the host time per layer
    call the host-bound records imply; each record's host bytes per parameter against the pre-flight's).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from megatrain.bench.env import environment
from megatrain.hardware import LENT, gpu_kind, specs
from megatrain.perf_model import deepspeed
from megatrain.perf_model.model import Ingredients, Machine, Model
from megatrain.perf_model.model_check import (
    RESULTS,
    generic_path,
    gpu_records,
    ingredients,
    projected_machine,
    record_case,
    write_csv,
)
from megatrain.preflight import PROCESS_OVERHEAD_BYTES
from megatrain.systems.deepspeed_zero3 import memory_bytes

TARGET_PCT = 15.0  # the target for each record
# A record under-predicted by more than the target is host-bound where the host time per layer call its residual
# implies is at least this multiple of the GPU's work per call (ZeRO-3's hooks then set the pace)
HOST_BOUND_RATIO = 1.5


def host_reference() -> dict:
    """The probe of the first ingredient run that measured host memory rates (STREAM) beside its AdamW rates: what a
    record's probe from before those rates stands on (deepspeed.HostStep.from_probe), and the host a machine we
    cannot probe is scaled from."""
    for lent in LENT.values():
        for name in lent.ingredients:
            machine = json.loads((RESULTS / "ingredients" / name).read_text())["machine"]
            if machine.get("host_mem_gbs") and machine.get("engine_adamw_gparams_s"):
                return machine
    raise AssertionError("no ingredient run probed the host's memory rates")


def compiled_layers(r: dict) -> int:
    """How many of the record's layers ran compiled (deepspeed.DYNAMO_RECOMPILE_LIMIT for the old per-layer compile)."""
    case = record_case(r)
    if not case.compile:
        return 0
    layers = case.shape().num_layers
    how = str((r.get("system_config") or {}).get("compile") or "")
    return min(layers, deepspeed.DYNAMO_RECOMPILE_LIMIT) if "each decoder layer's forward" in how else layers


def predict_record(r: dict, bases: dict[str, Ingredients], reference: dict) -> tuple[dict, str]:
    """The model's step of a record, and which ingredients it came from: its GPU kind's, or where they lack its layer
    shape the H200's scaled to its GPU by the published specs (model_check.projected_machine)."""
    probe = (r.get("suite") or {}).get("machine")
    kind = gpu_kind((probe or {}).get("gpu_name") or r["env"].get("gpu"))
    ing = bases[kind]
    probe = probe or ing.machine  # a `bench` record keeps no probe: its kind's rates
    host = deepspeed.HostStep.from_probe(probe, reference)
    case = record_case(r)
    try:
        return deepspeed.step(case, Model(ing, Machine.from_probe(ing, probe, kind)), host, compiled_layers(r)), kind
    except KeyError:
        if kind == "H200":
            raise
    machine = projected_machine(bases["H200"], specs()[LENT[kind].spec], probe)
    return deepspeed.step(case, Model(bases["H200"], machine), host, compiled_layers(r)), f"H200 scaled to {kind}"


def unmodelled(r: dict) -> str | None:
    if (r["config"].get("ranks") or 1) > 1:
        return "several ranks (the model is one GPU's)"
    if r["config"].get("options", {}).get("zenflow"):
        return "ZenFlow"
    return generic_path(r)


def mode(r: dict) -> str:
    """A record's DeepSpeed mode, as the summary groups its errors."""
    o = record_case(r).opts
    base = ("superoffload" if o.super_offload else "partial" if o.optimizer_ratio < 1 else "zenflow" if o.zenflow
            else "zero3" if o.zero_stage == 3 else "zero-offload")
    return base + ("-gpu-params" if o.zero_stage == 3 and not o.offload_param else "")


# a record's phase_times_s (its engine calls) against the model's phases of the same name
PHASE_OF = {"forward": "forward_s", "backward": "backward_s", "step": "optimizer_s"}


def measured_phases(r: dict) -> dict[str, float]:
    """The median over the timed steps of each engine call's seconds a record timed (metrics.phase_times_s); {} for a
    record from before DeepSpeed's calls were timed."""
    times = (r.get("metrics") or {}).get("phase_times_s") or {}
    warmup = r["config"].get("warmup", 0)
    return {phase: statistics.median(v[warmup:] or v) for phase, v in times.items() if v}


def host_bytes_per_param(r: dict) -> float | None:
    """The host bytes per parameter a record measured beyond the process overhead: the node's peak PSS where it was
    traced (every process of the case: SuperOffload's worker too), else the process's peak RSS."""
    peak_gib = (r.get("trace") or {}).get("peak_node_pss_gib") or r.get("peak_host_rss_gib")
    return (peak_gib * 2**30 - PROCESS_OVERHEAD_BYTES) / r["num_params"] if peak_gib else None


def validation_rows() -> list[dict]:
    """One row per ok DeepSpeed record on a GPU: its case, the measured and predicted step and the predicted parts."""
    bases = {k: ingredients(k) for k in LENT}
    reference = host_reference()
    rows = []
    for rel, r in gpu_records("deepspeed"):
        case = record_case(r)
        probe = (r.get("suite") or {}).get("machine") or {}
        row = {"file": rel, "run": (r.get("suite") or {}).get("run_id", ""), "commit": r["env"]["commit"][:7],
               "gpu": gpu_kind(probe.get("gpu_name") or r["env"].get("gpu")), "cpu_cores": probe.get("cpu_cores"),
               "cpu_adamw_gparams_s": probe.get("cpu_adamw_gparams_s"), "model": r["model"],
               "layers": r["num_layers"], "batch": r["batch"], "micro_batch": r["micro_batch"], "seq": r["seq"],
               "zero_stage": case.opts.zero_stage, "mode": mode(r), "compiled_layers": compiled_layers(r),
               "measured_step_s": r["step_time_s"], "measured_min_s": r.get("step_time_min_s"),
               "measured_max_s": r.get("step_time_max_s"), "timed_steps": r.get("timed_steps"),
               "measured_host_bytes_per_param": host_bytes_per_param(r),
               "preflight_host_bytes_per_param": memory_bytes(case)[0] / r["num_params"],
               **{f"measured_{phase}_call_s": v for phase, v in measured_phases(r).items()}}
        if reason := unmodelled(r):
            rows.append({**row, "why": f"not modelled: {reason}"})
            continue
        try:
            p, source = predict_record(r, bases, reference)
        except KeyError as exc:  # a layer shape no GPU kind profiled
            rows.append({**row, "why": f"not predicted: {exc.args[0]}"})
            continue
        calls = r["num_layers"] * (r["batch"] // r["micro_batch"])
        row.update(ingredients=source, predicted_step_s=p["step_s"],
                   error_pct=100 * (p["step_s"] / r["step_time_s"] - 1),
                   **{k: p[k] for k in ("compute_s", "fetch_wait_s", "grad_tail_s", "host_step_s", "adam_s",
                                        "clip_s", "cast_s", "gpu_step_s", "upload_s")},
                   **{f"predicted_{phase}_call_s": p[key] for phase, key in PHASE_OF.items()},
                   layer_call_ms=1e3 * (p["layers_fwd_s"] + p["layers_bwd_s"]) / calls,
                   residual_per_layer_call_ms=1e3 * (r["step_time_s"] - p["step_s"]) / calls)
        rows.append(row)
    for row in rows:
        if "error_pct" in row and abs(row["error_pct"]) > TARGET_PCT:
            row["why"] = why_missed(row, rows)
    return rows


def missed_phase(row: dict) -> str | None:
    """Where a record timed DeepSpeed's calls: the call whose measured time is furthest from the model's, with both
    and the share of the step's miss it holds; None for a record without them."""
    gaps = {phase: row[f"measured_{phase}_call_s"] - row[f"predicted_{phase}_call_s"] for phase in PHASE_OF
            if f"measured_{phase}_call_s" in row}
    if not gaps:
        return None
    phase = max(gaps, key=lambda k: abs(gaps[k]))
    miss = row["measured_step_s"] - row["predicted_step_s"]
    return (f"in its {phase} call: measured {row[f'measured_{phase}_call_s']:.2f} s, modelled "
            f"{row[f'predicted_{phase}_call_s']:.2f} s ({gaps[phase]:+.2f} s of the step's {miss:+.2f} s)")


def why_missed(row: dict, rows: list[dict]) -> str:
    """Which phase holds a miss, where the record timed DeepSpeed's calls; and which ingredient it points at:
    under-predicted, the host side of the step (ZeRO-3's hooks, which no ingredient measures) where it outlasts the
    GPU's work per layer call; over-predicted, the probe's AdamW rate where it sits apart from its host kind's other
    probes."""
    where = missed_phase(row)
    return f"{where}; {_which_ingredient(row, rows)}" if where else _which_ingredient(row, rows)


def _which_ingredient(row: dict, rows: list[dict]) -> str:
    if row["error_pct"] < 0:
        host_ms = row["layer_call_ms"] + row["residual_per_layer_call_ms"]
        if host_ms >= HOST_BOUND_RATIO * row["layer_call_ms"]:
            return (f"host-bound: ZeRO-3's hooks (no ingredient) take ~{host_ms:.0f} ms a layer call, the GPU's work "
                    f"{row['layer_call_ms']:.1f} ms")
        return f"unexplained: {row['residual_per_layer_call_ms']:.0f} ms a layer call beyond the model, not host-bound"
    kind = [x["cpu_adamw_gparams_s"] for x in rows if (x["gpu"], x["cpu_cores"]) == (row["gpu"], row["cpu_cores"])
            and x.get("cpu_adamw_gparams_s")]
    return (f"the probe's AdamW rate, {row['cpu_adamw_gparams_s']:.2f} G params/s (the host step "
            f"{row['host_step_s']:.2f} s), against {statistics.median(kind):.2f} the median of this host kind's probes")


def host_call_ms(rows: list[dict]) -> dict[str, list[float]]:
    """The host's time per layer call (ZeRO-3's hooks) the host-bound records imply, by host kind."""
    out: dict[str, list[float]] = {}
    for x in rows:
        if str(x.get("why", "")).startswith("host-bound"):
            key = f"{x['gpu']} {x['cpu_cores'] or '?'}-core host, {'compiled' if x['compiled_layers'] else 'eager'}"
            out.setdefault(key, []).append(round(x["layer_call_ms"] + x["residual_per_layer_call_ms"], 1))
    return out


def by_mode(rows: list[dict]) -> dict[str, dict]:
    """Per DeepSpeed mode: how many records the model predicts, how many within the target, the median error; and the
    host bytes per parameter the records measured against the pre-flight's (a mode whose records are not yet here is
    absent: its model and memory coefficients await them)."""
    out = {}
    for name in dict.fromkeys(x["mode"] for x in rows):
        mine = [x for x in rows if x["mode"] == name]
        errors = [abs(x["error_pct"]) for x in mine if "error_pct" in x]
        measured = [x["measured_host_bytes_per_param"] for x in mine if x["measured_host_bytes_per_param"]]
        out[name] = {"records": len(mine), "cases": len(errors), "within_target": sum(e <= TARGET_PCT for e in errors),
                     "median_abs_error_pct": statistics.median(errors) if errors else None,
                     "measured_host_bytes_per_param": {"min": round(min(measured), 1),
                                                       "median": round(statistics.median(measured), 1),
                                                       "max": round(max(measured), 1)} if measured else None,
                     "preflight_host_bytes_per_param": sorted({round(x["preflight_host_bytes_per_param"], 1)
                                                               for x in mine})}
    return out


def validate(out: Path) -> dict:
    rows = validation_rows()
    # the measured calls' columns last: a record the model leaves out (Gemma 4's, timed) no longer moves them
    write_csv(out / "deepspeed_validation.csv", rows, last=tuple(f"measured_{phase}_call_s" for phase in PHASE_OF))
    errors = [abs(x["error_pct"]) for x in rows if "error_pct" in x]
    summary = {
        "cases": len(errors), "target_pct": TARGET_PCT, "within_target": sum(e <= TARGET_PCT for e in errors),
        "median_abs_error_pct": statistics.median(errors), "max_abs_error_pct": max(errors),
        "median_error_pct": statistics.median(x["error_pct"] for x in rows if "error_pct" in x),
        "by_mode": by_mode(rows),
        "misses": [f"{x['file']} run {x['run'] or '-'}: {x['model']} L{x['layers']} b{x['batch']}/{x['micro_batch']}"
                   f"{' compiled' if x['compiled_layers'] else ''} ({x['gpu']}, {x['cpu_cores'] or '?'} cores) "
                   f"{x['error_pct']:+.1f}%: {x['why']}" for x in rows if "error_pct" in x and "why" in x],
        "host_call_ms_implied": host_call_ms(rows),
        "not_predicted": [f"{x['file']} {x['model']} b{x['batch']}: {x['why']}" for x in rows if "error_pct" not in x],
        "ingredients": {k: v.path for k, v in ((k, ingredients(k)) for k in LENT) if v},
        "host_reference": {k: host_reference()[k] for k in ("cpu_cores", "cpu_adamw_gparams_s", "host_mem_gbs")},
        "env": environment(),
    }
    (out / "deepspeed_validation.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=RESULTS / "perf_model")
    print(json.dumps(validate(p.parse_args().out), indent=1))


if __name__ == "__main__":
    main()
