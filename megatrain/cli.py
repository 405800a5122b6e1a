"""Command line: python -m megatrain {bench,train,models,suite,probe,report} ...

Exit codes: 0 success, 1 the case ran but failed (OOM, error), 2 invalid input.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shlex
import sys
import warnings
from typing import NoReturn

from megatrain import __version__


def cmd_bench(args: argparse.Namespace) -> int:
    from megatrain.bench.args import BenchFlags
    from megatrain.bench.case import run_case
    from megatrain.bench.record import append_jsonl, check_appendable, summary_line
    from megatrain.engine.distributed import first_rank, launch_size
    from megatrain.flags import given
    from megatrain.preflight import preflight

    flags = BenchFlags(**given(BenchFlags, args))
    case = flags.case()
    world = launch_size()[0]
    if case.ranks != world:
        raise ValueError(f"--ranks {case.ranks} but this launch has {world} process(es): start it with "
                         f"torchrun --nproc-per-node {case.ranks} -m megatrain bench ... (or drop --ranks)")
    if flags.out:
        check_appendable(flags.out)
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
    if flags.json:
        print(json.dumps(record), flush=True)
    return 0 if record["status"] == "ok" else 1


def cmd_train(args: argparse.Namespace) -> int:
    from megatrain.api import run
    from megatrain.train.config import config_from_args

    return run(config_from_args(args), log=lambda line: print(line, file=sys.stderr, flush=True)).exit_code


def cmd_models(args: argparse.Namespace) -> int:
    from megatrain.bench.record import params_text
    from megatrain.models.registry import HF_CONFIGS, MODELS, model_shape

    for name, cfg in {**MODELS, **{n: model_shape(n) for n in HF_CONFIGS}}.items():
        experts = f" experts={cfg.num_experts_per_tok}/{cfg.num_experts}x{cfg.moe_intermediate_size} " \
            f"active={params_text(cfg.active_params())}" if cfg.is_moe else ""
        print(f"{name:15s} {params_text(cfg.num_params()):>8s}  layers={cfg.num_layers:3d} hidden={cfg.hidden_size:5d} "
              f"ffn={cfg.intermediate_size:5d} heads={cfg.num_heads}/{cfg.num_kv_heads} vocab={cfg.vocab_size} "
              f"tied={cfg.tie_embeddings}{experts}"
              + ("" if name in MODELS else f" ({cfg.family}: transformers' own modules)"))
    return 0


def cmd_suite(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megatrain.bench.suite import load_suite, run_suite, sole_runner
    from megatrain.workspace import WORKSPACE

    suite = load_suite(args.name)
    out_dir = Path(args.out_dir) if args.out_dir else WORKSPACE / "results" / suite.name
    try:
        with contextlib.nullcontext() if args.dry_run else sole_runner(out_dir):
            run_suite(suite, out_dir, only=args.only, timeout_s=args.timeout, dry_run=args.dry_run,
                      new_run=args.new_run, any_hardware=args.any_hardware)
    except KeyboardInterrupt:
        print(f"\ninterrupted: the running case was killed, every finished case is in {out_dir / 'records.jsonl'}; "
              f"to resume: {_resume_command(args, out_dir)}", file=sys.stderr)
        return 130
    return 0


def _resume_command(args: argparse.Namespace, out_dir) -> str:
    """The suite command that resumes the run in out_dir: this one's cases and limits, without --new-run."""
    argv = ["python", "-m", "megatrain", "suite", args.name, "--out-dir", str(out_dir)]
    argv += ["--only", args.only] if args.only else []
    argv += ["--timeout", str(args.timeout)] if args.timeout is not None else []
    argv += ["--any-hardware"] if args.any_hardware else []
    return shlex.join(argv)


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


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    from megatrain.bench.args import BenchFlags
    from megatrain.flags import add_flags

    add_flags(p, BenchFlags)


def _train_arguments(p: argparse.ArgumentParser) -> None:
    from megatrain.train.config import add_train_arguments

    add_train_arguments(p)


def regex(text: str) -> str:
    """A flag's regular expression, checked as argparse reads it: one that does not compile is refused (exit 2)."""
    try:
        re.compile(text)
    except re.error as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a regular expression ({exc})") from None
    return text


def limit_s(text: str) -> float:
    """A flag's time limit in seconds, checked as argparse reads it: a finite number > 0."""
    from megatrain.bench.suite import seconds

    value = float(text)  # argparse says a text that is no number is invalid
    if not seconds(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0")
    return value


def _suite_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="suite name (suites/NAME.toml) or path to a .toml file")
    p.add_argument("--out-dir", default=None, help="results directory (default results/NAME)")
    p.add_argument("--only", default=None, metavar="REGEX", type=regex,
                   help="run the cases whose '<group> <name> <case_id>' matches")
    p.add_argument("--timeout", type=limit_s, default=None, metavar="S", help="per-case limit, overrides the suite's")
    p.add_argument("--dry-run", action="store_true", help="list the cases and their memory plans; run nothing")
    p.add_argument("--new-run", action="store_true", help="start a new run instead of resuming the latest one")
    p.add_argument("--any-hardware", action="store_true",
                   help="also run cases whose hardware profile does not match this machine")


def _report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("suites", nargs="*", help="suite names or results directories (default: every one under results/ "
                   "except *-local)")
    p.add_argument("--out", default=None, help="report directory (one suite only; default reports/NAME)")


TRAIN_EPILOG = ("Exit codes: 0 done; 1 diverged (--max-nonfinite-steps) or ended on a step that was not finite "
                "(nothing saved or exported), or under torchrun a rank ended or stopped answering "
                "(MEGATRAIN_RANK_TIMEOUT_S); 2 invalid input, --out in use or holding another run, a damaged "
                "checkpoint or one in a pickle format another user wrote (--trust-checkpoint), data changed since the "
                "run started, a full or read-only disk (one line each); 130 after Ctrl-C, 143 after SIGTERM and 129 "
                "after SIGHUP (a closed terminal), each once the step is finished and saved (during the export, once "
                "it is whole). On N ranks: torchrun --nproc-per-node N -m megatrain train ...")
# name: (help, its arguments, its function, add_parser's other keywords)
COMMANDS = {
    "bench": ("run one benchmark case: its steps and a summary line (--json: its record as the last line)",
              _bench_arguments, cmd_bench, {}),
    "train": ("train a model: a Hugging Face checkpoint (or a registry shape) and your data in, metrics, checkpoints "
              "and a Hugging Face checkpoint out; --resume continues", _train_arguments, cmd_train,
              {"epilog": TRAIN_EPILOG}),
    "models": ("list the model registry with exact parameter counts", None, cmd_models, {}),
    "suite": ("run a suite (suites/NAME.toml), one subprocess and one record per case", _suite_arguments, cmd_suite,
              {}),
    "probe": ("measure this machine: PCIe, GEMM, host memory, CPU AdamW (seconds)", None, cmd_probe, {}),
    "report": ("regenerate HTML reports from records (results/SUITE/records.jsonl)", _report_arguments, cmd_report,
               {}),
}


class _Parser(argparse.ArgumentParser):
    """argparse's parser (and its commands'), whose refusal of a flag is one line, as every other refusal is: argparse
    printed the command's whole usage first, 24 lines for train's flags above the line that matters."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line; with `command`, only the arguments of the command it names are declared (none when it names
    none): bench's and train's flags take their defaults from modules that import torch, which `--help`, `--version`
    and the other commands do without."""
    parser = _Parser(prog="python -m megatrain", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"megatrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, arguments, func, keywords) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, **keywords)
        p.set_defaults(func=func)
        if arguments is not None and command in (None, name):
            arguments(p)
    return parser


def _warning_line(message, category, filename, lineno, line=None) -> str:
    """A warning as the command line prints it: one line, without the source line that raised it."""
    return f"warning: {message}\n"


def exit_process(code: int) -> NoReturn:
    """End this process with `code`, as `python -m megatrain` does: a process whose torch made process groups (a
    torchrun rank, or an FSDP2 or DeepSpeed run of one process, even with its groups destroyed) ends without the
    interpreter's teardown, where torch's process-group threads can abort it after its last line ('terminate called
    without an active exception', exit -6 for 2: pytorch/pytorch#179291); any other ends as sys.exit does."""
    if "torch.distributed" in sys.modules:  # a command that never loaded torch made no process groups
        from megatrain.engine.distributed import exit_rank, teardown_may_abort

        if teardown_may_abort():
            exit_rank(code)  # output flushed, then os._exit
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    warnings.formatwarning = _warning_line
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), "")  # the top level has no option taking a value
    args = build_parser(command).parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before a command's own handling of Ctrl-C began, or in one that has none
        print("\ninterrupted (Ctrl-C)", file=sys.stderr)
        return 130
    finally:
        if "torch.distributed" in sys.modules:  # else this process made no process group, and needs no torch
            from megatrain.engine.distributed import leave

            leave()
