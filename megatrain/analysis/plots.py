"""Figures from the records frame (megatrain.analysis.tables.records_frame), matplotlib Agg, PNG.

Each function writes one figure and returns its path, or None when the records hold nothing to
plot (one model size is not a curve over model size). TFLOPS is the records' 6NT number, except
against context length, where attention dominates: there the hardware count and the paper's.

Every figure draws a system label the same way (label_style): one colour per system, MegaTrain's the one that stands
out and its variants (precision, options) shades of it, the other systems muted; compiled cases hatched (bars) or
dashed (lines), eager ones solid. Every figure is saved through _save, which checks with matplotlib's own text
extents that no two of its texts overlap (overlapping_texts): it turns crowded x tick labels upright, and warns
(LabelOverlap) when texts still overlap.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.layout_engine import ConstrainedLayoutEngine  # noqa: E402
from matplotlib.text import Text  # noqa: E402
from matplotlib.ticker import NullLocator  # noqa: E402

from megatrain.analysis import paper  # noqa: E402
from megatrain.hardware import get_profile  # noqa: E402
from megatrain.systems import SYSTEMS  # noqa: E402

DPI = 110
WIDTH_IN = 10.5  # a full-width figure: at DPI, the report's 1168 px column without scaling
STREAM_ORDER = ("h2d", "compute", "d2h", "optim")

# One colour per system (its registry line, megatrain.systems_registry.SYSTEMS, in the registry's order); a label's
# variant (its precision or options: megatrain-bf16, megatrain-streamed) is a shade of its system's colour, darker
# (< 0) or lighter (> 0), the same in every figure.
OTHER_COLOR = "#8c8c8c"  # a label that names no known system
SYSTEM_COLORS = {system: line.color or OTHER_COLOR for system, line in SYSTEMS.items()}
SYSTEM_MARKERS = {system: line.marker or "v" for system, line in SYSTEMS.items()}
# label prefixes that name a system by its mode (suites' labels: 'fsdp2-offload-accumulate-on-gpu'), tried first
LABEL_PREFIXES = {"fsdp2-offload": "fsdp", "torchao-cpu-offload": "torchao"}
VARIANT_SHADES = {"": 0.0, "bf16": -0.35, "streamed": 0.5, "bf16-streamed": 0.3, "actoffload": -0.6,
                  "superoffload": 0.45, "superoffload-cores50": 0.65, "partial": -0.45, "defaults": 0.5}
UNKNOWN_VARIANT_SHADE = 0.3
COMPILED_SUFFIX = "-compiled"  # megatrain.analysis.tables labels a compiled case so
PAPER_STYLE = {"color": "white", "edgecolor": "black", "hatch": "..", "linewidth": 0.8}  # the paper's bars
STATUS_COLORS = {"ok": "#11772d", "skipped": "#9e9e9e", "oom": "#b3261e", "error": "#a05a00", "timeout": "#a05a00",
                 "killed": "#a05a00", "diverged": "#b3261e"}  # as the report's status cells


def split_label(label: str) -> tuple[str | None, str, bool]:
    """(system, variant, compiled) of a label such as 'megatrain-bf16-streamed-compiled'; system None when the label
    names no known system."""
    compiled = label.endswith(COMPILED_SUFFIX)
    base = label.removesuffix(COMPILED_SUFFIX)
    for prefix, system in (*LABEL_PREFIXES.items(), *((s, s) for s in SYSTEM_COLORS)):
        if base == prefix or base.startswith(prefix + "-"):
            return system, base[len(prefix) + 1:], compiled
    return None, base, compiled


def _shade(color: str, amount: float) -> tuple[float, float, float]:
    """`color` mixed with black (amount < 0) or white (amount > 0) by |amount|."""
    rgb = np.array(to_rgb(color))
    return tuple(rgb * (1 + amount) if amount < 0 else rgb + (1 - rgb) * amount)


def label_style(label: str) -> dict:
    """How `label` is drawn in every figure: color, hatch (bars; None when eager), linestyle and marker (lines)."""
    system, variant, compiled = split_label(label)
    shade = VARIANT_SHADES.get(variant, UNKNOWN_VARIANT_SHADE) if system else 0.0
    return {"color": _shade(SYSTEM_COLORS.get(system, OTHER_COLOR), shade), "hatch": "///" if compiled else None,
            "linestyle": "--" if compiled else "-", "marker": SYSTEM_MARKERS.get(system, "v")}


def ordered_labels(labels) -> list[str]:
    """Labels (or legend entries 'label (note)') in legend order: MegaTrain's first, then the other systems, each
    system's variants in VARIANT_SHADES order, eager before compiled."""
    systems, variants = list(SYSTEM_COLORS), list(VARIANT_SHADES)

    def key(label):  # a legend entry 'label (note)' sorts with its label
        system, variant, compiled = split_label(label.split(" (")[0])
        return (systems.index(system) if system else len(systems),
                variants.index(variant) if variant in variants else len(variants), compiled, label)
    return sorted(set(labels), key=key)


def _bar_style(label: str) -> dict:
    style = label_style(label)
    return {"color": style["color"], "hatch": style["hatch"], "edgecolor": "white", "linewidth": 0}


def _line_style(label: str) -> dict:
    style = label_style(label)
    return {"color": style["color"], "linestyle": style["linestyle"], "marker": style["marker"]}


def model_tick(model: str) -> str:
    """A model as an axis tick: a depth override on a second line ('qwen2.5-1.5b\\n132 layers')."""
    name, _, depth = model.partition("@")
    return f"{name}\n{depth.removesuffix('L')} layers" if depth else name


GAP_PX = 2  # the least space between two texts of a figure


class LabelOverlap(UserWarning):
    """Texts of a saved figure drawn over each other or past its edge (overlapping_texts)."""


def _undrawn_tick_labels(fig) -> set:
    """Tick labels matplotlib keeps but does not draw: those of ticks outside the view, or beyond the current ticks."""
    hidden = set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            transform = axis.get_transform()
            lo, hi = sorted(transform.transform(np.asarray(axis.get_view_interval(), dtype=float)))
            slack = 1e-9 * max(abs(hi - lo), 1.0)
            for locs, ticks in ((axis.get_majorticklocs(), axis.get_major_ticks()),
                                (axis.get_minorticklocs(), axis.get_minor_ticks())):
                for i, tick in enumerate(ticks):
                    at = transform.transform(np.asarray([locs[i]], dtype=float))[0] if i < len(locs) else np.nan
                    if not lo - slack <= at <= hi + slack:
                        hidden.update((tick.label1, tick.label2))
    return hidden


def overlapping_texts(fig) -> list[tuple[Text, Text | None]]:
    """Pairs of drawn, non-empty texts of `fig` (tick labels, titles, axis labels, legends, annotations) whose boxes,
    as matplotlib draws them, come closer than GAP_PX pixels; (text, None) for a text that runs past the figure's
    edge, or an annotation past its axes' frame. Draws the figure."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    hidden = _undrawn_tick_labels(fig)
    texts = [t for t in fig.findobj(Text) if t not in hidden and t.get_visible() and t.get_text().strip()]
    boxes = [t.get_window_extent(renderer).padded(GAP_PX / 2) for t in texts]
    frames = {t: ax.bbox for ax in fig.axes for t in ax.texts}  # annotations stay inside their axes
    found = [(t, None) for t, b in zip(texts, boxes, strict=True)
             if not _inside(t.get_window_extent(renderer), frames.get(t, fig.bbox))]
    for i, a in enumerate(boxes):
        found += [(texts[i], texts[j]) for j in range(i + 1, len(boxes)) if a.overlaps(boxes[j])]
    return found


def _inside(box, frame) -> bool:
    return box.x0 >= frame.x0 - 1 and box.y0 >= frame.y0 - 1 and box.x1 <= frame.x1 + 1 and box.y1 <= frame.y1 + 1


def describe_overlaps(pairs: list[tuple[Text, Text | None]]) -> list[str]:
    return [f"{a.get_text()!r} {'past its frame' if b is None else 'over ' + repr(b.get_text())}" for a, b in pairs]


def _lay_out(fig) -> None:
    """Constrained layout (_figure's) lays a figure out as it draws; any other figure is laid out tight, now."""
    if not isinstance(fig.get_layout_engine(), ConstrainedLayoutEngine):
        fig.tight_layout()


def _save(fig, path: Path) -> Path:
    """Lay out, check the texts (turning crowded x tick labels upright: a text's box, which the check measures, is
    its own only at right angles), write the PNG, close the figure. The check draws the figure at the PNG's DPI; the
    PNG is that drawing (a savefig would draw it once more)."""
    fig.set_dpi(DPI)
    _lay_out(fig)
    crowded = overlapping_texts(fig)
    x_ticks = {t for ax in fig.axes for t in ax.get_xticklabels()}
    if any(a in x_ticks or b in x_ticks for a, b in crowded):
        for ax in fig.axes:
            for t in ax.get_xticklabels():
                t.set_rotation(90)
        _lay_out(fig)
        crowded = overlapping_texts(fig)
    if crowded:
        warnings.warn(LabelOverlap(f"{path.name}: {'; '.join(describe_overlaps(crowded)[:5])}"), stacklevel=2)
    plt.imsave(path, np.asarray(fig.canvas.buffer_rgba()), dpi=DPI)
    plt.close(fig)
    return path


def _figure(nrows: int = 1, ncols: int = 1, width: float = WIDTH_IN, height: float = 4.0, **kw):
    """A figure laid out by matplotlib's constrained layout (legends below the axes find room), axes as a 2-D array."""
    return plt.subplots(nrows, ncols, figsize=(width, height), squeeze=False, layout="constrained", dpi=DPI, **kw)


def _legend_below(fig, axes, ncols: int = 4) -> None:
    """One legend for the figure, below its axes: every label drawn once, in legend order (ordered_labels), in at
    most `ncols` columns, fewer where they would not fit the figure's width."""
    drawn = {}
    for ax in np.ravel(axes):
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            drawn.setdefault(label, handle)
    seen = {label: drawn[label] for label in ordered_labels(drawn)}
    for n in range(min(ncols, len(seen)), 0, -1):
        legend = fig.legend(list(seen.values()), list(seen), loc="outside lower center", ncols=n, fontsize=9,
                            frameon=False)  # its width is its texts' and handles', measured without a drawing
        if n == 1 or legend.get_window_extent(fig.canvas.get_renderer()).width <= fig.bbox.width:
            return
        legend.remove()


def _ok(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["status"] == "ok"]


def _main_seq(df: pd.DataFrame) -> int:
    """The sequence length most cases use (the x-axis of the size and batch plots)."""
    return int(df["seq"].mode().iloc[0])


def _best_per(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """The fastest case (highest TFLOPS) per group of `keys`."""
    return df.loc[df.groupby(keys)["tflops"].idxmax()]


def _by_label(frame: pd.DataFrame):
    """(label, rows) per system label, in legend order."""
    for label in ordered_labels(frame["label"]):
        yield label, frame[frame["label"] == label]


def tflops_vs_model(df: pd.DataFrame, path: Path) -> Path | None:
    """Best TFLOPS (over batch) per system against model size, at the main sequence length."""
    ok = _ok(df)
    ok = ok[ok["seq"] == _main_seq(df)] if len(ok) else ok
    if ok["model"].nunique() < 2:
        return None
    best = _best_per(ok, ["label", "model"])
    fig, axes = _figure(height=4.6 + 0.25 * -(-best["label"].nunique() // 3))  # room for the legend's rows
    ax = axes[0][0]
    for label, g in _by_label(best):
        _size_series(ax, g, "tflops", label)
    _params_axis(ax)
    ax.set(ylabel="TFLOPS (6NT), best batch", title=f"Throughput vs model size (seq {_main_seq(df)})")
    ax.grid(alpha=0.3)
    _legend_below(fig, axes, ncols=3)
    return _save(fig, path)


def _params_axis(ax) -> None:
    """A log axis of parameters in billions, ticked at 1, 2, 5, 10, ... (finer where the range is short) as plain
    numbers."""
    ax.set_xscale("log")
    lo, hi = ax.get_xlim()
    decades = range(int(np.floor(np.log10(lo))), int(np.ceil(np.log10(hi))) + 1)
    for mantissas in ((1, 2, 5), (1, 1.5, 2, 3, 4, 5, 7)):
        ticks = [m * 10 ** e for e in decades for m in mantissas if lo <= m * 10 ** e <= hi]
        if len(ticks) >= 3:
            break
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("parameters (B)")


def _size_series(ax, g: pd.DataFrame, col: str, label: str) -> None:
    """One system against model size: a line through the registry's shapes only; shapes of another depth are
    marked hollow, unjoined (a line between two shapes of different families would read as a trend)."""
    g = g.sort_values("params_b")
    style = _line_style(label)
    registry = g[~g["model"].str.contains("@")]
    if len(registry):
        ax.plot(registry["params_b"], registry[col], label=label, **style)
    other = g[g["model"].str.contains("@")]
    if len(other):
        ax.plot(other["params_b"], other[col], linestyle="none", marker=style["marker"], color=style["color"],
                markerfacecolor="white", label=f"{label} (depth-scaled shapes)")


def _memory_panels(frame: pd.DataFrame, height: float = 4.2, stacked: bool = False):
    """(figure, axes, [(column, title)]) of the memory figures: host peak RSS, and GPU peak first when any case of
    `frame` ran on a GPU; side by side, or `stacked` one above the other at full width."""
    panels = [("peak_host_rss_gib", "host peak RSS (GiB)")]
    if (frame["device"] == "cuda").any():
        panels.insert(0, ("peak_gpu_alloc_gib", "GPU peak allocated (GiB)"))
    if stacked and len(panels) > 1:
        fig, axes = _figure(len(panels), 1, height=height * len(panels))
        return fig, axes.T, panels
    fig, axes = _figure(1, len(panels), width=WIDTH_IN * (1 if len(panels) > 1 else 0.6), height=height)
    return fig, axes, panels


def memory_vs_model(df: pd.DataFrame, path: Path) -> Path | None:
    """Peak host (and, for GPU cases, GPU) memory per system against model size, smallest batch that ran."""
    ok = _ok(df)
    if ok["model"].nunique() < 2:
        return None
    small = ok.loc[ok.groupby(["label", "model"])["batch"].idxmin()]
    fig, axes, panels = _memory_panels(small)
    for ax, (col, title) in zip(axes[0], panels, strict=True):
        for label, g in _by_label(small):
            _size_series(ax, g, col, label)
        _params_axis(ax)
        ax.set(ylabel="GiB", title=f"{title}, smallest batch")
        ax.grid(alpha=0.3)
    _legend_below(fig, axes, ncols=3)
    return _save(fig, path)


def _lines(ax, frame: pd.DataFrame, key: str, value: str, shape: str = "model") -> None:
    """One `value` line against `key` per system label and model `shape` (a column: 'model', or 'model_name' for a
    line across depths), of two points at least; where lines of several shapes are drawn, the legend names the shape
    and the markers of all but the first are hollow."""
    lines = [(label, s, g.sort_values(key)) for label, rows in _by_label(frame) for s, g in rows.groupby(shape)
             if g[key].nunique() >= 2]
    shapes = list(dict.fromkeys(s for _, s, _ in sorted(lines, key=lambda line: line[2]["params_b"].iloc[0])))
    for label, s, g in lines:
        style = _line_style(label)
        if shapes.index(s):
            style["markerfacecolor"] = "white"
        ax.plot(g[key], g[value], label=f"{label} {s}" if len(shapes) > 1 else label, **style)


def _per_model_axes(frame: pd.DataFrame, key: str, height: float = 4.0):
    """(figure, [(axes, model, rows)]): a panel per model with two values of `key` or more, at most three a row."""
    models = [m for m, g in frame.groupby("model") if g[key].nunique() >= 2]
    models.sort(key=lambda m: frame[frame["model"] == m]["params_b"].iloc[0])
    if not models:
        return None, []
    ncols = min(3, len(models))
    nrows = -(-len(models) // ncols)
    fig, axes = _figure(nrows, ncols, width=WIDTH_IN * (1 if ncols > 1 else 0.7), height=height * nrows)
    for ax in axes.ravel()[len(models):]:
        ax.set_visible(False)
    return fig, [(ax, m, frame[frame["model"] == m]) for ax, m in zip(axes.ravel(), models, strict=False)]


def sequence_claims(df: pd.DataFrame) -> list[paper.Claim]:
    """The paper's long-context figures whose case is one of ours but for its sequence length: the same model, depth
    and batch (paper.mismatch)."""
    cases = df[["model_name", "num_layers", "batch"]].drop_duplicates().itertuples(index=False)
    shapes = list(cases)
    return [c for c in paper.CLAIMS if c.flops == paper.WITH_ATTENTION and c.source == paper.PAPER and
            any(paper.mismatch(c, m, layers, c.seq, b) is None for m, layers, b in shapes)]


def tflops_vs_seq(df: pd.DataFrame, path: Path) -> Path | None:
    """Best throughput per system against context length, in two FLOP counts (megatrain.models.flops): what the GPU
    executes (causal attention, the recompute) and the paper's long-context count (6NT plus full-square attention),
    with the paper's own long-context figures on the latter where its case is ours (model and batch)."""
    ok = _ok(df)
    if ok["seq"].nunique() < 2:
        return None
    best = _best_per(ok, ["label", "model", "seq"])
    fig, axes = _figure(1, 2, height=4.2)
    counts = (("hw_tflops", "hardware FLOPs: causal attention, recompute"),
              ("paper_tflops", "the paper's count: 6NT + 12 L H seq per token"))
    for ax, (value, title) in zip(axes[0], counts, strict=True):
        _lines(ax, best, "seq", value)
        ax.set(xlabel="sequence length (tokens)", ylabel="TFLOPS", title=title)
        _seq_axis(ax)
        ax.grid(alpha=0.3)
    claims = sequence_claims(best)
    if claims:
        axes[0][1].plot([c.seq for c in claims], [c.tflops for c in claims], "k^", linestyle="none",
                        label=f"paper: {claims[0].model}, batch {claims[0].batch}, {claims[0].hardware}")
    _legend_below(fig, axes, ncols=3)
    return _save(fig, path)


def seq_tick(seq: int) -> str:
    """A sequence length as people write it: 1k, 512k."""
    return f"{seq // 1024}k" if seq >= 1024 and seq % 1024 == 0 else str(seq)


def _seq_axis(ax, axis: str = "x") -> None:
    """A log-2 sequence-length axis, ticked 1k, 2k, ... (every other power when the range is wide)."""
    target = ax.xaxis if axis == "x" else ax.yaxis
    (ax.set_xscale if axis == "x" else ax.set_yscale)("log", base=2)
    lo, hi = target.get_view_interval()
    powers = range(int(np.floor(np.log2(hi))), int(np.ceil(np.log2(lo))) - 1, -1)  # from the longest down
    ticks = sorted(2 ** p for p in powers[::1 if len(powers) <= 7 else 2])
    (ax.set_xticks if axis == "x" else ax.set_yticks)(ticks, [seq_tick(t) for t in ticks])
    target.set_minor_locator(NullLocator())


def tflops_vs_batch(df: pd.DataFrame, path: Path) -> Path | None:
    """TFLOPS per system against batch size, a panel per model, at the main sequence length."""
    ok = _ok(df)
    ok = ok[ok["seq"] == _main_seq(df)] if len(ok) else ok
    fig, panels = _per_model_axes(ok, "batch")
    if fig is None:
        return None
    for ax, model, g in panels:
        _lines(ax, g.loc[g.groupby(["label", "batch"])["tflops"].idxmax()], "batch", "tflops")
        ax.set_xscale("log", base=2)
        batches = sorted(g["batch"].unique())
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set(xlabel="batch (sequences per step)", ylabel="TFLOPS (6NT)", title=f"{model}, seq {_main_seq(df)}")
        ax.grid(alpha=0.3)
    _legend_below(fig, [ax for ax, _, _ in panels])
    return _save(fig, path)


def traces(rows: pd.DataFrame, results_dir: Path, path: Path) -> Path | None:
    """One row of panels per case: PCIe rx/tx GB/s (or CPU % without a GPU), and memory over time, in the case's
    system colour."""
    loaded = []
    for _, row in rows.iterrows():
        file = results_dir / row["trace_path"] if row["trace_path"] else None
        if file is not None and file.exists():
            loaded.append((row, json.loads(file.read_text())["samples"]))
    if not loaded:
        return None
    fig, axes = _figure(len(loaded), 2, height=2.9 * len(loaded))
    for (row, s), (left, right) in zip(loaded, axes, strict=True):
        name = f"{row['label']}\n{row['model']} b{row['batch']} s{row['seq']}"  # a long label gets a line of its own
        color = label_style(row["label"])["color"]
        if "pcie_rx_gbs" in s:
            left.plot(s["t_s"], s["pcie_rx_gbs"], color=color, label="rx (host to GPU)")
            left.plot(s["t_s"], s["pcie_tx_gbs"], color="black", linewidth=0.8, label="tx (GPU to host)")
            left.set(ylabel="PCIe GB/s")
            left.set_title(f"{name}: PCIe", fontsize=10, loc="left")
            left.legend(fontsize=7, loc="upper right")
        else:
            left.plot(s["t_s"], s["cpu_pct"], color=color)
            left.set(ylabel="CPU %")
            left.set_title(f"{name}: CPU (no GPU counters)", fontsize=10, loc="left")
        right.plot(s["t_s"], s["rss_gib"], color=color, label="host RSS")
        if "gpu_mem_used_gib" in s:
            right.plot(s["t_s"], s["gpu_mem_used_gib"], color="black", linewidth=0.8, label="GPU used")
        right.set(ylabel="GiB")
        right.set_title("memory", fontsize=10, loc="left")
        right.legend(fontsize=7, loc="lower right")
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
    fig, axes = _figure(height=0.7 * len(streams) + 1.9)
    ax = axes[0][0]
    for lane, stream in enumerate(streams):
        for e in events:
            if e["stream"] == stream:
                ax.barh(lane, e["end_ms"] - e["start_ms"], left=e["start_ms"], height=0.6,
                        color=colors[e["phase"]], edgecolor="black", linewidth=0.3)
    ax.set_yticks(range(len(streams)), streams)
    ax.invert_yaxis()
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[p]) for p in phases]
    fig.legend(handles, phases, ncols=len(phases), fontsize=8, loc="outside lower center", frameon=False)
    ax.set(xlabel="ms into the step", title=f"Engine timeline: {record['suite']['label']} {record['model']} "
                                            f"b{record['batch']} s{record['seq']} (one measured step)")
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


def _number(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 10 else f"{value:.2g}" if abs(value) >= 0.01 else f"{value:.1e}"


def grouped_bars(ax, groups: list[tuple[str, dict[str, float]]],
                 extra: dict[int, list[tuple[float, str]]] | None = None, values: bool | None = None) -> dict:
    """Bars in groups: one (tick, {label: value}) per group, the labels present side by side in legend order, each in
    its label_style; `extra` adds, per group index, bars of (value, legend) drawn in PAPER_STYLE after them.
    Values are written over the bars where a bar is wide enough to carry one (`values` None), or when asked.
    Returns each bar by (group index, legend)."""
    extra = extra or {}
    drawn = {}
    widths = [len(bars) + len(extra.get(i, [])) for i, (_, bars) in enumerate(groups)]
    width = 0.8 / max(widths)
    if values is None:
        values = ax.get_window_extent().width * width / len(groups) >= 30  # pixels per bar
    for i, (_, bars) in enumerate(groups):
        entries = [(bars[label], label, _bar_style(label)) for label in ordered_labels(bars)]
        entries += [(value, legend, PAPER_STYLE) for value, legend in extra.get(i, [])]
        for j, (value, legend, style) in enumerate(entries):
            (bar,) = ax.bar(i + (j - (len(entries) - 1) / 2) * width, value, width, label=legend, **style)
            drawn[(i, legend)] = bar
            if values:
                ax.annotate(_number(value), (bar.get_x() + bar.get_width() / 2, value), xytext=(0, 2),
                            textcoords="offset points", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(groups)), [tick for tick, _ in groups])
    ax.set_xlim(-0.5, len(groups) - 0.5)
    ax.margins(y=0.12)
    ax.grid(axis="y", alpha=0.3)
    return drawn


def summary_claims(df: pd.DataFrame) -> dict[tuple[str, int], list[paper.Claim]]:
    """The paper's 6NT figures, per (model, batch) of ours, whose case is ours: same model, depth, sequence and batch
    (paper.mismatch)."""
    found = {}
    for (model, name, layers, seq, batch), _ in df.groupby(["model", "model_name", "num_layers", "seq", "batch"]):
        claims = [c for c in paper.CLAIMS if c.source == paper.PAPER and c.flops == paper.SIX_NT and
                  c.tflops is not None and paper.mismatch(c, name, layers, seq, batch) is None]
        if claims:
            found[(model, batch)] = claims
    return found


def summary_tflops(df: pd.DataFrame, path: Path) -> Path | None:
    """TFLOPS per system at each model and batch, at the main sequence length (a missing bar: that system did not
    run ok there), the paper's own figure beside ours where its case is ours."""
    ok = _ok(df)
    if ok.empty:
        return None
    seq = _main_seq(ok)
    ok = ok[ok["seq"] == seq]
    keys = ok[["params_b", "model", "batch"]].drop_duplicates().sort_values(["params_b", "model", "batch"])
    several_models, several_batches = keys["model"].nunique() > 1, keys["batch"].nunique() > 1
    claims = summary_claims(ok)
    groups, extra = [], {}
    for i, (_, model, batch) in enumerate(keys.itertuples(index=False)):
        rows = ok[(ok["model"] == model) & (ok["batch"] == batch)]
        tick = "\n".join([model_tick(model)] * several_models + [f"batch {batch}"] * (several_batches or
                                                                                    not several_models))
        groups.append((tick, rows.groupby("label")["tflops"].max().to_dict()))  # micro-batch splits: the best
        extra[i] = [(c.tflops, f"the paper: {c.system}, {c.hardware} (same model, seq, batch)")
                    for c in claims.get((model, batch), [])]
    fig, axes = _figure(width=min(WIDTH_IN, max(6.5, 3.2 + 1.1 * sum(len(b) for _, b in groups))), height=4.4)
    ax = axes[0][0]
    grouped_bars(ax, groups, extra)
    title = f"TFLOPS (6NT) per system, seq {seq}" + ("" if several_models else f", {keys['model'].iloc[0]}") + \
        ("" if several_batches else f", batch {keys['batch'].iloc[0]}")
    ax.set(ylabel="TFLOPS (6NT)", title=title)
    _legend_below(fig, axes)
    return _save(fig, path)


def gpus_tick(ranks: int) -> str:
    return f"{ranks} GPU" + ("s" if ranks > 1 else "")


def tflops_vs_gpus(df: pd.DataFrame, path: Path) -> Path | None:
    """TFLOPS (6NT, the whole node's) per system on 1, 2 and 4 GPUs of one host, one panel per session (a host and a
    commit: bars of two sessions are never side by side), model and batch per GPU at the main sequence length (a
    missing bar: that system did not run ok there)."""
    ok = _ok(df)
    if ok.empty:
        return None
    ok = ok[ok["seq"] == _main_seq(ok)].assign(per_gpu_batch=lambda f: f["batch"] // f["ranks"])
    keys = ok[["session", "hardware", "params_b", "model", "per_gpu_batch"]].drop_duplicates().sort_values(
        ["session", "params_b", "model", "per_gpu_batch"], ascending=[False, True, True, True])
    sessions = keys["session"].nunique()
    fig, axes = _figure(ncols=len(keys), width=min(WIDTH_IN, 4.2 * len(keys) + 1), height=4.4 + 0.3 * (sessions > 1))
    for ax, (session, hardware, _, model, per_gpu) in zip(axes[0], keys.itertuples(index=False), strict=True):
        rows = ok[(ok["session"] == session) & (ok["model"] == model) & (ok["per_gpu_batch"] == per_gpu)]
        groups = [(gpus_tick(ranks), g.groupby("label")["tflops"].max().to_dict())
                  for ranks, g in rows.groupby("ranks")]
        grouped_bars(ax, groups)
        title = f"{model}, {per_gpu} sequences per GPU"
        if sessions > 1:
            profile = get_profile(hardware)
            title += f"\n{profile.gpu}s of a {profile.host_mem_gib:.0f} GiB host"
        ax.set(ylabel="TFLOPS (6NT), all GPUs", title=title)
    _legend_below(fig, axes)
    return _save(fig, path)


def summary_memory(df: pd.DataFrame, path: Path) -> Path | None:
    """Peak GPU and host memory per system and model, at the largest batch each system ran ok."""
    ok = _ok(df)
    if ok.empty:
        return None
    ok = ok[ok["seq"] == _main_seq(ok)]
    largest = ok.loc[ok.groupby(["label", "model"])["batch"].idxmax()]
    models = largest[["params_b", "model"]].drop_duplicates().sort_values(["params_b", "model"])["model"]
    fig, axes, panels = _memory_panels(largest, stacked=len(models) > 3)
    for ax, (col, title) in zip(axes[0], panels, strict=True):
        groups = [(model_tick(m), largest[largest["model"] == m].set_index("label")[col].dropna().to_dict())
                  for m in models]
        grouped_bars(ax, groups)
        ax.set(ylabel="GiB", title=f"{title}, each system's largest batch")
    _legend_below(fig, axes)
    return _save(fig, path)
