"""Tables from records (pandas): one row per case, speedups within a run, and the paper beside us.

Every number comes from the records as written: TFLOPS is the record's `tflops` (6NT, see
megatrain.models.flops), never recomputed here; the other FLOP counts (hw_tflops, paper_tflops) are
the record's own, or for records older than the field, the same FLOPs over the record's own median
step time. A case recorded more than once in a run (a retried error or time-out) counts by its
latest record.
"""

from __future__ import annotations

import math
import statistics

import pandas as pd

from megatrain.analysis import paper
from megatrain.bench.suite import PREFLIGHT_REFUSAL
from megatrain.hardware import actual_profile
from megatrain.memory import GPU_FILL
from megatrain.models.flops import hardware_flops, paper_flops
from megatrain.models.registry import MODELS, model_shape
from megatrain.probe import Machine

GIB = 2**30
# a status the records do not carry but their rows do: a case that ran (status ok) and ended on a non-finite loss. Its
# step time is real, but it times arithmetic on non-finite weights, not training: no ratio is taken from it
DIVERGED = "diverged"


def model_label(record: dict) -> str:
    """The model as named in tables: registry name, with '@<L>L' when the depth was overridden."""
    layers = record["config"].get("num_layers")
    return f"{record['model']}@{layers}L" if layers is not None else record["model"]


def compiled(record: dict) -> bool:
    """Whether the case's decoder layers ran through torch.compile. Records before `compile` was a case setting kept
    it as an engine option, on by default on CUDA, and the other systems ran eager. A compiled case whose layers ran
    eager is eager: its compile check says so (megatrain.compile_check), and before the check, the engine's own
    fallback said so in system_config's `compile`."""
    config = record["config"]
    if "compile" in config:
        wanted = config["compile"]
    else:
        wanted = record["system"] == "megatrain" and config["options"].get("compile", config["device"] == "cuda")
    system_config = record.get("system_config") or {}
    check = system_config.get("compile_check")
    if check is not None:
        return bool(wanted) and not check["eager_fallback"]
    return bool(wanted and system_config.get("compile", True))


def _graph_breaks(record: dict) -> int:
    """How many times Dynamo broke a compiled case's layer graphs (its compile check's count; 0 where none was kept):
    a layer split in graphs runs compiled, but not the whole-layer graphs of a system that has none."""
    check = (record.get("system_config") or {}).get("compile_check") or {}
    return int(check.get("graph_breaks") or 0) if compiled(record) else 0


def _label(record: dict) -> str:
    """The suite's label of the case as it ran: '-compiled' where its layers ran compiled, never where they ran eager
    (a suite names a compiled case '-compiled' before it runs; native's Gemma-4-26B-A4B layer then ran eager)."""
    label = record["suite"]["label"].removesuffix("-compiled")
    return label + "-compiled" if compiled(record) else label


def records_frame(records: list[dict]) -> pd.DataFrame:
    """One row per (run_id, case_id), flat columns; the latest record of a case wins. The hardware profile is the
    one the measured machine matches (older records named the suite's profile even when run elsewhere)."""
    rows = {}
    for r in records:
        s = r["suite"]
        plan = s.get("plan") or {}
        trace = r.get("trace") or {}
        hardware = actual_profile(s["hardware"], Machine.from_dict(s["machine"])) if s.get("machine") else s["hardware"]
        status, error = _status_and_error(r)
        resident = _resident(r) if r["system"] == "megatrain" and r["status"] == "ok" else None
        rows[(s["run_id"], s["case_id"])] = {
            "run_id": s["run_id"], "case_id": s["case_id"], "suite": s["name"], "group": s["group"],
            "label": _label(r), "hardware": hardware,
            "compile": compiled(r), "graph_breaks": _graph_breaks(r), "system": r["system"],
            "precision": r["precision"],
            "dtype": r["dtype"], "device": r["config"]["device"], "model": model_label(r), "model_name": r["model"],
            "num_layers": r["num_layers"], "params_b": r["num_params"] / 1e9,
            "active_b": r.get("active_params", r["num_params"]) / 1e9, "batch": r["batch"],
            "micro_batch": r["micro_batch"], "seq": r["seq"], "ranks": r["config"].get("ranks", 1),
            "status": status, "error": error,
            "tflops": r["tflops"], "tflops_no_embed": _tflops_no_embed(r), "mfu": r.get("mfu"),
            "tflops_all_experts": r.get("tflops_all_experts"),
            "hw_tflops": _rate(r, "hw_tflops"), "paper_tflops": _rate(r, "paper_tflops"),
            "tokens_per_s": r["tokens_per_s"],
            "step_time_s": r["step_time_s"], "step_time_iqr_s": r.get("step_time_iqr_s"),
            "peak_gpu_alloc_gib": r["peak_gpu_alloc_gib"], "peak_host_rss_gib": r["peak_host_rss_gib"],
            "host_bytes_per_param": r["peak_host_rss_gib"] * GIB / r["num_params"]
            if r["status"] == "ok" and r["peak_host_rss_gib"] else None,
            "plan_host_gib": plan["host_bytes"] / GIB if "host_bytes" in plan else None,
            "plan_gpu_gib": plan["gpu_bytes"] / GIB if "gpu_bytes" in plan else None,
            "resident_units": None if resident is None else len(resident),
            # of them decoder layers (units 1..L; 0 is the embedding, L + 1 the head)
            "resident_layers": None if resident is None else sum(1 <= u <= r["num_layers"] for u in resident),
            "update_delay": (r.get("system_config") or {}).get("update_delay", 0) if r["system"] == "megatrain"
            else None, "moments": (r["config"].get("optim") or {}).get("moments", "fp32"),
            "exposed_optim_frac": (r.get("metrics") or {}).get("exposed_optim_frac"),
            "optimizer_call_s": _timed_phase_s(r, "step"),
            "node_pss_gib": trace.get("peak_node_pss_gib"),  # every rank's, a shared page once
            "trace_path": trace.get("path"), "has_timeline": bool((r.get("metrics") or {}).get("timeline")),
            "gpu_mem_gib": r["env"].get("gpu_mem_gib"), "commit": r["env"]["commit"],
            "host_kind": r["env"].get("hostname_kind"), "gpu": r["env"]["gpu"],
            "started_at": s["started_at"], "reconstructed": bool(r.get("reconstructed")),
            "command": s["command"],
        }
    df = pd.DataFrame(list(rows.values()))
    if len(df):
        df["session"] = _sessions(df)
    return df


def _timed_phase_s(record: dict, phase: str) -> float | None:
    """The median over the timed steps of the seconds a record's engine call `phase` took (DeepSpeed's records time
    its forward, backward and step calls: metrics.phase_times_s); None where it was not timed."""
    seconds = ((record.get("metrics") or {}).get("phase_times_s") or {}).get(phase)
    if not seconds:
        return None
    return statistics.median(seconds[record["config"].get("warmup", 0):] or seconds)


def _resident(record: dict) -> list[int]:
    """The units MegaTrain's plan kept on the GPU (their indices)."""
    return (record.get("system_config") or {}).get("resident_units") or []


def _status_and_error(record: dict) -> tuple[str, str | None]:
    """The record's status and error. A case its own pre-flight refused (exit code 2 with the refusal) reads as the
    suite runner records it now, skipped with the refusal, also in records written before the runner recognised it
    (they say error, 'exit code 2 without a record: error: ... does not fit here: ...')."""
    error = record.get("error")
    unrecognised = "exit code 2 without a record: "
    if record["status"] == "error" and error and error.startswith(unrecognised) and PREFLIGHT_REFUSAL in error:
        return "skipped", error.removeprefix(unrecognised).removeprefix("error: ")
    if record["status"] == "ok" and (diverged := _diverged(record)):
        return DIVERGED, diverged
    return record["status"], error


def _diverged(record: dict) -> str | None:
    """Why an ok record's run diverged, or None: its last loss is not finite (a system that skips a non-finite step,
    as ours does, recovers; one that applies it trains on non-finite weights from then on). Where the record has
    every step's gradient norm, whether the gradient or the update went non-finite first."""
    losses = record.get("losses") or []
    if not losses or math.isfinite(losses[-1]):
        return None
    first = len(losses)
    while first > 0 and not math.isfinite(losses[first - 1]):
        first -= 1
    norms = (record.get("metrics") or {}).get("grad_norms") or []
    cause = f", {_which_went_first(norms, first)}" if len(norms) == len(losses) else ""
    return (f"loss {losses[first]} from step {first + 1} of {len(losses)} on{cause}; its {record['tflops']:.0f} "
            "TFLOPS time arithmetic on non-finite weights")


def _which_went_first(norms: list[float], first_loss: int) -> str:
    """The gradient norms up to step first_loss + 1 (the first whose loss is not finite; the last 3 at most) and what
    went non-finite first: the gradient of the step before (its norm is taken before the update that applies it, its
    loss finite) or the update that applied a finite one."""
    shown = range(max(0, first_loss - 2), first_loss + 1)
    steps = f"step {first_loss + 1}" if len(shown) == 1 else f"steps {shown[0] + 1}-{first_loss + 1}"
    said = f"gradient norms {', '.join(f'{norms[i]:.3g}' for i in shown)} at {steps}"
    if first_loss == 0:
        return f"{said}: the loss of the initial weights, before any update"
    if not math.isfinite(norms[first_loss - 1]):
        return f"{said}: the gradient went non-finite first, at step {first_loss}"
    return f"{said}: the update went non-finite first, after a finite gradient at step {first_loss}"


def short_reason(status: str, error: str | None) -> str:
    """A case that did not run ok, in a few words: its status and the memory it lacked, where its error names one."""
    text = (error or "").lower()
    lacked = next((what for said, what in (("host memory", "host memory"), ("gpu memory", "GPU memory"),
                                           ("cuda out of memory", "GPU memory")) if said in text), None)
    return f"{status}, {lacked}" if lacked else "not available here" if "cannot run here" in text else status


def _tflops_no_embed(record: dict) -> float | None:
    """The record's figure; for records written before it existed, the same 6NT rate with N the matmul parameters
    (ModelConfig.matmul_params), from the record's own TFLOPS (exact: same tokens, same step time)."""
    if "tflops_no_embed" in record or record["tflops"] is None:
        return record.get("tflops_no_embed")
    cfg = model_shape(record["model"], record["config"].get("num_layers"))
    return record["tflops"] * cfg.matmul_params() / record["num_params"]


def _rate(record: dict, key: str) -> float | None:
    """The record's hw_tflops or paper_tflops; for records written before the field existed, the same FLOPs
    (megatrain.models.flops) over the record's own median step time (exact)."""
    if key in record or record["tflops"] is None:
        return record.get(key)
    cfg = model_shape(record["model"], record["config"].get("num_layers"))
    flops = hardware_flops(cfg, record["batch"], record["seq"]) if key == "hw_tflops" else \
        paper_flops(cfg, record["batch"], record["seq"])
    return flops / record["step_time_s"] / 1e12


def _sessions(df: pd.DataFrame) -> pd.Series:
    """The measuring session of each row: consecutive runs of one hardware profile at the same commit on the
    same kind of machine are one session (a run cut short and resumed under a new run id, say), named by its
    latest run id. Rows of one session are compared with each other like rows of one run."""
    session = {}
    for _, g in df.groupby("hardware"):
        runs = g.groupby("run_id")[["commit", "host_kind", "gpu"]].first().sort_index()
        groups: list[tuple[tuple, list]] = []  # (commit, host kind, gpu), consecutive run ids
        for run_id, row in runs.iterrows():
            key = (row["commit"], row["host_kind"], row["gpu"])
            if not groups or groups[-1][0] != key:
                groups.append((key, []))
            groups[-1][1].append(run_id)
        for _, run_ids in groups:
            session.update(dict.fromkeys(run_ids, run_ids[-1]))
    return df["run_id"].map(session)


# What a table row shows: a newer record of the same row replaces the older one (say, one run with more steps).
ROW_KEY = ["hardware", "label", "compile", "precision", "model", "num_layers", "seq", "batch", "micro_batch", "ranks"]


def latest_records(df: pd.DataFrame) -> pd.DataFrame:
    """The latest measurement of each table row on the kind of machine (GPU and host kind) of each
    hardware profile's latest session (run_ids sort by their start time).

    Rows only an earlier session on that kind of machine measured stay, under that session's name, so a
    suite run in parts (the common batch one day, the largest batch the next) reads whole; rows from
    other machines drop out. Ratios are still taken within one session (speedups)."""
    df = df.sort_values("run_id", kind="stable")
    latest = df.drop_duplicates("hardware", keep="last").set_index("hardware")[["host_kind", "gpu"]]
    same = (df["host_kind"].fillna("") == df["hardware"].map(latest["host_kind"]).fillna("")) & \
        (df["gpu"].fillna("") == df["hardware"].map(latest["gpu"]).fillna(""))
    return df[same].drop_duplicates(ROW_KEY, keep="last")


def results_table(df: pd.DataFrame) -> pd.DataFrame:
    """The main table: one row per case, in model size, sequence, label and batch order."""
    cols = {"label": "system", "model": "model", "params_b": "params (B)", "batch": "batch", "seq": "seq",
            "status": "status", "tflops": "TFLOPS (6NT)", "tflops_no_embed": "TFLOPS (6NT, no input embedding)",
            "hw_tflops": "TFLOPS (hardware)", "paper_tflops": "TFLOPS (paper's long-context count)",
            "mfu": "MFU", "tokens_per_s": "tokens/s",
            "step_time_s": "step (s)", "step_time_iqr_s": "step IQR (s)", "peak_gpu_alloc_gib": "GPU peak (GiB)",
            "peak_host_rss_gib": "host peak (GiB)", "host_bytes_per_param": "host B/param",
            "plan_host_gib": "host plan (GiB)", "plan_gpu_gib": "GPU plan (GiB)"}
    if df["session"].nunique() > 1:
        cols = {"session": "run", **cols}
    out = df.sort_values(["params_b", "model", "seq", "label", "batch"])[list(cols)].rename(columns=cols)
    return out.reset_index(drop=True)


def _is_megatrain(label: str) -> bool:
    return label.startswith("megatrain")


def speedups(df: pd.DataFrame) -> pd.DataFrame:
    """MegaTrain's TFLOPS over each other system's, within one session (run), model, sequence length and kernel
    setting (compiled against compiled, eager against eager: never across).

    Rows compare at each common batch, and best against best (each at its own fastest batch).
    When the other system did not run ok at a batch where MegaTrain did, the row says why.
    """
    rows = []
    for (run_id, model, seq, _), g in df.groupby(["session", "model", "seq", "compile"]):
        ok = g[g["status"] == "ok"]
        for ref in sorted(x for x in ok["label"].unique() if _is_megatrain(x)):
            mine = ok[ok["label"] == ref].set_index("batch")["tflops"]
            for other in sorted(x for x in g["label"].unique() if not _is_megatrain(x)):
                theirs = g[g["label"] == other].set_index("batch")
                for batch in sorted(set(mine.index) & set(theirs.index)):
                    t = theirs.loc[batch]
                    rows.append(_speedup_row(run_id, model, seq, f"b={batch}", ref, batch, mine[batch], other,
                                             batch, t["tflops"], t["status"]))
                other_ok = theirs[theirs["status"] == "ok"]
                if len(other_ok):
                    best_mine, best_theirs = mine.idxmax(), other_ok["tflops"].idxmax()
                    rows.append(_speedup_row(run_id, model, seq, "best vs best", ref, best_mine, mine.max(), other,
                                             best_theirs, other_ok["tflops"].max(), "ok"))
    out = pd.DataFrame(rows)
    return out.drop(columns="run") if len(out) and out["run"].nunique() == 1 else out


def _speedup_row(run_id, model, seq, at, ref, ref_batch, ref_tflops, other, other_batch, other_tflops, status):
    return {"run": run_id, "model": model, "seq": seq, "at": at, "system": ref, "batch": ref_batch,
            "TFLOPS": ref_tflops, "vs": other, "vs batch": other_batch,
            "vs TFLOPS": other_tflops if status == "ok" else None,
            "speedup": ref_tflops / other_tflops if status == "ok" else None,
            "note": "" if status == "ok" else f"{other} {status}"}


def paper_comparison(df: pd.DataFrame) -> pd.DataFrame:
    """The paper's claims on the model shapes this suite measured, beside our best measurement of each, and whether
    the two are the same case (paper.mismatch: model, depth, sequence and batch; a source that states no batch is
    compared at our best batch, and marked not comparable)."""
    rows = []
    for claim in paper.CLAIMS:
        depth = claim.num_layers or MODELS[claim.model].num_layers
        shape = df[(df["model_name"] == claim.model) & (df["num_layers"] == depth)]
        if shape.empty:
            continue
        mine = shape[(shape["seq"] == claim.seq) & (shape["system"] == claim.system)]
        if claim.batch is not None:  # a figure at a stated batch is compared only at that batch
            mine = mine[mine["batch"] == claim.batch]
        ok = mine[mine["status"] == "ok"]
        column = "paper_tflops" if claim.flops == paper.WITH_ATTENTION else "tflops"
        best = ok.loc[ok[column].idxmax()] if len(ok) else None
        differs = None if best is None else paper.mismatch(claim, best["model_name"], best["num_layers"], best["seq"],
                                                             best["batch"])
        rows.append({
            "claim": claim.what, "source": claim.source, "their hardware": claim.hardware, "system": claim.system,
            "model": shape["model"].iloc[0], "seq": claim.seq, "their batch": claim.batch,
            "their TFLOPS": "OOM" if claim.tflops is None else claim.tflops,
            "TFLOPS count": claim.flops,
            "our TFLOPS": None if best is None else best[column],
            "our batch": None if best is None else best["batch"],
            "our system": None if best is None else best["label"],
            "our status": "ok" if best is not None else ", ".join(sorted(set(mine["status"]))) or
            ("not run" if claim.batch is None else f"not run at batch {claim.batch}"),
            "our GPU": None if best is None else best["gpu"],
            "our run": None if best is None else best["session"],
            "comparable": None if best is None else "yes" if differs is None else f"no: {differs}",
        })
    out = pd.DataFrame(rows)
    return out.astype({"their batch": "Int64", "our batch": "Int64"}) if len(out) else out


def summary_speedups(df: pd.DataFrame) -> pd.DataFrame:
    """The speedups at equal settings, one row per MegaTrain case: same session, model, sequence, batch and kernel
    setting; a column per other system (its label carries '-compiled' when compiled)."""
    rows = speedups(df)
    if rows.empty:
        return rows
    rows = rows[rows["at"].str.startswith("b=")]
    rows = rows.assign(vs=rows["vs"].str.replace("-compiled", "", regex=False))
    index = ["model", "seq", "system", "batch"]
    wide = rows.pivot(index=index, columns="vs", values="speedup")
    wide.columns = [f"x vs {c}" for c in wide.columns]
    tflops = rows.groupby(index)["TFLOPS"].first()
    return wide.join(tflops).reset_index()[[*index, "TFLOPS", *wide.columns]].sort_values(index).reset_index(
        drop=True)


def batch_headroom(df: pd.DataFrame, usable: float = GPU_FILL) -> pd.DataFrame:
    """How far each system's batch could go on this GPU, projected from its measured GPU peaks.

    Peak allocated GPU memory grows linearly with the batch at a fixed sequence length (activation
    checkpoints and per-layer work scale with tokens; weights, buffers and optimizer state do not), so
    the two largest batches a system ran give GiB per sequence, and `usable` x the GPU's memory bounds
    the batch. A projection, labelled as such: the measured columns are the record's; a ladder run to
    the failure point is what settles it.
    """
    rows = []
    ok = df[(df["status"] == "ok") & (df["device"] == "cuda") & (df["micro_batch"] == df["batch"])]  # one pass
    for (gpu, label, model, seq), g in ok.groupby(["gpu", "label", "model", "seq"], dropna=False):
        g = g.sort_values(["batch", "run_id"]).drop_duplicates("batch", keep="last")
        if len(g) < 2:
            continue
        lo, hi = g.iloc[-2], g.iloc[-1]
        per_seq = (hi["peak_gpu_alloc_gib"] - lo["peak_gpu_alloc_gib"]) / (hi["batch"] - lo["batch"])
        budget = usable * hi["gpu_mem_gib"] if hi["gpu_mem_gib"] else None
        projected = int(hi["batch"] + (budget - hi["peak_gpu_alloc_gib"]) / per_seq) \
            if budget and per_seq > 0 else None
        rows.append({"GPU": gpu, "system": label, "model": model, "seq": seq,
                     "largest batch run": int(hi["batch"]), "its GPU peak (GiB)": hi["peak_gpu_alloc_gib"],
                     "GiB per sequence": per_seq, "projected largest batch": projected})
    out = pd.DataFrame(rows)
    return out.drop(columns="GPU") if len(out) and out["GPU"].nunique() == 1 else out


def status_counts(df: pd.DataFrame) -> pd.DataFrame:
    """Cases per system and status."""
    return df.pivot_table(index="label", columns="status", values="case_id", aggfunc="count", fill_value=0)
