"""Figures from the records frame (megatrain.analysis.tables.records_frame), matplotlib Agg, PNG.

Each function writes one figure and returns its path, or None when the records hold nothing to
plot (one model size is not a curve over model size). TFLOPS is the records' 6NT number, except
against context length, where attention dominates: there the hardware count and the paper's.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from megatrain.analysis import paper  # noqa: E402

DPI = 110
STREAM_ORDER = ("h2d", "compute", "d2h", "optim")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _ok(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["status"] == "ok"]


def _main_seq(df: pd.DataFrame) -> int:
    """The sequence length most cases use (the x-axis of the size and batch plots)."""
    return int(df["seq"].mode().iloc[0])


def _best_per(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """The fastest case (highest TFLOPS) per group of `keys`."""
    return df.loc[df.groupby(keys)["tflops"].idxmax()]


def tflops_vs_model(df: pd.DataFrame, path: Path) -> Path | None:
    """Best TFLOPS (over batch) per system against model size, at the main sequence length."""
    ok = _ok(df)
    ok = ok[ok["seq"] == _main_seq(df)] if len(ok) else ok
    if ok["model"].nunique() < 2:
        return None
    best = _best_per(ok, ["label", "model"])
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, g in best.groupby("label"):
        _size_series(ax, g, "tflops", label)
    ax.set(xscale="log", xlabel="parameters (B)", ylabel="TFLOPS (6NT), best batch",
           title=f"Throughput vs model size (seq {_main_seq(df)})")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def _size_series(ax, g: pd.DataFrame, col: str, label: str) -> None:
    """One system against model size: a line through the registry's shapes only; shapes of another depth are
    marked, unjoined (a line between two shapes of different families would read as a trend)."""
    g = g.sort_values("params_b")
    registry = g[~g["model"].str.contains("@")]
    (line,) = ax.plot(registry["params_b"], registry[col], marker="o", label=label)
    other = g[g["model"].str.contains("@")]
    if len(other):
        ax.plot(other["params_b"], other[col], marker="s", linestyle="none", color=line.get_color(),
                label=f"{label} (depth-scaled shapes)")


def _memory_panels(frame: pd.DataFrame, panel_width: float):
    """(figure, axes, [(column, title)]) of the memory figures: host peak RSS, and GPU peak first when any case of
    `frame` ran on a GPU."""
    panels = [("peak_host_rss_gib", "host peak RSS (GiB)")]
    if (frame["device"] == "cuda").any():
        panels.insert(0, ("peak_gpu_alloc_gib", "GPU peak allocated (GiB)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(panel_width * len(panels), 4), squeeze=False)
    return fig, axes, panels


def memory_vs_model(df: pd.DataFrame, path: Path) -> Path | None:
    """Peak host (and, for GPU cases, GPU) memory per system against model size, smallest batch that ran."""
    ok = _ok(df)
    if ok["model"].nunique() < 2:
        return None
    small = ok.loc[ok.groupby(["label", "model"])["batch"].idxmin()]
    fig, axes, panels = _memory_panels(small, panel_width=5)
    for ax, (col, title) in zip(axes[0], panels, strict=True):
        for label, g in small.groupby("label"):
            _size_series(ax, g, col, label)
        ax.set(xscale="log", xlabel="parameters (B)", ylabel="GiB", title=title)
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    return _save(fig, path)


def _tflops_lines(ax, frame: pd.DataFrame, key: str, value: str = "tflops") -> None:
    """One `value` line against `key` per system label and model (a model name only when several)."""
    several_models = frame["model"].nunique() > 1
    for (label, model), g in frame.groupby(["label", "model"]):
        if g[key].nunique() < 2:
            continue
        g = g.sort_values(key)
        ax.plot(g[key], g[value], marker="o", label=f"{label} {model}" if several_models else label)


def tflops_vs_seq(df: pd.DataFrame, path: Path) -> Path | None:
    """Best throughput per system and model against context length, in two FLOP counts (megatrain.models.flops): what
    the GPU executes (causal attention, the recompute) and the paper's long-context count (6NT plus full-square
    attention), with the paper's own long-context figures on the latter."""
    ok = _ok(df)
    if ok["seq"].nunique() < 2:
        return None
    best = _best_per(ok, ["label", "model", "seq"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    counts = (("hw_tflops", "hardware FLOPs: causal attention, recompute"),
              ("paper_tflops", "the paper's count: 6NT + 12 L H seq per token"))
    for ax, (value, title) in zip(axes, counts, strict=True):
        _tflops_lines(ax, best, "seq", value)
        ax.set(xlabel="sequence length (tokens)", ylabel="TFLOPS", title=title)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    claims = [c for c in paper.CLAIMS if c.flops == paper.WITH_ATTENTION]
    axes[1].plot([c.seq for c in claims], [c.tflops for c in claims], "k^", linestyle="none",
                 label=f"paper: {claims[0].model}, {claims[0].hardware}")
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    return _save(fig, path)


def tflops_vs_batch(df: pd.DataFrame, path: Path) -> Path | None:
    """TFLOPS per system against batch size, one line per system and model, at the main sequence length."""
    ok = _ok(df)
    ok = ok[ok["seq"] == _main_seq(df)] if len(ok) else ok
    if ok["batch"].nunique() < 2:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    _tflops_lines(ax, ok, "batch")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="batch (sequences per step)", ylabel="TFLOPS (6NT)",
           title=f"Throughput vs batch (seq {_main_seq(df)}); a line ends where the next batch failed")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def traces(rows: pd.DataFrame, results_dir: Path, path: Path) -> Path | None:
    """One row of panels per case: PCIe rx/tx GB/s (or CPU % without a GPU), and memory over time."""
    loaded = []
    for _, row in rows.iterrows():
        file = results_dir / row["trace_path"] if row["trace_path"] else None
        if file is not None and file.exists():
            loaded.append((row, json.loads(file.read_text())["samples"]))
    if not loaded:
        return None
    fig, axes = plt.subplots(len(loaded), 2, figsize=(11, 2.4 * len(loaded)), squeeze=False)
    for (row, s), (left, right) in zip(loaded, axes, strict=True):
        name = f"{row['label']} {row['model']} b{row['batch']} s{row['seq']}"
        if "pcie_rx_gbs" in s:
            left.plot(s["t_s"], s["pcie_rx_gbs"], label="rx (host to GPU)")
            left.plot(s["t_s"], s["pcie_tx_gbs"], label="tx (GPU to host)")
            left.set(ylabel="PCIe GB/s", title=f"{name}: PCIe")
            left.legend(fontsize=7)
        else:
            left.plot(s["t_s"], s["cpu_pct"], color="tab:gray")
            left.set(ylabel="CPU %", title=f"{name}: CPU (no GPU counters)")
        right.plot(s["t_s"], s["rss_gib"], label="host RSS")
        if "gpu_mem_used_gib" in s:
            right.plot(s["t_s"], s["gpu_mem_used_gib"], label="GPU used")
        right.set(ylabel="GiB", title=f"{name}: memory")
        right.legend(fontsize=7)
        for ax in (left, right):
            ax.set_xlabel("seconds since the case started")
            ax.grid(alpha=0.3)
    return _save(fig, path)


def timeline(record: dict, path: Path) -> Path | None:
    """Gantt chart of one measured engine step: a lane per stream, a bar per unit and phase."""
    events = (record.get("metrics") or {}).get("timeline")
    if not events:
        return None
    streams = [s for s in STREAM_ORDER if any(e["stream"] == s for e in events)]
    streams += sorted({e["stream"] for e in events} - set(streams))
    phases = sorted({e["phase"] for e in events})
    colors = dict(zip(phases, plt.get_cmap("tab10").colors, strict=False))
    fig, ax = plt.subplots(figsize=(11, 0.7 * len(streams) + 1.6))
    for lane, stream in enumerate(streams):
        for e in events:
            if e["stream"] == stream:
                ax.barh(lane, e["end_ms"] - e["start_ms"], left=e["start_ms"], height=0.6,
                        color=colors[e["phase"]], edgecolor="black", linewidth=0.3)
    ax.set_yticks(range(len(streams)), streams)
    ax.invert_yaxis()
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[p]) for p in phases]
    ax.legend(handles, phases, ncols=len(phases), fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    ax.set(xlabel="ms into the step", title=f"Engine timeline: {record['suite']['label']} {record['model']} "
                                            f"b{record['batch']} s{record['seq']} (one measured step)")
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


def _bars(ax, frame: pd.DataFrame, x: str, value: str, labels: list[str]) -> None:
    """Grouped bars: one group per value of `x` (in order), one bar per system label, each label the same colour
    in every panel."""
    xs = sorted(frame[x].unique())
    width = 0.8 / len(labels)
    colors = plt.get_cmap("tab10").colors
    for i, label in enumerate(labels):
        g = frame[frame["label"] == label].groupby(x)[value].max()  # several micro-batch splits: the best
        ax.bar([j + (i - (len(labels) - 1) / 2) * width for j in range(len(xs))], [g.get(v, 0) for v in xs], width,
               label=label, color=colors[i % len(colors)])
    ax.set_xticks(range(len(xs)), [str(v) for v in xs])
    ax.grid(axis="y", alpha=0.3)


def summary_tflops(df: pd.DataFrame, path: Path) -> Path | None:
    """TFLOPS per system at each batch, one panel per model, at the main sequence length (a missing bar: that
    system did not run ok at that batch)."""
    ok = _ok(df)
    if ok.empty:
        return None
    ok = ok[ok["seq"] == _main_seq(ok)]
    models = sorted(ok["model"].unique(), key=lambda m: ok[ok["model"] == m]["params_b"].iloc[0])
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        _bars(ax, ok[ok["model"] == model], "batch", "tflops", sorted(ok["label"].unique()))
        ax.set(xlabel="batch (sequences per step)", ylabel="TFLOPS (6NT)", title=f"{model}, seq {_main_seq(ok)}")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    return _save(fig, path)


def summary_memory(df: pd.DataFrame, path: Path) -> Path | None:
    """Peak GPU and host memory per system and model, at the largest batch each system ran ok."""
    ok = _ok(df)
    if ok.empty:
        return None
    ok = ok[ok["seq"] == _main_seq(ok)]
    largest = ok.loc[ok.groupby(["label", "model"])["batch"].idxmax()]
    fig, axes, panels = _memory_panels(largest, panel_width=6)
    for ax, (col, title) in zip(axes[0], panels, strict=True):
        _bars(ax, largest, "model", col, sorted(largest["label"].unique()))
        ax.set(ylabel="GiB", title=f"{title}, each system's largest batch")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    return _save(fig, path)
