"""The training loop of `python -m megatrain train`: data, schedule, steps, metrics, checkpoints, resume, export."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import signal
import sys
import time
from pathlib import Path

import torch

from megatrain.config import CaseConfig
from megatrain.memory import peak_host_rss_gib
from megatrain.models.hf import config_from_hf, iter_hf_tensors, save_hf_checkpoint
from megatrain.models.loss import IGNORE_INDEX
from megatrain.models.registry import get_model_config
from megatrain.systems import build_system
from megatrain.train import checkpoint
from megatrain.train.config import TrainConfig
from megatrain.train.data import Rows, Tokenizer, data_files, read_examples
from megatrain.train.lr import lr_at

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "generation_config.json", "chat_template.jinja")
EXPORT_SHARD_BYTES = 2**29  # the most a Hugging Face export holds in memory beyond training's own state


def _model(cfg: TrainConfig) -> tuple[str, object, str]:
    """(label, shape or None for a registry name, Hugging Face model_type for the export)."""
    if cfg.init_from:
        hf = json.loads((Path(cfg.init_from) / "config.json").read_text())
        return Path(cfg.init_from).name, config_from_hf(hf), hf["model_type"]
    return cfg.model, None, "llama" if not get_model_config(cfg.model).qkv_bias else "qwen2"


def build_case(cfg: TrainConfig, total_steps: int, label: str, shape) -> CaseConfig:
    return CaseConfig(system=cfg.system, model=label, model_shape=shape, batch=cfg.batch, micro_batch=cfg.micro_batch,
                      seq=cfg.seq, steps=total_steps, warmup=0, dtype=cfg.dtype, precision=cfg.precision,
                      device=cfg.device, seed=cfg.seed, compile=cfg.compile, optim=cfg.optim(), options=cfg.option)


def train(cfg: TrainConfig, log=print) -> int:
    """Run (or resume) training as configured; returns the exit code (130 after Ctrl-C, with a checkpoint)."""
    from megatrain.bench.fit import preflight

    out = Path(cfg.out)
    tokenizer_dir = cfg.tokenizer or (cfg.init_from if cfg.init_from and
                                      (Path(cfg.init_from) / "tokenizer.json").exists() else None)
    tokenizer = Tokenizer(tokenizer_dir) if tokenizer_dir else None
    label, shape, model_type = _model(cfg)
    vocab = (shape or get_model_config(cfg.model)).vocab_size
    rows = Rows(read_examples(data_files(cfg.data), tokenizer, cfg.train_on_prompt), cfg.seq, vocab, cfg.shuffle,
                cfg.seed, cfg.pack)
    eval_rows = Rows(read_examples(data_files(cfg.eval_data), tokenizer, cfg.train_on_prompt), cfg.seq, vocab,
                     False, cfg.seed, cfg.pack) if cfg.eval_data else None
    total = cfg.steps if cfg.steps is not None else math.ceil(cfg.epochs * len(rows) / cfg.batch)
    case = build_case(cfg, total, label, shape)
    for note in preflight(case):
        log(note)
    saves = cfg.save * (1 + (len(range(cfg.save_every, total, cfg.save_every)) if cfg.save_every else 0))
    export_bytes = case.model_config().num_params() * (2 if cfg.dtype == "bfloat16" else 4)
    checkpoint.check_disk(case, out, saves, cfg.keep, export_bytes)
    layout = f"packed into {len(rows)} rows" if cfg.pack else f"one per row, {rows.truncated} truncated"
    log(f"train: {label} on {cfg.system}, {rows.examples} examples {layout} of {cfg.seq + 1} tokens "
        f"({rows.fill:.0%} data, the rest padding), {total} steps of {cfg.batch} x {cfg.seq}")
    start = 0
    resume_from = checkpoint.latest(Path(cfg.resume) / "checkpoints") if cfg.resume else None
    if cfg.resume and resume_from is None:
        raise ValueError(f"--resume {cfg.resume}: no complete checkpoint under {Path(cfg.resume) / 'checkpoints'}")
    system = build_system(case)
    stop = {"signal": False}
    previous = signal.signal(signal.SIGINT, lambda *_: stop.update(signal=True))  # finish the step, then save
    memory = {"host_peak_gib_built": peak_host_rss_gib()}
    try:
        if resume_from is not None:
            meta = json.loads((resume_from / checkpoint.META_FILE).read_text())
            t0 = time.perf_counter()
            system.load_state(resume_from)
            memory.update(load_s=time.perf_counter() - t0, host_peak_gib_loaded=peak_host_rss_gib())
            torch.set_rng_state(torch.tensor(meta["torch_rng"], dtype=torch.uint8))
            start = meta["step"]
            log(f"resumed from {resume_from} at step {start}")
        elif cfg.init_from:
            system.load_weights(iter_hf_tensors(cfg.init_from))
        done = _run_steps(cfg, system, case, rows, eval_rows, start, total, out, stop, log)
        memory["host_peak_gib_trained"] = peak_host_rss_gib()
        if cfg.save:
            t0 = time.perf_counter()
            _save(cfg, system, out, done, total)
            memory.update(save_s=time.perf_counter() - t0, host_peak_gib_saved=peak_host_rss_gib())
        if stop["signal"]:
            log(f"interrupted: checkpoint at step {done} in {out / 'checkpoints'}; --resume {out} continues"
                if cfg.save else f"interrupted at step {done}; no checkpoint (--no-save)")
            return 130
        t0 = time.perf_counter()
        _export(system, case, out / "hf", model_type, tokenizer_dir)
        memory.update(export_s=time.perf_counter() - t0, host_peak_gib_exported=peak_host_rss_gib())
        (out / "memory.json").write_text(json.dumps(memory, indent=1) + "\n")
        log(f"done: {done} steps; Hugging Face checkpoint in {out / 'hf'}; host peak RSS (GiB) "
            + ", ".join(f"{k.removeprefix('host_peak_gib_')} {v:.2f}" for k, v in memory.items() if "gib" in k))
        return 0
    finally:
        signal.signal(signal.SIGINT, previous)
        system.close()


def _run_steps(cfg, system, case, rows, eval_rows, start, total, out, stop, log) -> int:
    out.mkdir(parents=True, exist_ok=True)
    flops_per_token = 6 * case.model_config().num_params()
    bar = None
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)
    step = start
    with (out / "metrics.jsonl").open("a") as metrics:
        while step < total and not stop["signal"]:
            lr = lr_at(step, total, cfg.lr, cfg.lr_schedule, cfg.warmup_steps, cfg.min_lr)
            system.set_lr(lr)
            inputs, labels, segments = rows.batch(step * cfg.batch, cfg.batch)
            t0 = time.perf_counter()
            loss = system.step(inputs, labels, segments)
            if case.device == "cuda":
                torch.cuda.synchronize()
            step_s = time.perf_counter() - t0
            step += 1
            tokens = inputs.numel()
            targets = int((labels != IGNORE_INDEX).sum())
            line = {"step": step, "loss": loss, "lr": lr, "grad_norm": system.last_grad_norm, "tokens": tokens,
                    "target_tokens": targets, "tokens_per_s": tokens / step_s, "target_tokens_per_s": targets / step_s,
                    "tflops": flops_per_token * tokens / step_s / 1e12, "step_s": step_s}
            metrics.write(json.dumps(line) + "\n")
            metrics.flush()
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{line['tokens_per_s']:.0f}", lr=f"{lr:.2e}")
                bar.update(1)
            elif step % cfg.log_every == 0 or step == total:
                log(f"step {step}/{total}: loss {loss:.4f}, lr {lr:.3e}, grad norm {line['grad_norm']:.3f}, "
                    f"{line['tokens_per_s']:.0f} tok/s, {line['tflops']:.3g} TFLOPS, ETA "
                    f"{(total - step) * step_s:.0f} s")
            if eval_rows is not None and (step % cfg.eval_every == 0 or step == total):
                held_out = _evaluate(system, eval_rows, cfg.batch)
                metrics.write(json.dumps({"step": step, **held_out}) + "\n")
                metrics.flush()
                log(f"step {step}/{total}: held-out loss {held_out['eval_loss']:.4f} over {held_out['eval_tokens']} "
                    "tokens")
            if cfg.save_every and step % cfg.save_every == 0 and step < total:
                _save(cfg, system, out, step, total)
    if bar is not None:
        bar.close()
    return step


def _evaluate(system, rows: Rows, batch: int) -> dict:
    """The held-out loss: the mean over every target token of every row, a batch of rows at a time."""
    loss_sum, tokens = 0.0, 0
    for first in range(0, len(rows), batch):
        inputs, labels, segments = rows.batch(first, min(batch, len(rows) - first))
        valid = int((labels != IGNORE_INDEX).sum())
        loss_sum += system.evaluate(inputs, labels, segments) * max(valid, 1)
        tokens += valid
    return {"eval_loss": loss_sum / max(tokens, 1), "eval_tokens": tokens}


def _save(cfg: TrainConfig, system, out: Path, step: int, total: int) -> Path:
    meta = {"step": step, "total_steps": total, "data_rows_consumed": step * cfg.batch,
            "torch_rng": torch.get_rng_state().tolist(), "train_config": dataclasses.asdict(cfg)}
    return checkpoint.save(out / "checkpoints", step, system.save_state, meta, cfg.keep)


def _export(system, case: CaseConfig, hf_dir: Path, model_type: str, tokenizer_dir: str | None) -> None:
    dtype = torch.bfloat16 if case.dtype == "bfloat16" else torch.float32
    save_hf_checkpoint(system.export_weights(), case.model_config(), hf_dir, model_type=model_type,
                       max_shard_bytes=EXPORT_SHARD_BYTES, dtype=dtype)
    for name in TOKENIZER_FILES if tokenizer_dir else ():
        if (Path(tokenizer_dir) / name).exists():
            shutil.copy(Path(tokenizer_dir) / name, hf_dir / name)
