"""The arguments of one case, shared by `bench` and the suite runner (which rebuilds a case's command line)."""

from __future__ import annotations

import argparse
import json

from megatrain.config import DTYPES, PRECISIONS, CaseConfig
from megatrain.optim.config import OptimConfig
from megatrain.systems import SYSTEMS


def add_case_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", default="native", help=" | ".join(SYSTEMS))
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


def parse_option_flags(items: list[str]) -> dict:
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
        options=parse_option_flags(args.option),
    )
