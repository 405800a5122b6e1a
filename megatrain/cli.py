"""Command line: python -m megatrain {bench,models,suite,probe,report} ...

Exit codes: 0 success, 1 the case ran but failed (OOM, error), 2 invalid input.
"""

from __future__ import annotations

import argparse
import json
import sys

from megatrain.config import DTYPES, PRECISIONS, CaseConfig, OptimConfig


def add_case_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", default="native", help="native | megatrain | deepspeed | fsdp")
    p.add_argument("--model", default="tiny", help="registry name (python -m megatrain models)")
    p.add_argument("--num-layers", type=int, default=None, help="override the model's depth")
    p.add_argument("--batch", type=int, default=2, help="sequences per optimizer step")
    p.add_argument("--micro-batch", type=int, default=0, help="sequences per forward/backward (0 = batch)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1, help="leading steps not timed")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--precision", default="mixed", choices=PRECISIONS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default="synthetic", help="'synthetic' or a .jsonl/.txt file")
    p.add_argument("--tokenizer", default=None, help="local HF tokenizer dir for text data")
    p.add_argument("--repeat-batch", action="store_true", help="same batch every step")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each decoder layer (every system; eager without it)")
    p.add_argument("--lr", type=float, default=OptimConfig.lr)
    p.add_argument("--weight-decay", type=float, default=OptimConfig.weight_decay)
    p.add_argument("--max-grad-norm", type=float, default=OptimConfig.max_grad_norm, help="0 disables clipping")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="system-specific setting (JSON value), repeatable")
    p.add_argument("--gemm-peak-tflops", type=float, default=None, help="measured GEMM peak for MFU")


def _parse_options(items: list[str]) -> dict:
    options = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--option takes KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def case_from_args(args: argparse.Namespace) -> CaseConfig:
    return CaseConfig(
        system=args.system, model=args.model, num_layers=args.num_layers, batch=args.batch,
        micro_batch=args.micro_batch, seq=args.seq, steps=args.steps, warmup=args.warmup, dtype=args.dtype,
        precision=args.precision, device=args.device, seed=args.seed, data=args.data, tokenizer=args.tokenizer,
        repeat_batch=args.repeat_batch, compile=args.compile,
        optim=OptimConfig(lr=args.lr, weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm),
        options=_parse_options(args.option),
    )


def params_text(n: int) -> str:
    """A parameter count readable at every size: 1.544B, 494.0M, 2.36M, 85.3K."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.4g}{unit}" if unit != "B" else f"{n / scale:.3f}B"
    return str(n)


def summary_line(record: dict) -> str:
    if record["status"] != "ok":
        return f"{record['system']} {record['model']} b={record['batch']} s={record['seq']}: " \
               f"{record['status'].upper()} {record.get('error') or ''}"
    return (f"{record['system']} {record['model']} ({params_text(record['num_params'])}) b={record['batch']} "
            f"s={record['seq']}: step {record['step_time_s']:.3f}s, {record['tokens_per_s']:.0f} tok/s, "
            f"{record['tflops']:.4g} TFLOPS (6NT), GPU peak {record['peak_gpu_alloc_gib']:.2f} GiB, "
            f"host peak {record['peak_host_rss_gib']:.2f} GiB, loss {record['losses'][0]:.4f} -> "
            f"{record['losses'][-1]:.4f}")


def preflight(case: CaseConfig) -> None:
    """Refuse (ValueError: exit 2) a case this system cannot run here or that does not fit this machine's memory,
    before anything is allocated; the message suggests a setting that fits, or says that none of those does."""
    import dataclasses

    from megatrain.bench.fit import plan_case, plan_memory
    from megatrain.bench.hardware import measure

    machine = measure(rates=False)
    plan = plan_case(case, machine)
    if plan["fits"]:
        return
    if "host_bytes" not in plan:  # the system cannot run here at all
        raise ValueError(plan["reason"])
    tries = [("--precision bf16", dataclasses.replace(case, precision="bf16"))] if case.precision == "mixed" else []
    half = case.micro_batch // 2
    if half >= 1 and case.batch % half == 0:
        tries.append((f"--micro-batch {half}", dataclasses.replace(case, micro_batch=half)))
    fixes = [flag for flag, other in tries if plan_memory(other, machine)["fits"]]
    hint = f"try {' or '.join(fixes)}" if fixes else \
        "no precision or micro-batch of this case fits: a smaller model, --batch or --seq, or a larger machine"
    raise ValueError(f"{case.system} {case.model} b{case.batch} s{case.seq} does not fit here: {plan['reason']}; "
                     f"{hint}")


def cmd_bench(args: argparse.Namespace) -> int:
    from megatrain.bench.case import run_case
    from megatrain.bench.record import append_jsonl

    case = case_from_args(args)
    preflight(case)
    record = run_case(case, gemm_peak_tflops=args.gemm_peak_tflops,
                      on_step=lambda i, loss, t: print(f"step {i}: loss {loss:.4f} ({t:.3f}s)", flush=True))
    print(summary_line(record))
    if args.out:
        append_jsonl(args.out, record)
    print(json.dumps(record), flush=True)
    return 0 if record["status"] == "ok" else 1


def cmd_models(args: argparse.Namespace) -> int:
    from megatrain.models.registry import MODELS

    for name, cfg in MODELS.items():
        print(f"{name:14s} {cfg.num_params() / 1e9:8.3f}B  layers={cfg.num_layers:3d} hidden={cfg.hidden_size:5d} "
              f"ffn={cfg.intermediate_size:5d} heads={cfg.num_heads}/{cfg.num_kv_heads} vocab={cfg.vocab_size} "
              f"tied={cfg.tie_embeddings}")
    return 0


def cmd_suite(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megatrain.bench.env import REPO_ROOT
    from megatrain.bench.suite import load_suite, run_suite

    suite = load_suite(args.name)
    out_dir = Path(args.out_dir) if args.out_dir else REPO_ROOT / "results" / suite.name
    try:
        run_suite(suite, out_dir, only=args.only, timeout_s=args.timeout, dry_run=args.dry_run,
                  new_run=args.new_run, any_hardware=args.any_hardware)
    except KeyboardInterrupt:
        print(f"\ninterrupted: the running case was killed, every finished case is in {out_dir / 'records.jsonl'}; "
              "run the same command again to resume", file=sys.stderr)
        return 130
    return 0


def cmd_probe(args: argparse.Namespace) -> int:
    from megatrain.bench.hardware import describe, measure

    machine = measure()
    print(describe(machine))
    print(json.dumps(machine), flush=True)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from megatrain.bench.report import write_reports

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
    add_case_arguments(bench)
    bench.add_argument("--out", default=None, help="append the record to this JSONL file")
    bench.set_defaults(func=cmd_bench)
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
