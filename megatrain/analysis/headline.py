"""What a suite's report opens with: its question, then one figure and one sentence that answer it from the latest
records, with the paper's figure beside ours only where its case is ours (model, depth, sequence and batch:
megatrain.analysis.paper.mismatch), otherwise named as not comparable, with why.

Each suite declares its question in its TOML, suites/<suite>.toml (the one home of a suite's question):

    [report]
    question = "The longest sequence each system trains on one GPU, and its step time against the paper's."
    headline = "longest_seq"          # the kind of answer: a key of HEADLINES
    paper = ["long context 512k"]     # optional: the paper's figures the question is about (paper.CLAIMS' `what`)
"""

from __future__ import annotations

import html
import json
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from megatrain.analysis import paper, plots, scaling_report, tables
from megatrain.bench.suite import SUITES_DIR
from megatrain.hardware import get_profile
from megatrain.models.registry import MODELS
from megatrain.systems import SYSTEMS

# Systems as a sentence names them (their registry lines); figures and tables use the labels.
SYSTEM_NAMES = {system: line.name or system for system, line in SYSTEMS.items()}
# DeepSpeed's other offload modes, by their label's variant (suites/host_optimizer.toml, reproduce_14b.toml)
DEEPSPEED_MODES = {"zero-offload": "DeepSpeed ZeRO-Offload",
                   "zenflow": "DeepSpeed ZenFlow over ZeRO-Offload (bounded staleness)",
                   "superoffload": "DeepSpeed SuperOffload",
                   "superoffload-cores50": "DeepSpeed SuperOffload (half the cores for its Adam)",
                   "partial": "DeepSpeed partial offload",
                   "partial-gpu-params": "DeepSpeed partial offload with its parameters on the GPU"}
# Those that are AdamW with exact clipping (their records' system_config.exact_adamw), ZeRO-3 offload ('') with them:
# 'DeepSpeed at its best' is the fastest of them measured in the same session, at the same batch and kernels
DEEPSPEED_EXACT = ("", "zero-offload", "superoffload", "superoffload-cores50", "partial", "partial-gpu-params")


# The answer's bold, in the plain text each headline writes; the text is escaped as a whole, its record strings with it
BOLD, END_BOLD = "\u0002", "\u0003"


@dataclass(frozen=True)
class Headline:
    kind: str  # a key of HEADLINES
    question: str
    sentence: str  # HTML: the answer
    figure: Path | None
    caption: str


@dataclass(frozen=True)
class ReportSpec:
    """A suite's [report] table."""

    question: str
    headline: str
    paper: tuple[paper.Claim, ...]


def report_spec(suite: str) -> ReportSpec | None:
    """The [report] table of suites/<suite>.toml; None for a suite without one (or not in suites/). ValueError names
    what to change in a table that is there."""
    path = SUITES_DIR / f"{suite}.toml"
    table = tomllib.loads(path.read_text()).get("report") if path.exists() else None
    if table is None:
        return None
    if not isinstance(table, dict) or set(table) - {"question", "headline", "paper"} \
            or not {"question", "headline"} <= set(table):
        raise ValueError(f"{path}: [report] takes question, headline and optionally paper; got "
                         f"{sorted(table) if isinstance(table, dict) else table!r}"[:200])
    for key, kind, what in (("question", str, "a string"), ("headline", str, "a string"),
                            ("paper", list, "a list of the paper's claims")):
        if not isinstance(table.get(key, []), kind):
            raise ValueError(f"{path}: [report] {key} must be {what}, got {table[key]!r}"[:200])
    if table["headline"] not in HEADLINES:
        raise ValueError(f"{path}: [report] headline {table['headline']!r} is none of {sorted(HEADLINES)}")
    claims = {c.what: c for c in paper.CLAIMS}
    missing = [what for what in table.get("paper", []) if not isinstance(what, str) or what not in claims]
    if missing:
        raise ValueError(f"{path}: [report] paper names no claim of megatrain.analysis.paper: {missing}")
    return ReportSpec(table["question"], table["headline"], tuple(claims[w] for w in table.get("paper", [])))


def headline(suite: str, scope: pd.DataFrame, out_dir: Path) -> Headline | None:
    """The suite's question and its answer from `scope` (the report's latest records); None when the suite declares
    no question."""
    spec = report_spec(suite)
    if spec is None:
        return None
    text, figure, caption = HEADLINES[spec.headline](scope, spec.paper, out_dir / "headline.png")
    sentence = html.escape(text, quote=False).replace(BOLD, "<b>").replace(END_BOLD, "</b>")
    return Headline(spec.headline, spec.question, sentence, figure, caption)


def prose(label: str) -> str:
    """A label as a sentence names it: 'megatrain-bf16-compiled' -> 'MegaTrain (bf16, compiled)'."""
    system, variant, compiled = plots.split_label(label)
    if system is None:
        return label
    name = SYSTEM_NAMES[system]
    if system == "deepspeed" and variant in DEEPSPEED_MODES:  # a mode, not a variant of ZeRO-3 offload
        name, variant = DEEPSPEED_MODES[variant], None
    notes = ", ".join(v for v in (variant, "compiled" if compiled else "") if v)
    return f"{name} ({notes})" if notes else name


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def _machine(rows: pd.DataFrame) -> str:
    """Where `rows` ran, in words: its hardware profile's description ('one H200 141 GB, 128 GiB host')."""
    profile = get_profile(rows["hardware"].iloc[0])
    return profile.description if profile.gpu else f"a CPU (hardware profile {profile.name})"


def commits(rows: pd.DataFrame) -> str:
    """The commits `rows` ran at, short (a session's, in its answer and in RESULTS.md)."""
    return ", ".join(sorted({str(c)[:7] for c in rows["commit"]}))


def _seconds(value: float) -> str:
    return f"{value:,.0f} s" if value >= 10 else f"{value:.2g} s"


def _claim_mismatch(claim: paper.Claim, scope: pd.DataFrame) -> str | None:
    """Why our ok case of the claim's system nearest to its case (the same model and sequence, else the same model)
    is not the claim's case; None when it is."""
    ok = scope[(scope["status"] == "ok") & (scope["system"] == claim.system) & (scope["model_name"] == claim.model)]
    depth = claim.num_layers or MODELS[claim.model].num_layers
    ok = ok[ok["num_layers"] == depth]
    if ok.empty:
        return f"we ran no {claim.system} case of {claim.model} at {depth} layers"
    same_seq = ok[ok["seq"] == claim.seq]
    candidates = same_seq if len(same_seq) else ok
    same_batch = candidates[candidates["batch"] == claim.batch]
    row = (same_batch if len(same_batch) else candidates).sort_values("tflops").iloc[-1]
    return paper.mismatch(claim, row["model_name"], row["num_layers"], row["seq"], row["batch"])


# ---- longest_seq: the longest sequence each system trains ----

@dataclass(frozen=True)
class Longest:
    """One label's longest sequence: the case (None: no length ran ok) and the first longer length that did not run
    ok, with why."""

    label: str
    case: pd.Series | None
    next_seq: int | None
    why: str | None


def _longest(scope: pd.DataFrame) -> list[Longest]:
    out = []
    for label, g in plots._by_label(scope):
        ok = g[g["status"] == "ok"]
        case = ok.loc[ok["seq"].idxmax()] if len(ok) else None
        above = g[(g["status"] != "ok") & (g["seq"] > (case["seq"] if case is not None else 0))]
        fail = above.loc[above["seq"].idxmin()] if len(above) else None
        out.append(Longest(label, case, None if fail is None else int(fail["seq"]),
                           None if fail is None else tables.short_reason(fail["status"], fail["error"])))
    return out


def longest_seq(scope: pd.DataFrame, claims: tuple[paper.Claim, ...], path: Path):
    table = _longest(scope)
    trained = sorted((t for t in table if t.case is not None), key=lambda t: (-t.case["seq"], t.case["step_time_s"]))
    if not trained:
        return f"{BOLD}No system trained any sequence length here.{END_BOLD}", None, ""
    best = trained[0]
    case = best.case
    parts = [f"On {_machine(scope)}, {BOLD}{prose(best.label)} trains the {case['model']} shape at "
             f"{plots.seq_tick(case['seq'])} tokens{END_BOLD} (batch {case['batch']}), {_seconds(case['step_time_s'])} "
             "a step"]
    for claim in claims:
        differs = _claim_mismatch(claim, scope)
        if differs is None:
            parts[-1] += (f", against the paper's {_seconds(paper.step_time_s(claim))} on a {claim.hardware} at the "
                          "same model, sequence and batch")
        else:
            parts.append(f"the paper's {claim.what} ({_seconds(paper.step_time_s(claim))} on a "
                         f"{claim.hardware}) is not comparable: {differs}")
    for other in trained[1:]:
        stop = f" ({plots.seq_tick(other.next_seq)}: {other.why})" if other.next_seq else ""
        parts.append(f"{prose(other.label)} stops at {plots.seq_tick(other.case['seq'])}{stop}")
    none = [t for t in table if t.case is None]
    if none:
        whys = sorted({t.why for t in none if t.why})
        parts.append(f"{_join([prose(t.label) for t in none])} train no length here"
                     f"{f' ({_join(whys)})' if whys else ''}")
    return "; ".join(parts) + ".", _longest_figure(table, best, scope, path), (
        "Left: the longest sequence each system trained, and the first longer one it could not run, with why. "
        "Right: step time against sequence length, log-log; hatched bars and dashed lines: compiled. The paper's "
        "points (triangles) where its case is ours but for the length: its step time as stated at 512k, derived "
        "from its TFLOPS in its own FLOP count elsewhere (megatrain.models.flops.paper_flops).")


def _longest_figure(table: list[Longest], best: Longest, scope: pd.DataFrame, path: Path) -> Path:
    fig, axes = plots._figure(1, 2, height=4.2, width_ratios=(1.6, 1))
    left, right = axes[0]
    floor = 2 ** 9
    top = int(np.log2(max([t.case["seq"] for t in table if t.case is not None] +
                          [t.next_seq for t in table if t.next_seq])))
    left.set_xscale("log", base=2)
    left.set_xlim(floor, 2 ** (top + 4))
    for y, t in enumerate(table):
        failed = f"{plots.seq_tick(t.next_seq)}: {t.why}" if t.next_seq else ""
        if t.case is None:
            end, note = floor, f"none ({failed})" if failed else "none"
        else:
            left.barh(y, t.case["seq"] - floor, left=floor, height=0.6, **plots._bar_style(t.label))
            end, note = t.case["seq"], plots.seq_tick(t.case["seq"]) + (f"\nthen {failed}" if failed else "")
        left.annotate(note, (end, y), xytext=(4, 0), textcoords="offset points", va="center", fontsize=8)
    left.set_yticks(range(len(table)), [t.label for t in table])
    left.set_ylim(len(table) - 0.4, -0.6)
    ticks = [2 ** p for p in range(10, top + 1, 3 if top > 15 else 1)]
    left.set_xticks(ticks, [plots.seq_tick(t) for t in ticks])
    left.xaxis.set_minor_locator(plots.NullLocator())
    left.set(xlabel="sequence length (tokens)", title="The longest sequence each system trained")
    left.grid(axis="x", alpha=0.3)
    ok = scope[scope["status"] == "ok"]
    plots._lines(right, ok.loc[ok.groupby(["label", "seq"])["step_time_s"].idxmin()], "seq", "step_time_s")
    claims = plots.sequence_claims(ok)
    if claims:
        right.plot([c.seq for c in claims], [paper.step_time_s(c) for c in claims], "k^", linestyle="none",
                   label=f"the paper: {claims[0].model}, batch {claims[0].batch}, {claims[0].hardware}")
        last = max(claims, key=lambda c: c.seq)
        right.annotate(f"paper {_seconds(paper.step_time_s(last))}", (last.seq, paper.step_time_s(last)),
                       xytext=(-8, 0), textcoords="offset points", ha="right", va="center", fontsize=8)
    right.annotate(_seconds(best.case["step_time_s"]), (best.case["seq"], best.case["step_time_s"]),
                   xytext=(-8, -2), textcoords="offset points", ha="right", va="top", fontsize=8)
    right.set_yscale("log")
    plots._seq_axis(right)
    right.set(xlabel="sequence length (tokens)", ylabel="seconds per step", title="Step time")
    right.grid(alpha=0.3)
    plots._legend_below(fig, axes, ncols=3)
    return plots._save(fig, path)


# ---- largest_model: the largest model each system trains on the host ----

def largest_model(scope: pd.DataFrame, claims: tuple[paper.Claim, ...], path: Path):
    table = scaling_report.largest_models(scope)
    trained = table[table["params (B)"].notna()] if len(table) else table
    if trained.empty:
        return f"{BOLD}No size ladder trained a model here.{END_BOLD}", None, ""
    order = {label: i for i, label in enumerate(plots.ordered_labels(table["system"]))}
    table = table.sort_values(["profile", "system"], key=lambda c: c.map(order) if c.name == "system" else c)
    parts = []
    for profile, g in table.groupby("profile", sort=False):
        ok = g[g["params (B)"].notna()]
        best = ok.loc[ok["params (B)"].idxmax()]
        same_kernels = ok["system"].map(lambda label: plots.split_label(label)[2]).nunique() == 1
        name = (lambda label: prose(label.removesuffix(plots.COMPILED_SUFFIX))) if same_kernels else prose
        others = [f"{best['params (B)'] / r['params (B)']:.2f}x {name(r['system'])}'s ({r['params (B)']:.1f}B)"
                  for _, r in ok.iterrows() if plots.split_label(r["system"])[0] != "megatrain"]
        stops = sorted({tables.short_reason(r["status"], r["why"]) for _, r in g.iterrows() if r["status"]})
        moments = set(scope[scope["label"] == best["system"]]["moments"].dropna()) - {"fp32"}
        compact = f"; {_join(sorted(moments))} AdamW moments, an option that is not exact AdamW: results/moments" \
            if moments else ""
        parts.append(f"on {get_profile(profile).description}, {BOLD}{name(best['system'])} trains up to "
                     f"{best['params (B)']:.1f}B parameters{END_BOLD} ({best['largest trained']}{compact})"
                     + (f": the largest model, {_join(others)}" if others else "")
                     + (f", every system {_kernels(best['system'])}" if same_kernels else "")
                     + (f"; the next larger rung of each: {_join(stops)}" if stops else ""))
    ran_out = [c for c in paper.CLAIMS if c.source == paper.PAPER and c.tflops is None]
    if ran_out:
        named = _join([f"{SYSTEM_NAMES[c.system]} at {c.model}{f'@{c.num_layers}L' if c.num_layers else ''} on "
                       f"{c.hardware}" for c in ran_out])
        parts.append(f"the paper's limits (out of memory: {named}) are on other machines' memory: not comparable")
    sentence = "; ".join(parts)
    return sentence[0].upper() + sentence[1:] + ".", _largest_figure(table, path), (
        "Each system's size ladder on this host: the largest model that trained (filled, its size and shape "
        "beside its name; hatched: compiled), and the next larger rung (outlined) with why it did not run. A "
        "pre-flight refusal states the memory it needed: see the tables below.")


def _largest_figure(table: pd.DataFrame, path: Path) -> Path:
    several = table["profile"].nunique() > 1
    fig, axes = plots._figure(height=0.6 * len(table) + 1.6)
    ax = axes[0][0]
    ticks = []
    for y, (_, r) in enumerate(table.iterrows()):
        style = plots._bar_style(r["system"])
        trained = "" if pd.isna(r["params (B)"]) else f"\n{r['params (B)']:.1f}B {r['largest trained']}"
        ticks.append((f"{r['system']}\n{r['profile']}" if several else r["system"]) + trained)
        if not pd.isna(r["its params (B)"]):
            ax.barh(y, r["its params (B)"], height=0.6, fill=False, edgecolor=style["color"], linestyle="--")
            ax.annotate(f"next: {r['its params (B)']:.1f}B ({r['next larger']}), "
                        f"{tables.short_reason(r['status'], r['why'])}", (r["its params (B)"], y), xytext=(4, 0),
                        textcoords="offset points", va="center", fontsize=8)
        if not pd.isna(r["params (B)"]):  # its size and shape on its tick: a short bar has no room for them
            ax.barh(y, r["params (B)"], height=0.6, **style)
    ax.set_yticks(range(len(table)), ticks, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, table["its params (B)"].fillna(table["params (B)"]).max() * 1.8)
    ax.set(xlabel="parameters (B)", title="The largest model each system trained on this host")
    ax.grid(axis="x", alpha=0.3)
    return plots._save(fig, path)


# ---- throughput: TFLOPS against the other systems, at equal settings ----

def _over(rows: pd.DataFrame, reference: str) -> pd.DataFrame:
    """Every label's TFLOPS over the reference system's default label (no precision or option variant) at the same
    model, sequence, batch and kernels (both eager or both compiled) in one session; a label with no reference case
    at its kernels gets no ratio: kernels are part of what a system is compared on, never of its ratio."""
    ok = rows[rows["status"] == "ok"]
    out = []
    for (session, model, _, batch), g in ok.groupby(["session", "model", "seq", "batch"]):
        tflops = g.groupby("label")["tflops"].max()
        parts = {label: plots.split_label(label) for label in tflops.index}
        references = {compiled: label for label, (system, variant, compiled) in parts.items()
                      if (system, variant) == (reference, "")}
        for label, (_, _, compiled) in parts.items():
            ref = references.get(compiled)
            if ref is not None and label != ref:
                out.append({"session": session, "model": model, "batch": batch, "compiled": compiled,
                            "label": label, "reference": ref, "ratio": tflops[label] / tflops[ref],
                            "tflops": tflops[label], "reference_tflops": tflops[ref]})
    return pd.DataFrame(out, columns=["session", "model", "batch", "compiled", "label", "reference", "ratio", "tflops",
                                      "reference_tflops"])


def _kernels(label: str) -> str:
    return "compiled" if plots.split_label(label)[2] else "eager"


def _span(ratios: pd.Series) -> str:
    lo, hi = ratios.min(), ratios.max()
    return f"{lo:.2f}x" if np.isclose(lo, hi, rtol=5e-3) else f"{lo:.2f}-{hi:.2f}x"


def _no_ratio(labels: list[str], beside: str) -> list[str]:
    """Clauses for labels that got no ratio, one per kernel setting: `beside` (the reference, as a sentence names it)
    ran no case at their kernels."""
    clauses = []
    for kernels in ("eager", "compiled"):
        named = [prose(label) for label in labels if _kernels(label) == kernels]
        if named:
            has, them = ("has", "it") if len(named) == 1 else ("have", "them")
            clauses.append(f"{_join(named)} {has} no ratio: {beside} ran no {kernels} case beside {them}")
    return clauses


def _unpaired(rows: pd.DataFrame, reference: str, aside: tuple[str, ...] = ()) -> list[str]:
    """The labels with an ok case beside the reference system's default label (same session, model, sequence and
    batch) at a kernel setting it did not run there: no ratio, for the kernels' sake alone. Neither that label nor the
    labels of the systems `aside` are named."""
    ok = rows[rows["status"] == "ok"]
    keys = ["session", "model", "seq", "batch"]
    kernels = ok["label"].map(lambda label: plots.split_label(label)[2])
    is_reference = ok["label"].map(lambda label: plots.split_label(label)[:2] == (reference, ""))
    beside = set(map(tuple, ok[is_reference][keys].to_numpy().tolist()))
    ran = {(*key, compiled) for key, compiled in zip(map(tuple, ok[is_reference][keys].to_numpy().tolist()),
                                                    kernels[is_reference], strict=True)}
    labels = {label for label, key, compiled, ref in zip(ok["label"], map(tuple, ok[keys].to_numpy().tolist()),
                                                         kernels, is_reference, strict=True)
              if key in beside and (*key, compiled) not in ran and not ref
              and plots.split_label(label)[0] not in aside}
    return plots.ordered_labels(labels)


def _broken(rows: pd.DataFrame, ratios: pd.DataFrame) -> str:
    """'; plain PyTorch's compiled layers split by graph breaks (2 at gemma-4-31b@4L)' where a compiled case of the
    ratios, MegaTrain's own or one set against it, ran its layers as more than one graph each: compiled, but not whole
    graphs (MegaTrain's Gemma-4-E4B layers were, in the records of 9c13ec1 and e7dff70)."""
    labels = set(ratios["label"]) | set(ratios["reference"])
    compared = rows[(rows["status"] == "ok") & rows["label"].isin(labels) & (rows["graph_breaks"] > 0)]
    said = [f"{prose(label.removesuffix(plots.COMPILED_SUFFIX))}'s compiled layers split by graph breaks ("
            + ", ".join(f"{int(r['graph_breaks'])} at {r['model']}" for _, r in g.iterrows()) + ")"
            for label, g in compared.groupby("label")]
    return f"; {_join(said)}" if said else ""


def _not_ok(who: str, where: str, status: str, error: str | None) -> str:
    """A case of the answer's that has no ratio, and why: 'the paper's code diverged at batch 64 (loss nan from step
    2 of 5 on; ...)', 'FSDP2 offload did not run batch 96 (oom, host memory)'."""
    if status == tables.DIVERGED:
        return f"{who} diverged at {where} ({error}): no ratio"
    return f"{who} did not run {where} ({tables.short_reason(status, error)})"


def _papers_ratio(claim: paper.Claim) -> str:
    """A published figure of another system as the paper's own: with its MegaTrain counterpart, the ratio it states."""
    mine = paper.counterpart(claim)
    theirs = f"{SYSTEM_NAMES[claim.system]} " + (f"{claim.tflops:g} TFLOPS" if claim.tflops else "out of memory")
    if mine and mine.tflops and claim.tflops:
        return f"{mine.tflops / claim.tflops:.2f}x (MegaTrain {mine.tflops:g} against {theirs}, {claim.hardware})"
    return f"{theirs} ({claim.hardware})"


def throughput(scope: pd.DataFrame, claims: tuple[paper.Claim, ...], path: Path):
    """The latest session's answer and figure; then, for the models it did not run, each one's latest session's
    answer (a suite whose sessions ran other models: families' Llama and Qwen shapes on one machine, Gemma 4 on
    another), newest first. Every ratio stays within one session."""
    newest = scope.groupby("model_name")["session"].transform("max")  # a model at any depth
    sessions = sorted(scope.loc[scope["session"] == newest, "session"].unique(), reverse=True)
    text, figure, caption = _throughput(scope[scope["session"] == sessions[0]], scope, claims, path)
    for older in sessions[1:]:
        models = scope.loc[(scope["session"] == older) & (newest == older), "model_name"].unique()
        more, _, _ = _throughput(scope[(scope["session"] == older) & scope["model_name"].isin(models)], scope, (), None)
        text += " " + more
    return text, figure, caption


def _throughput(session: pd.DataFrame, scope: pd.DataFrame, claims: tuple[paper.Claim, ...], path: Path | None):
    ok = session[session["status"] == "ok"]
    figure = plots.summary_tflops(session, path) if path is not None else None
    if ok.empty:
        return f"{BOLD}No case ran ok in the latest session.{END_BOLD}", figure, ""
    seq = plots._main_seq(ok)
    at_seq = session[session["seq"] == seq]
    pairs = _over(at_seq, "megatrain")
    ratios = pairs[pairs["label"].map(lambda label: plots.split_label(label)[0]) != "megatrain"]
    # where MegaTrain ran beside another system; the models only one system ran (a depth ladder's) are said apart
    side_by_side = ok[ok["model"].isin(ratios["model"])] if not ratios.empty else ok
    models = sorted(side_by_side["model"].unique(),
                    key=lambda m: side_by_side[side_by_side["model"] == m]["params_b"].iloc[0])
    batches = sorted(side_by_side[side_by_side["seq"] == seq]["batch"].unique())
    where = (f"{_join(models)}, seq {seq}, batch " +
             (str(batches[0]) if len(batches) == 1 else f"{batches[0]} to {batches[-1]}"))
    if ratios.empty:
        top = ok.loc[ok["tflops"].idxmax()]
        parts = [f"On {_machine(session)}, at {where}, {BOLD}{prose(top['label'])} runs {top['tflops']:.0f} "
                 f"TFLOPS{END_BOLD}"]
    else:
        said = []
        for other in plots.ordered_labels(ratios["label"].str.removesuffix(plots.COMPILED_SUFFIX)):
            mine = 1 / ratios[ratios["label"].str.removesuffix(plots.COMPILED_SUFFIX) == other]["ratio"]
            said.append(f"{_span(mine)} as fast as {prose(other)}")
        settings = sorted({_kernels(label) for label in ratios["reference"]})
        parts = [f"On {_machine(session)}, at {where}, {BOLD}MegaTrain trains {_join(said)}{END_BOLD} "
                 f"(TFLOPS at equal batch and kernels, {' and '.join(settings)})"]
        parts[-1] += _broken(at_seq, ratios)
        cases = ratios.drop_duplicates(["model", "batch", "reference"])
        if len(cases) > 1:
            top = cases.loc[cases["reference_tflops"].idxmax()]
            parts[-1] += f"; its best, {top['reference_tflops']:.0f} TFLOPS ({top['model']}, batch {top['batch']}, " \
                         f"{_kernels(top['reference'])})"
        best = _deepspeed_best(at_seq)
        if len(best):
            parts.append(f"against DeepSpeed at its best (the fastest of its exact modes here), "
                         f"{BOLD}{_against_best(best)}{END_BOLD}")
        # MegaTrain's variants compare to none
        parts += _no_ratio(_unpaired(at_seq, "megatrain", aside=("megatrain",)), "MegaTrain")
        failed = at_seq[(at_seq["status"] != "ok") & (at_seq["system"] != "megatrain")]
        for (label, model, batch), g in failed.groupby(["label", "model", "batch"]):
            if plots.split_label(label)[2] and label.removesuffix(plots.COMPILED_SUFFIX) in set(failed["label"]):
                continue  # said once for its eager and compiled cases
            parts.append(_not_ok(prose(label.removesuffix(plots.COMPILED_SUFFIX)), f"{model} at batch {batch}",
                                 g["status"].iloc[0], g["error"].iloc[0]))
        if deepest := _deepest(session[~session["model"].isin(ratios["model"])]):
            parts.append(f"the deepest each trained here: {deepest}")
    for claim in claims:
        differs = _claim_mismatch(claim, scope)
        verdict = "the same case as ours" if differs is None else f"not comparable: {differs}"
        parts.append(f"the paper's {_papers_ratio(claim)} is {verdict}")
    comparable = plots.summary_claims(ok[ok["seq"] == seq])
    caption = ("TFLOPS (6NT) of each system at each model and batch in the latest session; hatched: compiled. "
               + ("The paper's own figure (dotted white) stands beside ours where its case is ours: same model, "
                  "sequence and batch, on its hardware." if comparable else
                  "No figure of the paper is of the same model, sequence and batch as these cases."))
    return "; ".join(parts) + ".", figure, caption


def _deepest(ladders: pd.DataFrame) -> str:
    """Per model and label of a session's depth ladders: the most layers that ran ok (total parameters), and whether
    a deeper rung failed (the limit found) or every rung ran (a lower bound)."""
    said = []
    for (model, label), g in ladders.groupby(["model_name", "label"], sort=False):
        ran = g[g["status"] == "ok"]
        if ran.empty:
            continue
        top = ran.loc[ran["num_layers"].idxmax()]
        beyond = g[(g["num_layers"] > top["num_layers"]) & (g["status"] != "ok")]
        first = beyond.loc[beyond["num_layers"].idxmin()] if not beyond.empty else None
        limit = "; every rung ran" if first is None else \
            f"; {int(first['num_layers'])} {tables.short_reason(first['status'], first['error'])}"
        said.append(f"{prose(label)} {model} {int(top['num_layers'])} layers ({top['params_b']:.1f}B{limit})")
    return _join(said) if said else ""


# ---- over_deepspeed: each system's speed over DeepSpeed ZeRO-3 offload's at equal kernels, the paper's as its own ----

# Where the answer finds the model of DeepSpeed's step projected onto the paper's machine (megatrain.perf_model)
DEEPSPEED_PROJECTION = scaling_report.PERF / "deepspeed_projection.json"


def _papers_batch(claims: tuple[paper.Claim, ...]) -> int | None:
    """The batch the paper ran its claims' case at: stated with the claim, else with its MegaTrain ablation of the
    same model on the same machine (the 14B's batch 96)."""
    for claim in claims:
        if claim.batch:
            return claim.batch
        same = [c.batch for c in paper.CLAIMS if c.batch and c.system == "megatrain" and c.source == claim.source
                and (c.model, c.seq, c.hardware) == (claim.model, claim.seq, claim.hardware)]
        if same:
            return same[0]
    return None


def _depth(rows: pd.DataFrame) -> tuple[int, int]:
    """(layers, the model's full depth) of a session's rows."""
    row = rows.iloc[0]
    return int(row["num_layers"]), MODELS[row["model_name"]].num_layers


def _depth_phrase(rows: pd.DataFrame) -> str:
    layers, full = _depth(rows)
    return f"full depth ({full} layers)" if layers == full else f"{layers} of its {full} layers"


def _residency(rows: pd.DataFrame) -> str:
    """A cut session where MegaTrain's plan held every layer on the GPU, said so: its ratio there is not the streaming
    engine's (DeepSpeed ZeRO-3 offload streams every layer at any depth); '' where its plan streamed some, or where
    the session also ran it streamed (its own label, beside)."""
    layers, full = _depth(rows)
    mine = rows[(rows["system"] == "megatrain") & (rows["status"] == "ok")]
    planned = mine[mine["label"].map(_is_default)]
    if layers == full or planned.empty or int(planned["resident_layers"].min()) < layers:
        return ""
    streamed = (mine["resident_layers"] == 0).any()
    return (f"; there MegaTrain's plan keeps and updates all {layers} layers on the GPU, streaming none" +
            (", its streamed runs beside" if streamed else ", so its ratio is not the streaming engine's"))


def _streamed_elsewhere(scope: pd.DataFrame, rows: pd.DataFrame) -> str:
    """For a session whose MegaTrain plan streamed no layer (_residency): the latest other session on the same kind
    of machine that ran MegaTrain at that depth streaming every layer, its TFLOPS per kernel setting and batch, with
    no ratio (DeepSpeed did not run in it); '' where none did."""
    first = rows.fillna({"host_kind": "", "gpu": ""}).iloc[0]
    streamed = scope[(scope["system"] == "megatrain") & (scope["status"] == "ok") & (scope["resident_layers"] == 0)
                     & (scope["num_layers"] == first["num_layers"])
                     & (scope["host_kind"].fillna("") == first["host_kind"]) & (scope["gpu"].fillna("") == first["gpu"])
                     & (scope["session"] != first["session"])]
    if streamed.empty:
        return ""
    latest = streamed[streamed["session"] == streamed["session"].max()]
    said = []
    for compiled, g in latest.groupby("compile"):  # eager first
        g = g.sort_values("batch", ascending=False).drop_duplicates("batch")
        said.append(f"{'compiled' if compiled else 'eager'} {' and '.join(f'{t:.0f}' for t in g['tflops'])} TFLOPS "
                    f"at batch {' and '.join(str(b) for b in g['batch'])}")
    return (f"MegaTrain streaming every one of those layers (resident_layers=0; session {latest['session'].iloc[0]}, "
            f"commit {str(latest['commit'].iloc[0])[:7]}, no DeepSpeed beside it, so no ratio): {'; '.join(said)}")


def _ratios_at(pairs: pd.DataFrame, batch: int) -> str:
    """Each label's ratio at one batch, per kernel setting: 'eager, MegaTrain 1.25x and FSDP2 offload 0.92x;
    compiled, MegaTrain 1.36x'."""
    said = []
    for compiled, g in pairs[pairs["batch"] == batch].groupby("compiled"):  # eager first
        figures = [f"{prose(label.removesuffix(plots.COMPILED_SUFFIX))} {g[g['label'] == label]['ratio'].iloc[0]:.2f}x"
                   for label in plots.ordered_labels(g["label"])]
        said.append(f"{'compiled' if compiled else 'eager'}, {_join(figures)}")
    return "; ".join(said)


def _over_batch(pairs: pd.DataFrame) -> str:
    """Each label's ratio at each batch it ran beside DeepSpeed, per kernel setting: 'eager, MegaTrain 2.34x at 16 to
    1.21x at 96 (2.34x, 1.60x, 1.21x at 16, 64, 96)'."""
    said = []
    for compiled, g in pairs.groupby("compiled"):
        figures = []
        for label in plots.ordered_labels(g["label"]):
            rows = g[g["label"] == label].sort_values("batch")
            if len(rows) < 2:
                continue
            ratios = ", ".join(f"{r:.2f}x" for r in rows["ratio"])
            figures.append(f"{prose(label.removesuffix(plots.COMPILED_SUFFIX))} {ratios} at batch "
                           f"{', '.join(str(b) for b in rows['batch'])}")
        if figures:
            said.append(f"{'compiled' if compiled else 'eager'}, {_join(figures)}")
    return "; ".join(said)


def _deepspeed_best(rows: pd.DataFrame) -> pd.DataFrame:
    """Per session, model, batch and kernel setting where DeepSpeed ran a mode beyond ZeRO-3 offload beside it and
    MegaTrain's default label: MegaTrain's TFLOPS, DeepSpeed's as the paper ran it (ZeRO-3 offload), and its best (the
    fastest of its exact modes, DEEPSPEED_EXACT), with the optimizer step call each timed (DeepSpeed's records)."""
    ok = rows[rows["status"] == "ok"]
    out = []
    for (session, model, batch), g in ok.groupby(["session", "model", "batch"]):
        best_of = g.sort_values("tflops").drop_duplicates("label", keep="last").set_index("label")
        for compiled in (False, True):
            parts = {label: plots.split_label(label) for label in best_of.index}
            exact = [label for label, (system, variant, c) in parts.items()
                     if c == compiled and system == "deepspeed" and variant in DEEPSPEED_EXACT]
            paper_ds = [label for label in exact if parts[label][1] == ""]
            mine = [label for label, (system, variant, c) in parts.items()
                    if c == compiled and (system, variant) == ("megatrain", "")]
            if not (paper_ds and mine and len(exact) > 1):
                continue
            best = max(exact, key=lambda label: best_of.loc[label, "tflops"])
            streamed = [label for label, (system, variant, c) in parts.items()
                        if c == compiled and (system, variant) == ("megatrain", "streamed")]
            out.append({"session": session, "model": model, "batch": batch, "compiled": compiled,
                        "megatrain": best_of.loc[mine[0], "tflops"], "paper_ds": best_of.loc[paper_ds[0], "tflops"],
                        "modes": {label: best_of.loc[label, "tflops"] for label in exact if label != paper_ds[0]},
                        "streamed": best_of.loc[streamed[0], "tflops"] if streamed else float("nan"),
                        "best": best, "best_tflops": best_of.loc[best, "tflops"],
                        "best_step_s": best_of.loc[best, "step_time_s"],
                        "best_optimizer_call_s": best_of.loc[best, "optimizer_call_s"],
                        "paper_ds_optimizer_call_s": best_of.loc[paper_ds[0], "optimizer_call_s"],
                        "megatrain_exposed_optim": best_of.loc[mine[0], "exposed_optim_frac"]})
    return pd.DataFrame(out, columns=["session", "model", "batch", "compiled", "megatrain", "paper_ds", "modes",
                                      "streamed", "best", "best_tflops", "best_step_s", "best_optimizer_call_s",
                                      "paper_ds_optimizer_call_s", "megatrain_exposed_optim"])


def _best_mode(label: str) -> str:
    """DeepSpeed's mode of a label, as the clause names it: 'SuperOffload', 'ZeRO-3 offload itself'."""
    variant = plots.split_label(label)[1]
    return DEEPSPEED_MODES[variant].removeprefix("DeepSpeed ") if variant else "ZeRO-3 offload itself"


def _against_best(best: pd.DataFrame) -> str:
    """MegaTrain over DeepSpeed as the paper ran it and at its best, per batch and kernel setting of one session's
    _deepspeed_best rows, each other exact mode of DeepSpeed against ZeRO-3 offload and MegaTrain streaming every
    layer (resident_layers=0) beside them where it ran; where DeepSpeed at its best wins, that it does and why, from
    the records: its optimizer step call against ZeRO-3 offload's, MegaTrain's exposed host optimizer."""
    said, several = [], best["model"].nunique() > 1
    for (model, batch, compiled), g in best.groupby(["model", "batch", "compiled"]):
        row = g.iloc[0]
        over_paper, over_best = row["megatrain"] / row["paper_ds"], row["megatrain"] / row["best_tflops"]
        clause = (f"{f'{model} ' if several else ''}batch {batch} {'compiled' if compiled else 'eager'}: MegaTrain "
                  f"{over_paper:.2f}x DeepSpeed as the paper ran it, {over_best:.2f}x DeepSpeed at its best "
                  f"({_best_mode(row['best'])}; over ZeRO-3 offload, "
                  + ", ".join(f"{_best_mode(label)} {tflops / row['paper_ds']:.2f}x"
                              for label, tflops in sorted(row["modes"].items(), key=lambda m: -m[1])) + ")")
        if not pd.isna(row["streamed"]):
            clause += f", MegaTrain streaming every layer {row['streamed'] / row['paper_ds']:.2f}x"
        if over_best < 1:
            why = []
            if not pd.isna(row["best_optimizer_call_s"]) and not pd.isna(row["paper_ds_optimizer_call_s"]):
                why.append(f"its optimizer step call takes {row['best_optimizer_call_s']:.2f} s of its "
                           f"{row['best_step_s']:.2f} s step, ZeRO-3 offload's "
                           f"{row['paper_ds_optimizer_call_s']:.2f} s")
            if not pd.isna(row["megatrain_exposed_optim"]):
                why.append(f"MegaTrain's host optimizer is exposed for {row['megatrain_exposed_optim']:.0%} of its "
                           "step")
            clause += "; DeepSpeed at its best wins here" + (f": {', '.join(why)}" if why else "")
        said.append(clause)
    return "; ".join(said)


def _why(projection_path: Path) -> str | None:
    """A sentence: what the model of DeepSpeed's step says of the paper's ratio, where perf_model wrote its projection,
    and how well it predicts our DeepSpeed records, where its validation is beside it."""
    if not projection_path.exists():
        return None
    answer = json.loads(projection_path.read_text()).get("answer")
    if not answer:
        return None
    checked = projection_path.with_name("deepspeed_validation.json")
    how_well = ""
    if checked.exists():
        v = json.loads(checked.read_text())
        how_well = f" (within {v['target_pct']:g}% of {v['within_target']} of our {v['cases']} DeepSpeed records, " \
                   f"median error {v['median_abs_error_pct']:.1f}%: {checked.name})"
    return f"The model of DeepSpeed's step{how_well}, of the paper's ratio: {answer.rstrip('.')}."


def over_deepspeed(scope: pd.DataFrame, claims: tuple[paper.Claim, ...], path: Path,
                   projection_path: Path = DEEPSPEED_PROJECTION):
    """The paper's headline question: every system's TFLOPS over DeepSpeed ZeRO-3 offload's at the same model, batch
    and kernels, one kernel setting at a time. It opens with the deepest session that ran beside DeepSpeed at the
    paper's batch (a full-depth record supersedes a cut one; the latest of equals), then the ratio over batch from the
    deepest session that ran several batches, then why the paper's ratio differs (the DeepSpeed step model's
    projection, where perf_model wrote one), then what did not run in the opening session, and the paper's own
    figure as the paper's."""
    ok = scope[scope["status"] == "ok"]
    if ok.empty:
        return f"{BOLD}No case ran ok in the records.{END_BOLD}", None, ""
    seq = plots._main_seq(ok)
    at_seq = scope[scope["seq"] == seq]
    pairs = _over(at_seq, "deepspeed")
    papers_batch = _papers_batch(claims)
    if pairs.empty:
        session = at_seq[at_seq["session"] == at_seq["session"].max()]
        ran = _join([prose(label) for label in plots.ordered_labels(session[session["status"] == "ok"]["label"])])
        parts = [f"On {_machine(session)}, at {_join(sorted(session['model'].unique()))}, seq {seq}, {BOLD}no system "
                 f"ran beside DeepSpeed ZeRO-3 offload at the same batch and kernels{END_BOLD} in the latest session "
                 f"({ran} ran): no ratio to it is stated"]
    else:
        def rank(name):  # deepest first, then at the paper's batch, then the latest
            rows = at_seq[at_seq["session"] == name]
            layers, full = _depth(rows)
            return (layers / full, papers_batch in set(pairs[pairs["session"] == name]["batch"]), name)
        name = max(pairs["session"].unique(), key=rank)
        session, mine = at_seq[at_seq["session"] == name], pairs[pairs["session"] == name]
        batch = papers_batch if papers_batch in set(mine["batch"]) else int(mine["batch"].max())
        which = "the paper's" if batch == papers_batch else \
            f"the largest beside DeepSpeed here; the paper's {papers_batch} did not run beside it"
        model = session["model_name"].iloc[0]
        parts = [f"At batch {batch} ({which}), {model} at {_depth_phrase(session)}, seq {seq}, on {_machine(session)}"
                 f"{_residency(session)}, "
                 f"each system's TFLOPS over DeepSpeed ZeRO-3 offload's at the same kernels: "
                 f"{BOLD}{_ratios_at(mine, batch)}{END_BOLD}"]
        several = [n for n in pairs["session"].unique() if pairs[pairs["session"] == n]["batch"].nunique() > 1]
        if several:
            other = max(several, key=rank)
            rows = at_seq[at_seq["session"] == other]
            residency = _residency(rows)
            where = "" if other == name else f" ({_depth_phrase(rows)}, on {_machine(rows)}{residency})"
            parts.append(f"over batch{where}: {_over_batch(pairs[pairs['session'] == other])}")
            if residency and (streamed := _streamed_elsewhere(at_seq, rows)):
                parts.append(streamed)
        else:
            parts.append("no session has yet run more than one batch beside DeepSpeed: the ratio over batch is not "
                         "measured")
        best = _deepspeed_best(at_seq)
        if len(best):
            # every session at the deepest such depth, the latest first: a later session that ran other modes (or
            # fewer cases) does not hide what an earlier one measured; each one's ratios are its own
            deepest = max(rank(n)[0] for n in best["session"].unique())
            sessions = sorted((n for n in best["session"].unique() if rank(n)[0] == deepest), reverse=True)
            rows = at_seq[at_seq["session"] == sessions[0]]
            said = [_against_best(best[best["session"] == n]) + ("" if len(sessions) == 1 else
                    f" (session {n}, commit {commits(at_seq[at_seq['session'] == n])})") for n in sessions]
            parts.append(f"DeepSpeed at its best (the fastest of its exact modes in one session: ZeRO-3 offload, "
                         f"SuperOffload, partial offload), {_depth_phrase(rows)}, on {_machine(rows)}: "
                         f"{BOLD}{'; '.join(said)}{END_BOLD}")
        else:
            parts.append("DeepSpeed at its best (SuperOffload, partial offload) has not run beside ZeRO-3 offload and "
                         "MegaTrain in one session yet")
        at_seq = session
    parts += _no_ratio(_unpaired(at_seq, "deepspeed"), SYSTEM_NAMES["deepspeed"])
    failed = at_seq[at_seq["status"] != "ok"]  # every system's: a ratio missing because ours failed is said too
    for (label, batch), g in failed.groupby(["label", "batch"], sort=False):
        parts.append(_not_ok(prose(label), f"batch {batch}", g["status"].iloc[0], g["error"].iloc[0]))
    for claim in claims:
        stated = f"batch {claim.batch}" if claim.batch else \
            "batch not stated" + (f" (its ablation of the same case runs {papers_batch})" if papers_batch else "")
        parts.append(f"the paper's own figure, on its machine and not a ratio of ours: {_papers_ratio(claim)}, "
                     f"{stated}")
    if pairs.empty:  # no ratio to draw: each system's TFLOPS
        return "; ".join(parts) + ".", plots.summary_tflops(at_seq, path), (
            "TFLOPS (6NT) of each system at each batch in the latest session; hatched: compiled. No system ran beside "
            "DeepSpeed ZeRO-3 offload at the same batch and kernels.")
    why = _why(projection_path)
    sentence = "; ".join(parts) + "." + (f" {why}" if why else "")
    return sentence, _over_deepspeed_figure(scope[scope["seq"] == seq], pairs, claims, papers_batch, path), (
        "Each system's TFLOPS (6NT) over DeepSpeed ZeRO-3 offload's at the same batch and kernels, against batch, "
        "eager and compiled apart (dashed: compiled), one line per system and session (its depth and machine in the "
        "legend where several); the star is the paper's own ratio, measured on its machine (GH200) at a batch it "
        "does not state, drawn at its ablation's batch.")


def _over_deepspeed_figure(rows: pd.DataFrame, pairs: pd.DataFrame, claims: tuple[paper.Claim, ...],
                           papers_batch: int | None, path: Path) -> Path:
    sessions = list(pairs["session"].unique())
    fig, axes = plots._figure(1, 2, height=4.4, sharey=True)
    for ax, compiled in zip(axes[0], (False, True), strict=True):
        drawn = pairs[pairs["compiled"] == compiled]
        for (session, label), g in drawn.groupby(["session", "label"]):
            g = g.sort_values("batch")
            at = rows[rows["session"] == session]
            layers, full = _depth(at)
            note = f" ({layers} layers, {_machine(at).removeprefix('one ')})" if len(sessions) > 1 else ""
            style = plots._line_style(label)
            if layers < full:  # a cut model: its system's colour, lighter, open markers
                style.update(color=plots._shade(style["color"], 0.4), markerfacecolor="white")
            ax.plot(g["batch"], g["ratio"], label=prose(label.removesuffix(plots.COMPILED_SUFFIX)) + note, **style)
        for claim in claims:
            mine = paper.counterpart(claim)
            if mine and mine.tflops and claim.tflops and papers_batch:
                ax.plot([papers_batch], [mine.tflops / claim.tflops], linestyle="none", marker="*", markersize=14,
                        color="black", label=f"the paper's {mine.tflops / claim.tflops:.2f}x ({claim.hardware})")
        ax.axhline(1.0, color="#8c8c8c", linewidth=0.8)
        batches = sorted(set(pairs["batch"]) | ({papers_batch} if papers_batch else set()))
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.xaxis.set_minor_locator(plots.NullLocator())
        ax.set(xlabel="batch (sequences of the step)", title="compiled" if compiled else "eager")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("TFLOPS over ZeRO-3 offload's")
    plots._legend_below(fig, axes, ncols=3)
    return plots._save(fig, path)


# ---- double_buffering: the paper's ablation, MegaTrain with one weight slot against two ----

ONE_SLOT = "one-slot"  # the variant of a MegaTrain label run with weight_slots=1 (suites/ablation.toml)


def double_buffering(scope: pd.DataFrame, claims: tuple[paper.Claim, ...], path: Path):
    """The latest session's MegaTrain streamed with one weight slot (a label variant ending 'one-slot') against the
    same label without it, per batch and kernel setting, beside the paper's own ablation (its 14B on GH200 at batch
    96, paper.ABLATIONS)."""
    full = next(c for c in paper.CLAIMS if c.what == paper.ABLATION_OF)
    without = paper.ABLATIONS["double buffering"]
    papers = (f"the paper's, its 14B on {full.hardware} at batch {full.batch}: {without:g} TFLOPS against "
              f"{full.tflops:g} ({without / full.tflops - 1:+.0%})")
    ok = scope[scope["status"] == "ok"]
    session = ok[ok["session"] == ok["session"].max()] if len(ok) else ok
    said = []
    for (batch, label), g in session.groupby(["batch", "label"]):
        system, variant, compiled = plots.split_label(label)
        if system != "megatrain" or not variant.endswith(ONE_SLOT):
            continue
        two = session[(session["batch"] == batch) & (session["label"] == label.replace(f"-{ONE_SLOT}", "", 1))]
        if two.empty:
            continue
        one_t, two_t = g["tflops"].max(), two["tflops"].max()
        said.append(f"batch {batch} {'compiled' if compiled else 'eager'}, {one_t:.0f} against {two_t:.0f} TFLOPS "
                    f"({one_t / two_t - 1:+.0%})")
    if not said:
        return (f"{BOLD}MegaTrain has not run with one weight slot beside two in one session yet{END_BOLD}; "
                f"{papers}."), None, ""
    row = session.iloc[0]
    sentence = (f"On {_machine(session)}, {row['model_name']} at {_depth_phrase(session)}, seq {row['seq']}, "
                f"MegaTrain streaming every layer with one weight slot (each layer's copy after the previous layer's "
                f"compute) against two (the copy beside it): {BOLD}{'; '.join(said)}{END_BOLD}; {papers}.")
    return sentence, plots.summary_tflops(session, path), (
        "TFLOPS (6NT) of MegaTrain streaming every layer with two weight slots and with one, per batch, in the latest "
        "session; hatched: compiled.")


# ---- host_optimizer: what the host optimizer costs a small batch, per option, and every offload peer at its best ----

def _peer(system: str, label: str) -> str:
    """The peer a case measures, as a sentence names it: DeepSpeed by its offload mode (its label's variant); another
    system whatever its label (FSDP2's variants are settings of one mode: the sentence takes the best)."""
    if system == "deepspeed":
        return DEEPSPEED_MODES.get(plots.split_label(label)[1], SYSTEM_NAMES["deepspeed"])
    return SYSTEM_NAMES.get(system, system)


def _option(label: str, kernels: bool = False) -> str:
    """A MegaTrain label's option as a short phrase: 'megatrain-streamed-mixed-delayed-compiled' -> 'streamed mixed
    delayed'; the default label is 'as planned'. kernels: its kernel setting after it ('streamed mixed eager'), where
    a session ran both."""
    variant = plots.split_label(label)[1]
    phrase = variant.replace("-", " ") if variant else "as planned"
    return f"{phrase} {_kernels(label)}" if kernels else phrase


def _small_over_large(mine: pd.DataFrame, small: int, large: int) -> pd.DataFrame:
    """Per MegaTrain label that ran both batches: TFLOPS at each, their ratio, and the host optimizer's exposed share
    of the small batch's step."""
    tflops = mine.pivot_table(index="label", columns="batch", values="tflops", aggfunc="max")
    both = tflops.dropna(subset=[small, large]) if {small, large} <= set(tflops.columns) else tflops.iloc[:0]
    exposed = mine[mine["batch"] == small].set_index("label")["exposed_optim_frac"]
    return pd.DataFrame({"small": both[small], "large": both[large], "ratio": both[small] / both[large],
                         "exposed": exposed.reindex(both.index)})


def _is_default(label: str) -> bool:
    """Whether a MegaTrain label is its default (as planned): no variant."""
    return plots.split_label(label)[1] == ""


def _exact_adamw(rows: pd.DataFrame) -> pd.Series:
    """Per MegaTrain row, whether its update is exact AdamW: not delayed a step, fp32 moments."""
    return (rows["update_delay"].fillna(0) == 0) & (rows["moments"] == "fp32")


def _streamed_exact(mine: pd.DataFrame) -> str | None:
    """The label of MegaTrain streamed (nothing resident), exact AdamW, mixed precision; not the default label."""
    exact = mine[(mine["resident_units"] == 0) & _exact_adamw(mine) & (mine["precision"] == "mixed")
                 & ~mine["label"].map(_is_default)]
    return exact["label"].iloc[0] if len(exact) else None


def _references(mine: pd.DataFrame) -> list[tuple[str, str]]:
    """MegaTrain's labels a peer is measured against, with their names: as planned, and streamed exact."""
    default = mine[mine["label"].map(_is_default)]["label"]
    planned, exact = (default.max() if len(default) else None), _streamed_exact(mine)
    return [(label, name) for label, name in ((planned, "as planned"), (exact, "streamed exact")) if label]


def _against(theirs: pd.DataFrame, mine: pd.DataFrame, batches, kernels: bool) -> str:
    """One peer at each batch: its best TFLOPS over its labels at each kernel setting it ran, the share of its step
    its optimizer was exposed where it says, and the ratios of MegaTrain's references at the same kernels to it; or
    why it did not run. kernels: name the kernel setting (a session that ran both)."""
    figures = []
    for batch in batches:
        at = theirs[theirs["batch"] == batch]
        ran = at[at["status"] == "ok"]
        if ran.empty:
            if len(at):
                figures.append(f"batch {batch} {tables.short_reason(at['status'].iloc[0], at['error'].iloc[0])}")
            continue
        for compiled, rows in ran.groupby("compile"):
            top = rows.loc[rows["tflops"].idxmax()]
            exposed = "" if pd.isna(top["exposed_optim_frac"]) else \
                f", {top['exposed_optim_frac']:.0%} of its step in its optimizer"
            ratios = []
            for label, name in _references(mine[mine["compile"] == compiled]):
                ours = mine[(mine["label"] == label) & (mine["batch"] == batch)]["tflops"].max()
                if not pd.isna(ours):
                    ratios.append(f"{name} {ours / top['tflops']:.2f}x")
            setting = f" {_kernels(top['label'])}" if kernels else ""
            figures.append(f"batch {batch}{setting} {top['tflops']:.0f} TFLOPS{exposed}"
                           + (f" (MegaTrain {', '.join(ratios)})" if ratios else ""))
    return "; ".join(figures)


def host_optimizer(scope: pd.DataFrame, claims: tuple[paper.Claim, ...], path: Path):
    """Per depth, its latest session: MegaTrain's small-batch TFLOPS over its large-batch, with the exposed host
    optimizer, per option; then MegaTrain as planned and streamed exact against each peer's best label per batch."""
    parts, panels = [], []
    for layers in sorted(scope["num_layers"].unique(), reverse=True):
        rows = scope[scope["num_layers"] == layers]
        session = rows[rows["session"] == rows["session"].max()]
        ok = session[session["status"] == "ok"]
        mine = ok[ok["system"] == "megatrain"]
        if mine.empty:
            continue
        small, large = int(session["batch"].min()), int(session["batch"].max())
        options = _small_over_large(mine, small, large)
        if options.empty:
            continue
        both = session["compile"].nunique() > 1  # eager and compiled cases: each option says its kernels
        panels.append((layers, session, options, both))
        said = [f"{_option(label, both)} {r.ratio:.2f}x" + ("" if pd.isna(r.exposed) else f" ({r.exposed:.0%})")
                for label, r in options.loc[plots.ordered_labels(options.index)].iterrows()]
        # the answer is the suite's main setting's: compiled, where the session ran both
        main = mine[mine["compile"]] if both and mine["compile"].any() else mine
        planned = next((label for label, name in _references(main) if name == "as planned"), None)
        exact = _streamed_exact(main)
        streamed = options.drop(index=[planned] if planned else [], errors="ignore")
        best = streamed["ratio"].idxmax() if len(streamed) else None
        where = (f"at {layers} layers ({session['params_b'].iloc[0]:.2f}B, {session['model_name'].iloc[0]} width, "
                 f"seq {session['seq'].iloc[0]}) on {_machine(session)}")
        answer = ""
        if exact in options.index:  # the answer first: exact AdamW streamed, then the best streamed option
            e = options.loc[exact]
            answer = (f", {BOLD}streamed with exact AdamW, batch {small} runs at {e.ratio:.2f}x of batch {large}'s "
                      f"TFLOPS" + ("" if pd.isna(e.exposed) else f", {e.exposed:.0%} of its step waiting on the host "
                                   "optimizer") + END_BOLD)
            if best is not None and best != exact:
                b = options.loc[best]
                inexact = not _exact_adamw(mine[mine["label"] == best]).all()
                answer += (f"; the best streamed option, {_option(best, both)}"
                           f"{' (not exact AdamW)' if inexact else ''}, "
                           f"{b.ratio:.2f}x" + ("" if pd.isna(b.exposed) else f" ({b.exposed:.0%})"))
        text = (f"{where}{answer}; every option's batch {small} over its batch {large}: {_join(said)} (in brackets "
                f"the host optimizer's exposed share of the batch-{small} step)")
        peers = session[session["system"] != "megatrain"]
        names = pd.Series([_peer(system, label) for system, label in zip(peers["system"], peers["label"],
                                                                          strict=True)], index=peers.index)
        against = [f"{peer}: {_against(peers[names == peer], mine, (small, large), both)}"
                   for peer in sorted(set(names))]
        if against:
            text += (f"; each peer at its best label per batch{' and kernel setting' if both else ''}, and "
                     f"MegaTrain's ratio to it{' at the same kernels' if both else ''}: {'; '.join(against)}")
        parts.append(text)
    if not panels:
        return f"{BOLD}No MegaTrain case ran ok at both batches in a latest session.{END_BOLD}", None, ""
    figure = _host_optimizer_figure(panels, path)
    caption = ("MegaTrain's TFLOPS at the small batch over the large one, per option, in each depth's latest session; "
               "the label beside each bar: the host optimizer's exposed share of the small batch's step. Options "
               "named delayed apply each update a step late (update_delay=1), and bf16/int8 moments are compact: "
               "neither is exact AdamW (their convergence cost: results/moments).")
    sentence = "; ".join(parts)
    return sentence[0].upper() + sentence[1:] + ".", figure, caption


def _host_optimizer_figure(panels: list, path: Path) -> Path:
    height = 0.32 * max(len(options) for _, _, options, _ in panels) + 1.4
    fig, axes = plots._figure(1, len(panels), height=height)
    for ax, (layers, session, options, both) in zip(axes[0], panels, strict=True):
        labels = plots.ordered_labels(options.index)
        ratios = options.loc[labels, "ratio"].to_numpy()
        bars = ax.barh(range(len(labels)), ratios, height=0.6,
                       color=[plots.label_style(label)["color"] for label in labels])
        ax.bar_label(bars, labels=[f"{r:.2f}x" + ("" if pd.isna(e) else f", {e:.0%}")
                                   for r, e in zip(ratios, options.loc[labels, "exposed"], strict=True)],
                     padding=3, fontsize=8)
        ax.set_yticks(range(len(labels)), [_option(label, both) for label in labels], fontsize=8)
        ax.invert_yaxis()
        ax.axvline(0.8, color="black", linestyle=":", linewidth=1)
        ax.set_xlim(0, 1.35)
        batches = sorted(session["batch"].unique())
        ax.set(xlabel=f"batch {batches[0]} TFLOPS / batch {batches[-1]}",
               title=f"{layers} layers ({session['params_b'].iloc[0]:.2f}B)")
        ax.grid(axis="x", alpha=0.3)
    return plots._save(fig, path)


# ---- paths: every system's path, on CPU ----

def paths(scope: pd.DataFrame, claims: tuple[paper.Claim, ...], path: Path):
    counts = scope.groupby(["label", "status"]).size().unstack(fill_value=0)
    labels = plots.ordered_labels(counts.index)
    counts = counts.loc[labels]
    statuses = ["ok", *sorted(s for s in counts.columns if s != "ok")] if "ok" in counts else sorted(counts.columns)
    fig, axes = plots._figure(width=plots.WIDTH_IN * 0.75, height=0.45 * len(labels) + 1.6)
    ax = axes[0][0]
    left = np.zeros(len(labels))
    for status in statuses:
        values = counts[status].to_numpy()
        bars = ax.barh(range(len(labels)), values, left=left, height=0.6, label=status,
                       color=plots.STATUS_COLORS.get(status, "#a05a00"))
        ax.bar_label(bars, labels=[str(v) if v else "" for v in values], label_type="center", color="white",
                     fontsize=8, fontweight="bold")
        left += values
    ax.set_yticks(range(len(labels)), labels)
    for tick, label in zip(ax.get_yticklabels(), labels, strict=True):
        tick.set_color(plots.label_style(label)["color"])
    ax.invert_yaxis()
    ax.set(xlabel="cases", title="Cases per system and status")
    ax.grid(axis="x", alpha=0.3)
    plots._legend_below(fig, axes)
    figure = plots._save(fig, path)
    n, n_ok = int(counts.to_numpy().sum()), int(counts.get("ok", pd.Series(dtype=int)).sum())
    gpu = (scope["device"] == "cuda").any()
    where = _machine(scope)
    clean = [prose(label) for label in labels if counts.loc[label].drop("ok", errors="ignore").sum() == 0]
    failed = scope[scope["status"] != "ok"]
    bad = [f"{prose(label)}, {len(g)} {tables.short_reason(status, g['error'].iloc[0])}"
           for label in labels for status, g in failed[failed["label"] == label].groupby("status")]
    sentence = f"On {where}, {BOLD}{n_ok} of {n} cases ran ok{END_BOLD}"
    if clean:
        sentence += f": {_join(clean)} each built, trained and recorded, each case in a process of its own"
    if bad:
        sentence += f"; not ok: {_join(bad)} (the errors: Failures and skips, below)"
    if not gpu:
        sentence += "; a check of the path, not of speed: no speed is read from these CPU cases"
    return sentence + ".", figure, "Every case of the latest records by system and status (ok, skipped, failed)."


# ---- multi_gpu: how much faster N GPUs of one host train than one, per system, and MegaTrain over each peer ----

def multi_gpu(scope: pd.DataFrame, claims: tuple[paper.Claim, ...], path: Path):
    """Each session that ran several GPUs, newest first (a ratio only within a session: one host, one commit)."""
    ok = scope[scope["status"] == "ok"].assign(per_gpu_batch=lambda f: f["batch"] // f["ranks"])
    most_ranks = ok.groupby("session")["ranks"].max()
    sessions = sorted(most_ranks.index[most_ranks > 1], reverse=True)
    if not sessions:
        latest = scope[scope["session"] == scope["session"].max()]
        return f"{BOLD}No session ran a case on several GPUs ok.{END_BOLD}", plots.tflops_vs_gpus(latest, path), ""
    figure = plots.tflops_vs_gpus(scope[scope["session"].isin(sessions)], path)
    parts = []
    for session in sessions:
        rows = ok[ok["session"] == session]
        profile = get_profile(rows["hardware"].iloc[0])
        groups = rows.groupby(["params_b", "model", "seq", "per_gpu_batch"])
        clauses = [_scaling_clause(g, f"{model}, seq {seq}, {per_gpu} sequences per GPU")
                   for (_, model, seq, per_gpu), g in groups]
        parts.append(f"On the {profile.gpu} GPUs of one host ({profile.host_mem_gib:.0f} GiB; session {session}), "
                     + "; ".join(clauses) + ".")
    caption = ("TFLOPS (6NT) of all the GPUs together, per system, on 1, 2 and 4 GPUs of one host at the same "
               "sequences per GPU (the global batch grows with the GPUs), one panel per session (a host and a "
               "commit); hatched: compiled. Host memory is the node's: PSS summed over every rank, which counts a "
               "page the ranks share once.")
    return " ".join(parts), figure, caption


def _scaling_clause(g: pd.DataFrame, where: str) -> str:
    """One model and batch per GPU: each system's speed-up over its own one GPU, MegaTrain over each peer on the most
    GPUs both ran at equal kernels, and the node's host memory."""
    tflops = g.groupby(["label", "ranks"])["tflops"].max()
    pss = g.groupby(["label", "ranks"])["node_pss_gib"].max()
    labels = plots.ordered_labels(g["label"].unique())
    several = sorted(r for r in g["ranks"].unique() if r > 1)
    faster = []
    for label in labels:
        steps = [f"{tflops[(label, r)] / tflops[(label, 1)]:.2f}x on {r}" for r in several
                 if (label, 1) in tflops and (label, r) in tflops]
        if steps:
            faster.append(f"{prose(label)} {', '.join(steps)} ({tflops[(label, 1)]:.0f} TFLOPS on one)")
    clause = f"at {where} ({_join(sorted({_kernels(label) for label in labels}))}): "
    clause += f"{BOLD}speed over its own one GPU: {_join(faster)}{END_BOLD}" if faster else \
        "no system ran on both one GPU and several"
    over = []
    for label in labels:
        system, variant, compiled = plots.split_label(label)
        reference = "megatrain" + (plots.COMPILED_SUFFIX if compiled else "")
        common = [r for r in several if (label, r) in tflops and (reference, r) in tflops]
        if system != "megatrain" and common:
            r = common[-1]
            over.append(f"{tflops[(reference, r)] / tflops[(label, r)]:.2f}x {prose(label)}'s on {r} GPUs")
    if over:
        clause += f"; {BOLD}MegaTrain runs {_join(over)}{END_BOLD}"
    memory = [f"{prose(label)} {pss[(label, several[-1])]:.0f} GiB on {several[-1]} GPUs "
              f"({pss[(label, 1)]:.0f} on one)" for label in labels
              if several and (label, 1) in pss and (label, several[-1]) in pss and pd.notna(pss[(label, 1)])]
    if memory:
        clause += f"; the node's host memory: {_join(memory)}"
    return clause


HEADLINES: dict[str, Callable] = {"longest_seq": longest_seq, "largest_model": largest_model,
                                  "throughput": throughput, "over_deepspeed": over_deepspeed, "paths": paths,
                                  "host_optimizer": host_optimizer, "multi_gpu": multi_gpu,
                                  "double_buffering": double_buffering}
