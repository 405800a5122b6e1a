"""Walk every *ForCausalLM of the installed transformers through the generic path (megatrain.checks.walk) and
write the table: results/generic/transformers-<version>.json (one object per model type) and .md (the counts, the
refused ones with their reasons, the rest by status).

    python scripts/walk_transformers.py [--only TYPE,...] [--out DIR]

CPU, a few seconds a family (all of them: minutes).
"""

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: this checkout's package

from megatrain.checks.walk import STATUSES, as_dicts, causal_lm_types, walk  # noqa: E402


def markdown(results: list, version: str) -> str:
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
    parser.add_argument("--only", default=None, help="comma-separated model types (default: all)")
    parser.add_argument("--out", default=str(ROOT / "results" / "generic"))
    args = parser.parse_args()
    types = causal_lm_types()
    if args.only:
        types = {t: types[t] for t in args.only.split(",")}
    results = []
    for model_type, causal_lm in types.items():
        (result,) = walk({model_type: causal_lm})
        print(f"{model_type:28s} {result.status:8s} {result.detail[:100]}", flush=True)
        results.append(result)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"transformers-{transformers.__version__}"
    (out / f"{stem}.json").write_text(json.dumps(as_dicts(results), indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown(results, transformers.__version__) + "\n")
    print(f"{sum(r.status == 'trains' for r in results)} of {len(results)} train; {out / stem}.md")


if __name__ == "__main__":
    main()
