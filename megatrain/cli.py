"""Command line: python -m megatrain {bench,train,models,suite,probe,report} ...

Exit codes: 0 success, 1 the case ran but failed (OOM, error), 2 invalid input.
"""

from __future__ import annotations

import argparse
import json
import sys

from megatrain.bench.args import BenchFlags
from megatrain.flags import add_flags, given
from megatrain.train.config import add_train_arguments


def cmd_bench(args: argparse.Namespace) -> int:
    from megatrain.bench.case import run_case
    from megatrain.bench.record import append_jsonl, summary_line
    from megatrain.engine.distributed import first_rank
    from megatrain.preflight import preflight

    flags = BenchFlags(**given(BenchFlags, args))
    case = flags.case()
    first = first_rank(case.device)  # under torchrun every rank runs the case and rank 0 reports it
    notes = preflight(case)  # on every rank: each refuses what does not fit
    for note in notes if first else []:
        print(note, file=sys.stderr, flush=True)
    record = run_case(case, gemm_peak_tflops=flags.gemm_peak_tflops, on_step=None if not first else
                      lambda i, loss, t: print(f"step {i}: loss {loss:.4f} ({t:.3f}s)", flush=True))
    if not first:
        return 0 if record["status"] == "ok" else 1
    print(summary_line(record))
    if flags.out:
        append_jsonl(flags.out, record)
    print(json.dumps(record), flush=True)
    return 0 if record["status"] == "ok" else 1


def cmd_train(args: argparse.Namespace) -> int:
    from megatrain.train.config import config_from_args
    from megatrain.train.loop import train

    return train(config_from_args(args), log=lambda line: print(line, file=sys.stderr, flush=True))


def cmd_models(args: argparse.Namespace) -> int:
    from megatrain.models.registry import HF_CONFIGS, MODELS, get_model_config

    for name, cfg in {**MODELS, **{n: get_model_config(n) for n in HF_CONFIGS}}.items():
        experts = f" experts={cfg.num_experts_per_tok}/{cfg.num_experts}x{cfg.moe_intermediate_size} " \
            f"active={cfg.active_params() / 1e9:.3f}B" if cfg.is_moe else ""
        print(f"{name:15s} {cfg.num_params() / 1e9:8.3f}B  layers={cfg.num_layers:3d} hidden={cfg.hidden_size:5d} "
              f"ffn={cfg.intermediate_size:5d} heads={cfg.num_heads}/{cfg.num_kv_heads} vocab={cfg.vocab_size} "
              f"tied={cfg.tie_embeddings}{experts}"
              + ("" if name in MODELS else f" ({cfg.family}: transformers' own modules)"))
    return 0


def cmd_suite(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megatrain.bench.env import WORKSPACE
    from megatrain.bench.suite import load_suite, run_suite

    suite = load_suite(args.name)
    out_dir = Path(args.out_dir) if args.out_dir else WORKSPACE / "results" / suite.name
    try:
        run_suite(suite, out_dir, only=args.only, timeout_s=args.timeout, dry_run=args.dry_run,
                  new_run=args.new_run, any_hardware=args.any_hardware)
    except KeyboardInterrupt:
        print(f"\ninterrupted: the running case was killed, every finished case is in {out_dir / 'records.jsonl'}; "
              "run the same command again to resume", file=sys.stderr)
        return 130
    return 0


def cmd_probe(args: argparse.Namespace) -> int:
    from megatrain.probe import measure

    machine = measure()
    print(machine.describe())
    print(json.dumps(machine.to_dict()), flush=True)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from megatrain.analysis.report import write_reports

    paths = write_reports(args.suites, out=args.out)
    for path in paths:
        print(f"report: {path}")
    if not paths:
        print("no records under results/<suite>/ (local *-local runs are left out unless named)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatrain", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="run one benchmark case; last stdout line is its JSON record")
    add_flags(bench, BenchFlags)
    bench.set_defaults(func=cmd_bench)
    train = sub.add_parser("train", help="train a model: a Hugging Face checkpoint (or a registry shape) and your "
                           "data in, metrics, checkpoints and a Hugging Face checkpoint out; --resume continues",
                           epilog="Exit codes: 0 done; 1 diverged (--max-nonfinite-steps), or under torchrun a rank "
                           "ended; 2 invalid input, --out in use or holding another run, a damaged checkpoint, a full "
                           "disk (one line each); 130 after Ctrl-C and 143 after SIGTERM, each once the step is "
                           "finished and saved. On N ranks: torchrun --nproc-per-node N -m megatrain train ...")
    add_train_arguments(train)
    train.set_defaults(func=cmd_train)
    models = sub.add_parser("models", help="list the model registry with exact parameter counts")
    models.set_defaults(func=cmd_models)
    suite = sub.add_parser("suite", help="run a suite (suites/NAME.toml), one subprocess and one record per case")
    suite.add_argument("name", help="suite name (suites/NAME.toml) or path to a .toml file")
    suite.add_argument("--out-dir", default=None, help="results directory (default results/NAME)")
    suite.add_argument("--only", default=None, metavar="REGEX",
                       help="run the cases whose '<group> <name> <case_id>' matches")
    suite.add_argument("--timeout", type=float, default=None, metavar="S", help="per-case limit, overrides the suite's")
    suite.add_argument("--dry-run", action="store_true", help="list the cases and their memory plans; run nothing")
    suite.add_argument("--new-run", action="store_true", help="start a new run instead of resuming the latest one")
    suite.add_argument("--any-hardware", action="store_true",
                       help="also run cases whose hardware profile does not match this machine")
    suite.set_defaults(func=cmd_suite)
    probe = sub.add_parser("probe", help="measure this machine: PCIe, GEMM, host memory, CPU AdamW (seconds)")
    probe.set_defaults(func=cmd_probe)
    report = sub.add_parser("report", help="regenerate HTML reports from records (results/SUITE/records.jsonl)")
    report.add_argument("suites", nargs="*", help="suite names or results directories (default: every one under "
                        "results/ except *-local)")
    report.add_argument("--out", default=None, help="report directory (one suite only; default reports/NAME)")
    report.set_defaults(func=cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        from megatrain.engine.distributed import leave

        leave()
