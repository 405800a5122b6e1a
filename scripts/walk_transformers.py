"""Walk every *ForCausalLM of the installed transformers through the generic path (megatrain.checks.walk) and
write the table: results/generic/transformers-<version>.json (one object per model type) and .md (the counts, the
refused ones with their reasons, the rest by status).

    python scripts/walk_transformers.py [--only TYPE,...] [--out DIR]
    python scripts/walk_transformers.py --curves cuda [--jobs N] [--only TYPE,...] [--out DIR]
    python scripts/walk_transformers.py --published [--curves cuda] [--only HUB_ID,...] [--out DIR]

CPU, a few seconds a family (all of them: minutes). --curves DEVICE walks again, on DEVICE, every family the table
of this transformers says trains: CURVE_STEPS (8) steps in bf16 against transformers' own run (megatrain.checks.walk.
curve_family), in N processes side by side, into transformers-<version>-curves.json (with the machine and commit it
ran on), and adds its column to the table's .md; with --only, those families again, each row with its own machine
and commit, the others as the record has them.

--published walks the published checkpoints instead (megatrain.models.published: each config.json at the tiny widths,
every switch as published; a few seconds each) into published-transformers-<version>.json and .md (with --only, those
rows again, the others as the record has them); with --curves
DEVICE, every one of them that trains, at its published widths and a cut depth (megatrain.checks.walk.
curve_published), into published-transformers-<version>-curves.json, written after each checkpoint, each naming the
machine and commit it ran at; run again at the same commit it goes on past those already there (a device call's limit
cut it), and with --only it runs those checkpoints again, keeping the others.
"""

import argparse
import dataclasses
import json
import os
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: this checkout's package

from megatrain.bench.env import same_code_as  # noqa: E402
from megatrain.checks.walk import (  # noqa: E402
    CURVE_SETTING,
    CURVE_STATUSES,
    STATUSES,
    FamilyResult,
    PublishedResult,
    as_dicts,
    causal_lm_types,
    curve_depth,
    curve_family,
    curve_published,
    try_published,
    walk,
)
from megatrain.train.rundir import aside  # noqa: E402


def markdown(results: list, version: str, curves: dict | None = None) -> str:
    counts = Counter(r.status for r in results)
    lines = [f"# The generic path over transformers {version}", "",
             f"{counts['trains']} of {len(results)} text decoders (model types with a *ForCausalLM class) train "
             "through transformers' own modules, equal to transformers to 1e-5 (one step, tiny size, fp32, CPU, train "
             "mode: a family's default dropout or jitter drawn alike on both sides, named after its numbers; "
             "scripts/walk_transformers.py).", "",
             "| status | model types |", "| --- | --- |",
             *[f"| {s} | {counts[s]} |" for s in STATUSES], ""]
    for status in STATUSES:
        chosen = [r for r in results if r.status == status]
        if not chosen:
            continue
        lines += [f"## {status}", ""]
        if status == "trains" and curves:
            by_type = {c["model_type"]: c for c in curves["families"]}
            env = curves["env"]
            where = env["gpu"] or env["device"]
            lines += [f"In bf16 on {where} ({_setting()}, eager, the engine against "
                      "transformers' own module under torch.optim.AdamW from the same weights, within 3 of native's "
                      "spreads + 1% of its loss + 1e-4 at every step; commit "
                      f"{env['commit'][:7]}, torch {env['torch']}): "
                      + ", ".join(f"{sum(c['status'] == st for c in curves['families'])} {st}"
                                  for st in CURVE_STATUSES) + ".", "",
                      "| model type | class | bf16 curve | detail |", "| --- | --- | --- | --- |"]
            for r in chosen:
                c = by_type.get(r.model_type, {"status": "not run", "detail": ""})
                again = f" (run again at {c['env']['commit'][:7]} on {c['env']['gpu'] or c['env']['device']})" \
                    if "env" in c else ""
                lines.append(f"| {r.model_type} | {r.causal_lm} | {c['status']} | "
                             f"{c['detail'].replace('|', '/')}{again} |")
            lines.append("")
            continue
        if status == "trains":
            lines += [", ".join(r.model_type for r in chosen), ""]
            continue
        lines += ["| model type | class | why |", "| --- | --- | --- |"]
        lines += [f"| {r.model_type} | {r.causal_lm} | {r.detail.replace('|', '/')} |" for r in chosen]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    import transformers

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=None, help="comma-separated model types, or hub ids with --published "
                        "(default: all)")
    parser.add_argument("--published", action="store_true", help="the published checkpoints' configs, not the "
                        "families' defaults")
    parser.add_argument("--out", default=str(ROOT / "results" / "generic"))
    parser.add_argument("--curves", metavar="DEVICE", help="the bf16 curves of the families the table says train")
    parser.add_argument("--jobs", type=int, default=1, help="--curves: processes side by side")
    args = parser.parse_args()
    out = Path(args.out)
    stem = f"transformers-{transformers.__version__}"
    if args.published:
        return walk_published(args.curves, args.only.split(",") if args.only else None, out, f"published-{stem}")
    if args.curves:
        return curves(args.curves, args.jobs, out, stem, args.only.split(",") if args.only else None)
    types = causal_lm_types()
    if args.only:
        types = {t: types[t] for t in args.only.split(",")}
    results = []
    for model_type, causal_lm in types.items():
        (result,) = walk({model_type: causal_lm})
        print(f"{model_type:28s} {result.status:8s} {result.detail[:100]}", flush=True)
        results.append(result)
    out.mkdir(parents=True, exist_ok=True)
    _write(out / f"{stem}.json", json.dumps(as_dicts(results), indent=1) + "\n")
    _write(out / f"{stem}.md", markdown(results, transformers.__version__, _curves(out, stem)) + "\n")
    print(f"{sum(r.status == 'trains' for r in results)} of {len(results)} train; {out / stem}.md")


def _write(path: Path, text: str) -> None:
    """path's text replaced whole (written beside it, then renamed over it): a walk stopped by a device call's limit
    (SIGTERM) leaves the record as its last checkpoint left it, not cut in the middle."""
    part = aside(path, "tmp")
    part.write_text(text)
    os.replace(part, path)


def _setting() -> str:
    """The walk's curve setting in words (megatrain.checks.walk.CURVE_SETTING)."""
    c = CURVE_SETTING
    return f"{c['steps']} AdamW steps at lr {c['lr']:g} of one repeated batch of {c['batch']} x {c['seq']} tokens"


def _curves(out: Path, stem: str) -> dict | None:
    path = out / f"{stem}-curves.json"
    return json.loads(path.read_text()) if path.exists() else None


def _curve_job(args: tuple) -> dict:
    return curve_family(*args)


def _refuse(message: str) -> None:
    """A bad request: one line, exit 2."""
    print(f"walk_transformers: {message}", file=sys.stderr)
    raise SystemExit(2)


def merge_curves(old: dict, done: list[dict], env: dict, order: list[str]) -> dict:
    """The curves record `old` with the families of `done` run again: each of those carries its own `env` (the
    record's stays that of the run that walked the rest), in the table's `order` of model types."""
    by_type = {c["model_type"]: c for c in old["families"]}
    by_type.update({c["model_type"]: {**c, "env": env} for c in done})
    return {**old, "families": [by_type[t] for t in order if t in by_type]}


def curves(device: str, jobs: int, out: Path, stem: str, only: list[str] | None = None) -> None:
    """The bf16 curves of every family the table says trains (with `only`, those families again, merged into the
    record beside the others: merge_curves), written beside it, and the table's .md again."""
    import multiprocessing

    import transformers

    from megatrain.bench.env import environment

    results = [FamilyResult(**r) for r in json.loads((out / f"{stem}.json").read_text())]
    trains = [r for r in results if r.status == "trains"]
    if only and (unknown := sorted(set(only) - {r.model_type for r in trains})):
        _refuse(f"--only {','.join(unknown)}: not a model type the table of {stem} says trains")
    old = _curves(out, stem) if only else None
    if only and old is None:
        _refuse(f"--curves --only runs families again beside a whole walk's curves: {stem}-curves.json is not there "
                "(run --curves without --only first)")
    todo = [(r.model_type, r.causal_lm, device) for r in trains if not only or r.model_type in only]
    done = []
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        for c in pool.imap(_curve_job, todo):
            print(f"{c['model_type']:28s} {c['status']:7s} {c['detail'][:100]}", flush=True)
            done.append(c)
    env = {**environment(), "device": device}
    record = merge_curves(old, done, env, [r.model_type for r in results]) if only else \
        {"env": env, **CURVE_SETTING, "families": done}
    _write(out / f"{stem}-curves.json", json.dumps(record, indent=1) + "\n")
    _write(out / f"{stem}.md", markdown(results, transformers.__version__, record) + "\n")
    print(f"{sum(c['status'] == 'tracks' for c in done)} of {len(done)} track transformers in bf16 on {device}")


def _where(env: dict) -> str:
    """Where a curve ran, for the table: its GPU (or device), commit and torch."""
    return f"{env.get('gpu') or env.get('device')}, commit {env['commit'][:7]}, torch {env['torch']}"


def published_markdown(results: list, version: str, curves: dict | None = None) -> str:
    from megatrain.models.published import get_published

    counts = Counter(r.status for r in results)
    by_id = {c["hub_id"]: c for c in (curves or {}).get("checkpoints", [])}
    lines = [f"# Published checkpoints through transformers {version}", "",
             f"{counts['trains']} of {len(results)} published checkpoints (megatrain/models/published/: each one's "
             "text config.json, named by its hub id, and where its values were read) train equal to transformers to "
             "1e-5: CPU, the published config with every width cut to the walk's tiny sizes and every switch as "
             "published (per-layer inputs, keys equal to values, experts, softcapping, window patterns, RoPE type "
             "and scaling, dropout, tied embeddings), at the fewest layers that hold each kind of layer it has; one "
             "step in fp32, train mode (scripts/walk_transformers.py --published).", "",
             "| CPU | checkpoints |", "| --- | --- |", *[f"| {s} | {counts[s]} |" for s in STATUSES], "",
             "Walked (commit, CPU, torch): " + "; ".join(
                 f"{n} at {where or 'an unrecorded commit (before the rows kept it)'}"
                 for where, n in Counter(r.walked for r in results).most_common()) + ".", ""]
    if curves:
        envs = Counter(_where(c.get("env") or curves["env"]) for c in curves["checkpoints"])
        lines += [f"The GPU column: each checkpoint at its published widths and the layers named, in bf16 "
                  f"({_setting()}, eager, the engine against transformers' own module "
                  "under torch.optim.AdamW from the same weights, within 3 of native's spreads + 1% of its loss + "
                  "1e-4 at every step, a learnt step's spread the largest among learnt steps, as the GPU suite "
                  "judges: megatrain/checks/band.py; the rows run before c7931ce track by the walk's earlier rule "
                  "too): "
                  + ", ".join(f"{sum(c['status'] == st for c in curves['checkpoints'])} {st}"
                              for st in CURVE_STATUSES) + "; run " + "; ".join(
                      f"{n} at {where}" for where, n in envs.most_common()) + ".", ""]
    else:
        lines += ["The GPU column (published widths, a cut depth, a bf16 curve against transformers' own module): "
                  "not run with this transformers (`python scripts/walk_transformers.py --published --curves cuda`).",
                  ""]
    lines += ["| checkpoint | model type | CPU | detail | GPU layers | bf16 curve | detail |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        c = by_id.get(r.hub_id, {"status": "not run", "detail": ""})
        depth = curve_depth(get_published(r.hub_id).config)
        lines.append(f"| {r.hub_id} | {r.model_type} | {r.status} | {r.detail.replace('|', '/')} | {depth} | "
                     f"{c['status']} | {c['detail'].replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def walk_published(device: str | None, only: list[str] | None, out: Path, stem: str) -> None:
    """The published checkpoints: their CPU column (no device), or their GPU curves on `device` (of those the CPU
    table says train), the table's .md written again with it."""
    import transformers

    from megatrain.bench.env import environment
    from megatrain.models.published import get_published, published

    chosen = [get_published(h) for h in only] if only else list(published())
    out.mkdir(parents=True, exist_ok=True)
    if device is None:
        walked = {}
        env = environment()
        where = f"{env['commit'][:7]}{'+' if env['dirty'] else ''} on {env['cpu']}, torch {env['torch']}"
        for row in chosen:
            result = dataclasses.replace(try_published(row), walked=where)
            print(f"{row.hub_id:48s} {result.status:8s} {result.detail[:100]}", flush=True)
            walked[row.hub_id] = result
        record = out / f"{stem}.json"  # --only walks those rows again: the others keep the record's results
        kept = {r["hub_id"]: PublishedResult(**r) for r in json.loads(record.read_text())} if only and record.exists() \
            else {}
        results = [walked.get(row.hub_id) or kept[row.hub_id] for row in published()
                   if row.hub_id in walked or row.hub_id in kept]
        _write(record, json.dumps(as_dicts(results), indent=1) + "\n")
        _write(out / f"{stem}.md", published_markdown(results, transformers.__version__, _curves(out, stem)))
        print(f"{sum(r.status == 'trains' for r in results)} of {len(results)} train; {out / stem}.md")
        return
    table = out / f"{stem}.json"
    if not table.exists():
        _refuse(f"--published --curves needs the CPU column of this transformers first ({table} is not there): "
                "python scripts/walk_transformers.py --published")
    results = [PublishedResult(**r) for r in json.loads(table.read_text())]
    trains = {r.hub_id for r in results if r.status == "trains"}
    env = {**environment(), "device": device}
    record = resume_curves(_curves(out, stem), env)
    for row in chosen:
        if row.hub_id not in trains:
            continue
        if not only and row.hub_id in record["done_here"]:
            print(f"{row.hub_id:48s} already run at {env['commit'][:7]}", flush=True)
            continue
        c = curve_published(row.hub_id, device)
        print(f"{row.hub_id:48s} {c['status']:7s} {c['detail'][:100]}", flush=True)
        record = land_curve(record, {**c, "env": env}, [r.hub_id for r in results])
        _write(out / f"{stem}-curves.json", json.dumps(public(record), indent=1) + "\n")  # each, as it lands
    _write(out / f"{stem}.md", published_markdown(results, transformers.__version__, public(record)))


def resume_curves(old: dict | None, env: dict) -> dict:
    """The published curves record to go on from: `old` (or an empty one), each checkpoint carrying the machine and
    commit it ran at (an older row the record's), and which of them ran on `env`'s code (same_code_as: the code digest,
    or the commit in a clean tree): a run cut by a device call's limit goes on with the rest in the next call, its
    record carried there, records committed between the calls or not."""
    rows = [{**c, "env": c.get("env") or old["env"]} for c in (old or {}).get("checkpoints", [])]
    done = {c["hub_id"] for c in rows if same_code_as(c["env"], env)}
    return {"env": env, **CURVE_SETTING, "checkpoints": rows, "done_here": done}


def land_curve(record: dict, curve: dict, order: list[str]) -> dict:
    """`record` with `curve` in its checkpoint's place (replacing an earlier run of it), in the table's `order`."""
    by_hub = {c["hub_id"]: c for c in record["checkpoints"]}
    by_hub[curve["hub_id"]] = curve
    return {**record, "checkpoints": [by_hub[h] for h in order if h in by_hub]}


def public(record: dict) -> dict:
    """The record as written: its bookkeeping left out."""
    return {k: v for k, v in record.items() if k != "done_here"}


if __name__ == "__main__":
    main()
