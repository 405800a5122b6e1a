"""The scaling report's own sections: the largest model each system trains per host, depth, and the performance
model (its validation against every engine record, and its projections onto the paper's machines).

Read by megatrain.analysis.report for the `scaling` suite. Measured numbers come from the suite's records; the model's
from results/perf_model/ (`python -m megatrain.perf_model.model_check validate|project`), written by the same commit's
code from the committed records and ingredients.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import pandas as pd

from megatrain.analysis import plots
from megatrain.workspace import WORKSPACE

PERF = WORKSPACE / "results" / "perf_model"
BASELINE = "deepspeed-compiled"  # the largest-model ratio is taken against it


def largest_models(scope: pd.DataFrame) -> pd.DataFrame:
    """Per system and host: the largest model that trained (ok) and the first larger one that did not, with why."""
    rows = []
    size = scope[scope["group"].str.startswith("size")]
    for (label, hardware), g in size.groupby(["label", "hardware"]):
        ok = g[g["status"] == "ok"]
        best = ok.loc[ok["params_b"].idxmax()] if len(ok) else None
        above = g[(g["status"] != "ok") & (g["params_b"] > (best["params_b"] if best is not None else 0))]
        fail = above.loc[above["params_b"].idxmin()] if len(above) else None
        rows.append({
            "system": label, "profile": hardware,
            "largest trained": best["model"] if best is not None else None,
            "params (B)": best["params_b"] if best is not None else None,
            "host peak GiB": best["peak_host_rss_gib"] if best is not None else None,
            "host B/param": best["host_bytes_per_param"] if best is not None else None,
            "TFLOPS": best["tflops"] if best is not None else None,
            "next larger": fail["model"] if fail is not None else None,
            "its params (B)": fail["params_b"] if fail is not None else None,
            "status": fail["status"] if fail is not None else None,
            "why": fail["error"] if fail is not None else None,
        })
    df = pd.DataFrame(rows)
    if len(df):
        ref = df.loc[df["system"] == BASELINE, "params (B)"]
        df["x DeepSpeed's largest"] = df["params (B)"] / ref.iloc[0] if len(ref) else None
    return df


def depth_figure(scope: pd.DataFrame, path: Path) -> Path | None:
    """TFLOPS and GPU peak against depth at one width, per system (the depth ladder)."""
    ok = scope[(scope["status"] == "ok") & scope["group"].str.startswith("depth")]
    if ok.empty:
        return None
    fig, axes = plots._figure(1, 2, height=4.2)
    left, right = axes[0]
    plots._lines(left, ok, "num_layers", "tflops", shape="model_name")
    plots._lines(right, ok, "num_layers", "peak_gpu_alloc_gib", shape="model_name")
    width = ok["model_name"].iloc[0]
    left.set(xlabel="decoder layers", ylabel="TFLOPS (6NT)", title=f"Throughput vs depth ({width} width)")
    right.set(xlabel="decoder layers", ylabel="GiB", title="GPU peak allocated vs depth")
    for ax in axes[0]:
        ax.grid(alpha=0.3)
    plots._legend_below(fig, axes, ncols=3)
    return plots._save(fig, path)


def validation_figure(rows: pd.DataFrame, path: Path) -> Path:
    fig, axes = plots._figure(width=plots.WIDTH_IN * 0.6, height=5.2)
    ax = axes[0][0]
    for gpu, g in rows.groupby("gpu"):
        ax.scatter(g["measured_step_s"], g["predicted_step_s"], label=f"{gpu} (its own ingredients)", s=18)
    proj = rows[rows["projected_from_h200_s"].notna()] if "projected_from_h200_s" in rows else rows.iloc[:0]
    if len(proj):
        ax.scatter(proj["measured_step_s"], proj["projected_from_h200_s"], facecolors="none", edgecolors="k", s=30,
                   label="H100 projected from the H200's")
    lo, hi = rows["measured_step_s"].min() * 0.7, rows["measured_step_s"].max() * 1.4
    for k, style in ((1.0, "-"), (1.1, ":"), (0.9, ":"), (1.25, "--"), (0.8, "--")):
        ax.plot([lo, hi], [lo * k, hi * k], color="grey", linestyle=style, linewidth=0.8)
    ax.set(xscale="log", yscale="log", xlabel="measured step (s)", ylabel="predicted step (s)",
           title="Performance model: predicted vs measured\n(lines: equal, +-10%, +-25%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return plots._save(fig, path)


def projection_figure(proj: pd.DataFrame, measured: pd.DataFrame, path: Path) -> Path | None:
    """Per hardware profile, TFLOPS against model size: measured (solid, the lent H200), projected (hollow), the
    paper's (crosses)."""
    short = proj[(proj["seq"] == 1024) & (proj["batch"] > 1) & proj["projected_tflops"].notna()]
    if short.empty:
        return None
    profiles = list(dict.fromkeys(short["profile"]))
    ncols = min(3, len(profiles))
    nrows = -(-len(profiles) // ncols)
    fig, axes = plots._figure(nrows, ncols, height=3.6 * nrows, sharey=True)
    color = plots.label_style("megatrain-bf16")["color"]
    for i, (ax, profile) in enumerate(zip(axes.ravel(), profiles, strict=False)):
        g = short[short["profile"] == profile].sort_values("params_b")
        ax.scatter(g["params_b"], g["projected_tflops"], facecolors="none", edgecolors=color,
                   label="projected (MegaTrain, bf16)")
        paper = g[g["paper_tflops"].notna()]
        ax.scatter(paper["params_b"], paper["paper_tflops"], marker="x", color="black", label="the paper")
        if i == 0 and len(measured):
            ax.scatter(measured["params_b"], measured["tflops"], color=color, s=14, label="measured on the lent H200")
        plots._params_axis(ax)
        ax.set_title(profile)
        ax.grid(alpha=0.3)
    for ax in axes.ravel()[len(profiles):]:
        ax.set_visible(False)
    for row in axes:
        row[0].set_ylabel("TFLOPS (6NT), bf16 precision")
    plots._legend_below(fig, axes, ncols=3)
    return plots._save(fig, path)


def sections(scope: pd.DataFrame, out_dir: Path, html_table, figure_html) -> list[str]:
    parts = ["<h2>Largest model per system</h2>"]
    largest = largest_models(scope)
    parts += [html_table(largest),
              "<p class='muted'>Per system and host: the largest model of the size ladder that trained, and the next "
              "rung with why it did not (a pre-flight refusal with its numbers, or a measured failure). "
              "'x DeepSpeed's largest': params over the largest DeepSpeed ZeRO-3 offload trained on the same host, "
              "both measured.</p>"]
    fig = depth_figure(scope, out_dir / "depth.png")
    if fig:
        parts += ["<h2>Depth</h2>", figure_html(fig, "Depth ladder: TFLOPS and GPU peak against decoder layers. "
                                                "'-streamed': nothing resident on the GPU (the paper's setting); "
                                                "its GPU peak grows only by the saved layer inputs (batch x seq x "
                                                "hidden x 2 bytes per layer).")]
    if (PERF / "validation.csv").exists():
        rows = pd.read_csv(PERF / "validation.csv")
        summary = json.loads((PERF / "validation.json").read_text())
        parts += ["<h2>Performance model: validation</h2>",
                  f"<p>{summary['cases']} engine records on a GPU, each predicted from its case, its plan's "
                  f"placement and its machine's probe with the ingredients of its GPU kind "
                  f"({html.escape(json.dumps(summary['ingredients']))}): median absolute error "
                  f"<b>{summary['median_abs_error_pct']:.1f}%</b>, largest {summary['max_abs_error_pct']:.1f}%, "
                  f"{summary['over_25_pct']} above 25%. H100 records projected from the H200's ingredients and "
                  f"published specs instead: median {summary.get('projected_median_abs_error_pct', float('nan')):.1f}%"
                  f", largest {summary.get('projected_max_abs_error_pct', float('nan')):.1f}%.</p>",
                  figure_html(validation_figure(rows, out_dir / "model_validation.png"),
                              "Every engine record: predicted against measured step time.")]
        cols = ["file", "commit", "gpu", "model", "layers", "batch", "micro_batch", "seq", "precision", "compiled",
                "resident_units", "offloaded_layers", "recomputed_inputs", "measured_step_s", "predicted_step_s",
                "error_pct", "projected_error_pct", "host_error_pct", "gpu_error_pct"]
        parts += [html_table(rows[[c for c in cols if c in rows]].round(3)),
                  "<p class='muted'>error_pct: predicted over measured step time, less 1. host/gpu_error_pct: the "
                  "engine plan's host bytes over measured peak RSS and its GPU bytes over the peak reserved (a "
                  "planning bound, with the working-set margin of megatrain.engine.plan).</p>"]
        ahead = sorted(PERF.glob("predictions-*.jsonl"))
        for path in ahead:
            pred = pd.DataFrame([json.loads(line) for line in path.read_text().splitlines()])
            got = scope.set_index("case_id")
            pred["measured_step_s"] = [got["step_time_s"].get(c) for c in pred["case_id"]]
            pred["measured status"] = [got["status"].get(c) for c in pred["case_id"]]
            pred["error_pct"] = 100 * (pred["predicted_step_s"] / pred["measured_step_s"] - 1)
            parts += [f"<h3>Predicted before running ({html.escape(path.name)}, "
                      f"{html.escape(pred['predicted_at'].iloc[0])}, commit {pred['env'].iloc[0]['commit'][:10]})"
                      "</h3>",
                      html_table(pred[["name", "fits", "predicted_step_s", "measured_step_s", "error_pct",
                                       "planned_gpu_gib", "resident_units", "measured status"]].round(3))]
    if (PERF / "projections.csv").exists():
        proj = pd.read_csv(PERF / "projections.csv")
        measured = scope[(scope["status"] == "ok") & (scope["label"] == "megatrain-bf16-compiled")
                         & scope["group"].str.startswith("size")]
        fig = projection_figure(proj, measured, out_dir / "projections.png")
        precisions = sorted(proj["precision"].unique())  # one: stated here, not repeated per row
        parts += ["<h2>Projected: the paper's machines (not measured)</h2>",
                  figure_html(fig, "Projected (hollow) by the performance model from the lent H200's ingredients "
                                   "and published figures (megatrain/hardware_specs.toml); measured (solid) on "
                                   "the lent H200; the paper's own (crosses).") if fig else "",
                  *_projection_tables((proj.drop(columns="precision") if len(precisions) == 1 else proj).round(2),
                                      html_table),
                  f"<p class='muted'>PROJECTED, not measured, {' and '.join(precisions)} precision. Each case planned "
                  "by the engine's own plan for that machine's memory (placement of saved inputs, resident units, "
                  "micro-batch where the GPU is the limit), then replayed. GPU time: matmul and attention scaled by "
                  "the ratio of dense bf16 rates, the rest by memory bandwidth; link at the lent host's measured "
                  "share of nominal PCIe; host AdamW memory-bound at 60% of the published host bandwidth, no faster "
                  "per core than the lent host's (an assumption, see megatrain.perf_model.model_check). The paper's "
                  "120B is GPT-OSS-120B (a mixture of experts); ours is a dense 120B shape.</p>"]
    return parts


def _projection_tables(proj: pd.DataFrame, html_table) -> list[str]:
    """The projections as two tables that each fit a laptop's width: each case and its plan, then its projected
    speed (the first columns, naming the case, in both)."""
    key = [c for c in ("label", "profile") if c in proj.columns]
    speed = [c for c in proj.columns if c.startswith(("projected", "paper")) or c in ("exposed_s", "host_opt_s")]
    plan = [c for c in proj.columns if c not in speed]
    return [html_table(proj[plan]), html_table(proj[key + [c for c in speed if c not in key]])]

