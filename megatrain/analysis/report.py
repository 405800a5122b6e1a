"""Static HTML report of a suite's records: the suite's question answered (megatrain.analysis.headline), then the
summary, environment, tables, the paper beside us, figures.

`python -m megatrain report [SUITE|RESULTS_DIR ...]` rewrites reports/<suite>/index.html and
the PNG figures beside it from results/<suite>/records.jsonl. The page loads nothing from
outside its directory. By default it covers the latest run of each hardware profile (a resumed
run is one run); older runs stay in the records.
"""

from __future__ import annotations

import html
import math
import time
from pathlib import Path

import pandas as pd

import megatrain.user_files as user_files
from megatrain.analysis import headline, plots, results_md, scaling_report, tables
from megatrain.bench.record import STATUSES as RECORD_STATUSES
from megatrain.bench.suite import read_suite_records
from megatrain.hardware import get_profile
from megatrain.memory import GIB, GPU_FILL, PROCESS_OVERHEAD_BYTES
from megatrain.probe import Machine
from megatrain.workspace import WORKSPACE

MAX_TRACES = 6
STATUSES = (*RECORD_STATUSES, tables.DIVERGED)  # a row's: the records' and the ones tables derives
DENSE_COLUMNS = 16  # a table with more columns is set smaller, to fit the page's width
CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1200px; padding: 0 1em; color: #222; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; } h2 { margin-top: 1.8em; border-bottom: 1px solid #ddd; }
p.question { font-size: 1.15em; color: #555; margin: 0.2em 0 0.6em; }
p.answer { font-size: 1.2em; line-height: 1.5; margin: 0.6em 0; }
.table { max-width: 100%; overflow-x: auto; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 12px; }
th, td { border: 1px solid #ddd; padding: 3px 6px; text-align: right; }
th { background: #f4f4f4; font-weight: 600; } td.text, th.text { text-align: left; }
td.text { overflow-wrap: anywhere; }  /* anywhere: a long label may also narrow its column */
table.dense { font-size: 11px; } table.dense th, table.dense td { padding: 2px 4px; }
tr:nth-child(even) td { background: #fafafa; }
.ok { color: #11772d; font-weight: 600; } .oom, .diverged { color: #b3261e; font-weight: 600; }
.error, .timeout { color: #a05a00; font-weight: 600; } .skipped { color: #666; }
code, pre { background: #f4f4f4; padding: 1px 4px; } pre { padding: 8px; overflow-x: auto; white-space: pre-wrap; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
.muted { color: #666; }
"""
TEXT_COLUMNS = {"system", "model", "status", "run", "claim", "source", "their hardware", "vs", "at", "note",
                "our system", "our status", "our GPU", "our run", "case", "what", "value", "error", "profile",
                "command", "comparable", "largest trained", "next larger", "why", "file", "commit", "gpu", "precision",
                "name", "measured status", "TFLOPS count", "reason", "label"}


def _fmt(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}"
    return str(value)


def html_table(df: pd.DataFrame) -> str:
    """A plain HTML table, in a box that scrolls sideways rather than the page should it not fit; status cells carry a
    class, text columns align left, a table of many columns is set smaller."""
    if df.empty:
        return "<p class='muted'>nothing to show</p>"
    head = "".join(f"<th class='{'text' if c in TEXT_COLUMNS else ''}'>{html.escape(str(c).replace('_', ' '))}</th>"
                   for c in df.columns)
    rows = []
    for _, row in df.iterrows():
        cells = []
        for col in df.columns:
            text = html.escape(_fmt(row[col]))
            status = col in ("status", "our status") and isinstance(row[col], str) and row[col] in STATUSES
            cls = ("text " if col in TEXT_COLUMNS else "") + (row[col] if status else "")
            cells.append(f"<td class='{cls.strip()}'>{text}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    dense = " class='dense'" if len(df.columns) > DENSE_COLUMNS else ""
    return (f"<div class='table'><table{dense}><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
            "</div>")


def _runs_section(records: list[dict], scope: pd.DataFrame) -> str:
    parts = []
    for run_id in sorted(scope["run_id"].unique()):
        rs = [r for r in records if r["suite"]["run_id"] == run_id]
        env, machine = rs[-1]["env"], rs[-1]["suite"]["machine"]
        commits = sorted({f"{r['env']['commit'][:10]}{' (dirty)' if r['env']['dirty'] else ''}" for r in rs})
        profiles = sorted({r["suite"]["hardware"] for r in rs})
        facts = {
            "hardware profile": ", ".join(f"{p}: {get_profile(p).description}" for p in profiles),
            "measured": Machine.from_dict(machine).describe(),
            "commits": ", ".join(commits), "started": min(r["suite"]["started_at"] or "?" for r in rs),
            "python / torch / CUDA": f"{env['python']} / {env['torch']} / {env['cuda'] or 'none'}",
            "DeepSpeed / transformers": f"{env['deepspeed'] or 'not installed'} / {env['transformers'] or '—'}",
            "GPU / driver": f"{env['gpu'] or 'none'} / {env['driver'] or '—'}",
            "CPU / host memory": f"{env['cpu']} ({env['cpu_cores']} cores) / {env['host_mem_gib']} GiB",
        }
        table = pd.DataFrame({"what": list(facts), "value": list(facts.values())})
        parts.append(f"<h3>run {html.escape(run_id)}</h3>{html_table(table)}")
    return "".join(parts)


def _case_html(row: pd.Series) -> str:
    """A case in a few words, escaped: its label, model, batch and sequence length."""
    return html.escape(f"{row['label']} {row['model']} b{row['batch']} s{row['seq']}")


def _failures_section(scope: pd.DataFrame, by_key: dict) -> str:
    bad = scope[scope["status"] != "ok"].sort_values(["status", "label", "model", "batch"])
    if bad.empty:
        return "<p>Every case ran.</p>"
    items = []
    for _, row in bad.iterrows():
        r = by_key[(row["run_id"], row["case_id"])]
        detail = r.get("stderr_tail") or r.get("traceback") or ""
        status = row["status"] if row["status"] in STATUSES else ""
        summary = (f"<span class='{status}'>{html.escape(row['status'])}</span> {_case_html(row)}: "
                   f"{html.escape(str(row['error'] or '')[:300])}")
        items.append(f"<details><summary>{summary}</summary><pre>{html.escape(detail)}</pre></details>"
                     if detail else f"<p>{summary}</p>")
    return "".join(items)


def _headroom_section(scope: pd.DataFrame) -> list[str]:
    headroom = tables.batch_headroom(scope)
    if headroom.empty:
        return []
    return ["<h3>Batch headroom (projected)</h3>", html_table(headroom),
            "<p class='muted'>GPU peak grows linearly with the batch: the two largest batches a system ran give "
            f"GiB per sequence, and {GPU_FILL:.0%} of the GPU's memory bounds the batch. A projection, "
            "not a measurement; a ladder run to the first failure settles it.</p>"]


def _reconstructed_section(scope: pd.DataFrame, by_key: dict) -> str:
    rows = scope[scope["reconstructed"]]
    if rows.empty:
        return ""
    notes = [str(by_key[(row["run_id"], row["case_id"])]["reconstructed"]) for _, row in rows.iterrows()]
    items = [f"<p><b>{_case_html(row)}</b>: {html.escape(note)}</p>"
             for (_, row), note in zip(rows.iterrows(), notes, strict=True)]
    return "<h3>Records rebuilt from the run's log</h3>" + "".join(items)


def _figures(scope: pd.DataFrame, by_key: dict, results_dir: Path, out_dir: Path) -> list[tuple[Path, str]]:
    figs = [
        (plots.tflops_vs_model(scope, out_dir / "tflops_vs_model.png"), "Best TFLOPS per system against model size."),
        (plots.tflops_vs_batch(scope, out_dir / "tflops_vs_batch.png"),
         "TFLOPS against batch; ladders stop after a system's first failed batch."),
        (plots.tflops_vs_seq(scope, out_dir / "tflops_vs_seq.png"), "TFLOPS against context length, in the hardware "
         "count and in the paper's long-context count (its own points on the latter)."),
        (plots.memory_vs_model(scope, out_dir / "memory_vs_model.png"), "Peak GPU and host memory against size."),
    ]
    ok = scope[(scope["status"] == "ok") & scope["trace_path"].notna()].copy()
    if len(ok):
        ok["work"] = ok["params_b"] * ok["batch"] * ok["seq"]
        largest = ok.loc[ok.groupby("label")["work"].idxmax()].head(MAX_TRACES)
        figs.append((plots.traces(largest, results_dir, out_dir / "traces.png"),
                     "Sampled during each system's largest case (NVML every ~150 ms, psutil for the process tree)."))
    engine = scope[(scope["status"] == "ok") & scope["has_timeline"]]
    for run_id, g in engine.groupby("run_id"):
        best = g.loc[g["tflops"].idxmax()]
        record = by_key[(run_id, best["case_id"])]
        figs.append((plots.timeline(record, out_dir / f"timeline_{best['case_id']}.png"),
                     "One measured step of the engine's fastest case in this run: overlap of the streams."))
    return [(p, caption) for p, caption in figs if p is not None]


def _figure_html(png: Path, caption: str) -> str:
    return f"<figure><img src='{html.escape(png.name)}' alt='{html.escape(caption)}'>" \
           f"<figcaption>{html.escape(caption)}</figcaption></figure>"


def _opening(head: headline.Headline | None) -> list[str]:
    """The suite's question, the sentence that answers it, and its figure."""
    if head is None:
        return ["<p class='muted'>This suite declares no question (a [report] table in its TOML: "
                "megatrain.analysis.headline), so the report opens with its summary.</p>"]
    parts = [f"<p class='question'>{html.escape(head.question)}</p>", f"<p class='answer'>{head.sentence}</p>"]
    if head.figure is not None:
        parts.append(_figure_html(head.figure, head.caption))
    return parts


def _tflops_caption(frame: pd.DataFrame) -> str:
    """What the summary's TFLOPS bars show, and why plain PyTorch's can stand above MegaTrain's."""
    caption = ("TFLOPS (6NT) per system at each model and batch, at the main sequence length; hatched: compiled; a "
               "missing bar: not run, or not ok, there.")
    systems = {plots.split_label(label)[0] for label in frame[frame["status"] == "ok"]["label"]}
    if {"megatrain", "native"} <= systems and (frame["device"] == "cuda").any():
        caption += (" Plain PyTorch keeps the whole model and its optimizer state on the GPU, so it runs only where "
                    "they fit; MegaTrain keeps its training state in host memory and holds on the GPU what its plan "
                    "makes resident.")
    return caption


def _memory_caption(frame: pd.DataFrame) -> str:
    """What the summary's memory bars show, and why a bar that would surprise is as it is."""
    ok = frame[frame["status"] == "ok"]
    caption = "Peak GPU and host memory per system, at the largest batch it ran; hatched: compiled."
    resident = ok[(ok["system"] == "megatrain") & (ok["device"] == "cuda") & (ok["resident_units"] > 0)]
    if len(resident):
        caption += (" MegaTrain's GPU peak is high by design: its plan keeps on the GPU whatever fits, the "
                    f"embedding, then leading layers (here up to {int(resident['resident_units'].max())} units "
                    f"resident), filling up to {GPU_FILL:.0%} of the GPU, and streams the rest; its training state "
                    "stays in host memory.")
        if ok["label"].str.contains("streamed").any():
            caption += " '-streamed': nothing resident, every unit streamed."
    if ((ok["system"] == "native") & (ok["device"] == "cuda")).any():
        caption += " Plain PyTorch's host peak is its process alone: all it trains is on the GPU."
    if not (ok["device"] == "cuda").any():
        caption += " On a CPU all of a case's memory is host memory."
    return caption


def _summary_section(scope: pd.DataFrame, out_dir: Path, paper: pd.DataFrame, tflops: bool) -> list[str]:
    """Throughput (unless the opening shows it) and memory per system, the speedups at equal settings, and the
    paper's figures where ours are comparable (same model, sequence and batch)."""
    session = scope["session"].max()  # the latest measuring session: one machine, one commit
    scope = scope[scope["session"] == session]
    paper = paper[paper["our run"] == session] if not paper.empty else paper
    cpu_only = not (scope["device"] == "cuda").any()
    gpu = scope["gpu"].dropna().iloc[0] if scope["gpu"].notna().any() else "no GPU (CPU only)"
    parts = ["<h2>Summary</h2>",
             f"<p>The latest session, <code>{html.escape(session)}</code>: {len(scope)} cases on "
             f"{html.escape(gpu)}, commit {html.escape(scope['commit'].iloc[0][:10])}. Earlier sessions are in the "
             "detail below, never mixed into these figures.</p>"]
    if cpu_only:
        parts.append("<p><b>These cases ran on a CPU.</b> They check that every system's path builds, trains and "
                     "records on the same model and data; they say nothing about speed, so no speedup is taken from "
                     "them.</p>")
    figures = [(plots.summary_tflops(scope, out_dir / "summary_tflops.png"), _tflops_caption(scope))] \
        if tflops and not cpu_only else []
    figures.append((plots.summary_memory(scope, out_dir / "summary_memory.png"), _memory_caption(scope)))
    parts += [_figure_html(fig, caption) for fig, caption in figures if fig is not None]
    if not cpu_only:
        table = tables.summary_speedups(scope)
        parts += ["<h3>Speedups at equal settings</h3>",
                  html_table(table) if not table.empty else "<p class='muted'>no MegaTrain case beside another "
                  "system at the same model, sequence, batch and kernels</p>",
                  "<p class='muted'>MegaTrain's TFLOPS over each system's, in one session, at the same model, "
                  "sequence, batch and kernel setting ('-compiled': every decoder layer through torch.compile, in "
                  "every system). Best against best, and the failures, are under Speedups below.</p>"]
        comparable = paper[paper["comparable"] == "yes"] if not paper.empty else paper
        if not comparable.empty:
            parts += ["<h3>The paper beside us</h3>",  # one session: its GPU and run are stated above
                      html_table(comparable.drop(columns=["comparable", "our GPU", "our run"])),
                      "<p class='muted'>Only the published figures of the same case as one of ours: model, "
                      "sequence and batch. Their hardware is not ours: read these side by side, not as ratios.</p>"]
    return parts


def _results_note(scope: pd.DataFrame) -> str:
    note = ("host B/param: peak RSS of the case's process over its parameters (includes the process's fixed "
            "~0.3-3 GiB, so it reads high for small models). plan: the pre-flight estimate (megatrain.bench.fit).")
    if (scope["device"] == "cpu").any():
        note += (f" The host plan counts a fixed {PROCESS_OVERHEAD_BYTES / GIB:.0f} GiB per process for python, "
                 "torch, a CUDA context and libraries (megatrain.engine.plan); a CPU process training a small model "
                 "measures far less, so on CPU cases the plan stands above the measured peak.")
    return f"<p class='muted'>{note}</p>"


def write_report(results_dir: Path, out_dir: Path, all_runs: bool = False) -> Path:
    """Write out_dir/index.html (and its PNGs) from results_dir/records.jsonl; returns the HTML path."""
    path = results_dir / "records.jsonl"
    records = read_suite_records(path)
    if not records:
        raise ValueError(f"no suite record in {path} can be read (the warnings above name each line skipped): fix "
                         "or remove them" if path.exists() and path.read_bytes().strip() else
                         f"no records in {path}; run the suite first")
    df = tables.records_frame(records)
    scope = df if all_runs else tables.latest_records(df)
    by_key = {(r["suite"]["run_id"], r["suite"]["case_id"]): r for r in records}
    # written aside, then into out_dir over what the last report wrote there (its manifest) and nothing else
    with user_files.replacing(out_dir, "report") as stage:
        _write_page(records, scope, by_key, results_dir, out_dir, stage)
    return out_dir / "index.html"


def _write_page(records: list[dict], scope: pd.DataFrame, by_key: dict, results_dir: Path, out_dir: Path,
                stage: Path) -> None:
    """index.html and its figures, for out_dir, into the folder stage."""
    figures = _figures(scope, by_key, results_dir, stage)
    suite = records[-1]["suite"]["name"]
    speedups = tables.speedups(scope)
    paper = tables.paper_comparison(scope)
    head = headline.headline(suite, scope, stage)
    rel = lambda p: p.resolve().relative_to(WORKSPACE) if p.resolve().is_relative_to(WORKSPACE) else p  # noqa: E731
    rerun = (f"python -m megatrain suite {suite} --out-dir {rel(results_dir)}\n"
             f"python -m megatrain report {rel(results_dir)} --out {rel(out_dir)}")
    body = [
        f"<h1>Suite <code>{html.escape(suite)}</code></h1>",
        *_opening(head),
        f"<p class='muted'>{len(scope)} cases from <code>{html.escape(str(rel(results_dir)))}/records.jsonl</code>, "
        f"report generated {time.strftime('%Y-%m-%d %H:%M')} from the records (never edited by hand). "
        "TFLOPS = 6 x parameters x tokens / median step time; the parameters include the input embedding, which "
        "does no matmul when untied: the figure without it is beside it in the results.</p>",
        *_summary_section(scope, stage, paper, tflops=head is None or head.kind != "throughput"),
        *(scaling_report.sections(scope, stage, html_table, _figure_html) if suite == "scaling" else []),
        f"<h2>Rerun</h2><pre>{html.escape(rerun)}</pre>"
        "<p class='muted'>Cases run on a machine matching their hardware profile; a rerun resumes the latest run "
        "and repeats only cases that errored or timed out. Each case's exact command is under Cases.</p>",
        "<h2>Environment</h2>", _runs_section(records, scope),
        "<h2>Status</h2>", html_table(tables.status_counts(scope).reset_index().rename(columns={"label": "system"})),
        "<h2>Results</h2>", html_table(tables.results_table(scope)),
        _results_note(scope),
        *_headroom_section(scope),
        *([] if not (scope["device"] == "cuda").any() else [
            "<h2>Speedups</h2>",
            html_table(speedups) if not speedups.empty else "<p class='muted'>no MegaTrain case beside another "
            "system at the same model, sequence length and kernels in this run</p>"]),
        "<h2>The paper beside us</h2>",
        "<p class='muted'>Every published figure on a model shape this suite ran, beside our best case of it; "
        "'comparable' says whether the two are the same case (model, sequence and batch) and, if not, why.</p>"
        + html_table(paper) if not paper.empty else "<p class='muted'>no case of this suite has a model shape the "
        "paper reports on</p>",
        "<h2>Figures</h2>",
        *(_figure_html(p, c) for p, c in figures),
        "" if figures else "<p class='muted'>no figure has data in these records</p>",
        "<h2>Failures and skips</h2>", _failures_section(scope, by_key), _reconstructed_section(scope, by_key),
        "<h2>Cases</h2><details><summary>exact command of every case</summary>",
        html_table(scope.sort_values(["label", "model", "seq", "batch"])[["case_id", "label", "command"]]
                   .rename(columns={"case_id": "case", "label": "system"})),
        "</details>",
    ]
    page = (f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>MegaTrain: {html.escape(suite)}"
            f"</title><style>{CSS}</style></head><body>{''.join(body)}</body></html>")
    (stage / "index.html").write_text(page)


def write_reports(suites: list[str], out: str | None = None) -> list[Path]:
    """Reports for suite names or results directories; none given: every committed results/<suite>/, and
    docs/RESULTS.md (megatrain.analysis.results_md) from them."""
    results_root = WORKSPACE / "results"
    if suites:
        dirs = [Path(s) if Path(s).is_dir() else results_root / s for s in suites]
    else:  # *-local directories hold uncommitted local runs (nox -s smoke); others hold no suite's records
        found = sorted(p.parent for p in results_root.glob("*/records.jsonl") if not p.parent.name.endswith("-local"))
        dirs = [d for d in found if read_suite_records(d / "records.jsonl")]
        for d in sorted(set(found) - set(dirs)):
            print(f"skipped results/{d.name}: its records carry no suite block (bench --out or check records, "
                  "not a suite run)")
    if out is not None and len(dirs) != 1:
        raise ValueError("--out names one report directory; give exactly one suite with it")
    written = [write_report(d, Path(out) if out else WORKSPACE / "reports" / d.name) for d in dirs]
    if not suites and dirs:  # a workspace without records has no page of results to write
        written.append(results_md.write(results_root, WORKSPACE / "docs"))
    return written
