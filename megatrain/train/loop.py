"""The training loop of `python -m megatrain train`: data, schedule, steps, metrics, checkpoints, resume, export, over
the Engine a program opens (megatrain.train.engine: the model, the system, its first weights and the export are built
there, once for both)."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import math
import os
import signal
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

import megatrain.user_files as user_files
from megatrain.build_log import build_lines_to
from megatrain.engine import distributed
from megatrain.engine.distributed import Ranks
from megatrain.memory import GIB, peak_host_rss_gib
from megatrain.models.checkpoint import Checkpoint
from megatrain.models.flops import model_flops
from megatrain.models.loss import IGNORE_INDEX
from megatrain.systems import system_spec
from megatrain.tokenizer import Tokenizer, token_files
from megatrain.train import checkpoint, trust
from megatrain.train.config import PER_INVOCATION, TrainConfig, check_available
from megatrain.train.data import Rows, data_files, read_examples
from megatrain.train.engine import Engine, plan
from megatrain.train.export import EXPORT_FILE, export_dtype, exported_name, tokenizer_copies
from megatrain.train.fingerprint import changed as fingerprint_change
from megatrain.train.fingerprint import fingerprints, fingerprints_record
from megatrain.train.lr import lr_at, schedule_notes
from megatrain.train.report_to import Reporters
from megatrain.train.rundir import RUN_FILE, RunDir, aside, fault, recover_dir
from megatrain.train.runlog import LOG_FILE, RunLog

# the signals that stop a run after its step, saved: Ctrl-C, a scheduler's or kill's SIGTERM, and SIGHUP (the terminal
# it ran in closed, an ssh session dropped), which killed the run with no checkpoint of the steps since the last save
STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class Progress:
    """Where the run is; the signal handler writes `signal`."""
    step: int
    rows_consumed: int  # the data position: rows of the epoch-ordered stream trained on
    signal: int = 0  # the signal (one of STOPS) that asked the run to stop after its step; 0: none
    nonfinite_steps: int = 0  # consecutive steps, up to this one, whose loss or gradient norm was not finite




@user_files.private()
def train(cfg: TrainConfig, log=print) -> int:
    """Run (or resume) training as configured; returns the exit code: 0 done, 1 diverged (non-finite for
    --max-nonfinite-steps steps), 130 after Ctrl-C, 143 after SIGTERM and 129 after SIGHUP (each finishing its step
    and saving, or the export it came during). Every line the run says goes to `log` and to OUT/train.log; every
    metrics line to OUT/metrics.jsonl and to the --report-to integrations; what it writes is writable by this user
    alone."""
    # --init-from's checkpoint (its model, the hand-written one or transformers' own modules, and its config.json),
    # read once: the export's family is its Hugging Face model_type, its config.json starts from the source's
    init = check_available(cfg)
    out = Path(cfg.out)
    if cfg.resume and Path(cfg.resume).resolve() != out.resolve():
        raise ValueError(f"--resume {cfg.resume} continues the run in that directory, not in --out {cfg.out}: drop "
                         "--out (to branch a run, copy its directory and resume the copy)")
    for flag, source in (("--init-from", cfg.init_from), ("--tokenizer", cfg.tokenizer)):
        if source and not cfg.resume and Path(source).resolve().is_relative_to(out.resolve()):
            raise ValueError(f"{flag} {source} is inside --out {cfg.out}, which a new run empties (and whose hf/ its "
                             "export replaces): copy it out of there first, or choose another --out")
    tokenizer_dir = cfg.tokenizer or (cfg.init_from if cfg.init_from and
                                      (Path(cfg.init_from) / "tokenizer.json").exists() else None)
    tokenizer_copies(tokenizer_dir)  # what the export will copy and publish: none may link out of its directory
    files = data_files(cfg.data, "--data", cfg.data_split)
    tokenizer_files = [Path(tokenizer_dir) / name for name in token_files(tokenizer_dir)] if tokenizer_dir else []
    # what the rows and the model are made of, fingerprinted before it is read (a change meanwhile reads as one): a
    # resume refuses any change since the run's start
    prints = {"data_files": fingerprints(files), "tokenizer_files": fingerprints(tokenizer_files),
              "model_files": fingerprints([Path(cfg.init_from) / "config.json"] if cfg.init_from else [])}
    tokenizer = Tokenizer(tokenizer_dir) if tokenizer_dir else None
    # the Engine's plan, before the rows are made, each --seq tokens wide: a --seq this machine cannot hold is refused
    # before its rows' padding is allocated (the run's length, not known until they are, weighs nothing in it)
    planned, notes = plan(cfg, init)
    model = planned.shape()
    vocab = model.vocab_size
    ignored = tuple(cfg.ignore_column)
    rows = Rows(read_examples(files, tokenizer, cfg.train_on_prompt, "--data", ignored), cfg.seq, vocab, cfg.shuffle,
                cfg.seed, cfg.pack)
    eval_rows = Rows(read_examples(data_files(cfg.eval_data, "--eval-data", cfg.eval_split), tokenizer,
                                   cfg.train_on_prompt, "--eval-data", ignored), cfg.seq, vocab, False, cfg.seed,
                     cfg.pack, "--eval-data") \
        if cfg.eval_data else None
    packs = any(bool((r.segments[:, :-1] != r.segments[:, :1]).any()) for r in (rows, eval_rows) if r is not None)
    if packs and (why := model.packing_refusal()):
        raise ValueError(why)  # before anything is built, not at the first packed row
    total = cfg.steps if cfg.steps is not None else math.ceil(cfg.epochs * len(rows) / cfg.batch)
    case = dataclasses.replace(planned, steps=total)
    ranks = distributed.current(cfg.device)  # under torchrun: rank 0 owns --out, every rank trains
    first = ranks.first
    hf = [] if (out / "hf").is_symlink() else sorted((out / "hf").glob("*"))  # a link: refused as the run claims --out
    if first and cfg.overwrite and not cfg.resume and (theirs := [*checkpoint.not_checkpoints(out / "checkpoints"),
                                                                  *(p for p in hf if not exported_name(p.name))]):
        raise ValueError(f"--overwrite {out}: {theirs[0]} is no file a run writes there (put there since), and "
                         "discarding the run would delete it: move it out first")
    run = RunDir(out, cfg.resume is not None, cfg.overwrite) if first else None
    runlog = RunLog(log, out / LOG_FILE if first else None)
    reporters = Reporters(cfg.report_to if first else [], out)
    code = None
    try:
        for note in notes if first else []:
            runlog(note)
        with build_lines_to(runlog):  # the build's lines are the run's: the caller's log and OUT/train.log
            code = _train(cfg, run, case, rows, eval_rows, total, tokenizer_dir, runlog, ranks, reporters, prints,
                          init)
        return code
    except Exception as exc:  # the terminal shows it as the caller reports it; the log keeps it too
        if isinstance(exc, OSError) and first and exc.filename == str(out / LOG_FILE) \
                and (failed := _unwritable(out / LOG_FILE, exc, out)) is not None:
            raise failed from None
        with contextlib.suppress(OSError):  # a log that cannot take it (a full disk) does not hide it
            runlog.to_file(f"error: {exc}" if isinstance(exc, ValueError) else traceback.format_exc().rstrip())
        raise
    finally:
        reporters.close(code)
        runlog.close()
        if run is not None:
            run.close()


INPUTS = (("data_files", "the data", "other rows at the recorded data position"),
          ("tokenizer_files", "the tokenizer", "other tokens than the run trained on"),
          ("model_files", "--init-from's config", "another model than the run's"))  # fingerprints a run records


def _prepare(cfg: TrainConfig, run: RunDir, case, total: int, log, prints: dict, exported: torch.dtype) -> tuple:
    """(start step, checkpoint resumed from or None, its trainer.json, export only, run id): a resumed run's
    leftovers recovered, what cannot run refused (training data or a tokenizer whose fingerprints `prints` differ
    from those recorded at the run's start, in run.json and in the checkpoint's trainer.json, among them: held-out
    data may change; a disk short of the checkpoints and the export in `exported`), the run started in --out."""
    out = run.out
    resume_from, meta = None, {"step": 0, "data_rows_consumed": 0}
    if cfg.resume:
        recorded = run.recorded()
        _check_inputs(recorded, prints, out, out / RUN_FILE)
        checkpoint.recover(out / "checkpoints")
        recover_dir(out / "hf")
        resume_from, meta = checkpoint.resume_point(out / "checkpoints", cfg.resume_fallback, log)
        _check_resumed(cfg, out, recorded, resume_from, meta, prints)
    start = meta["step"]
    for note in schedule_notes(cfg, total, meta["total_steps"] if resume_from is not None else None):
        log(note)
    export_only = resume_from is not None and start == total and _exported_step(out) != total
    if resume_from is not None and start >= total and not export_only:
        raise ValueError(f"nothing to train: {resume_from} is at step {start} and the run ends at step {total}; "
                         f"pass --steps N with N above {start} to train on")
    saves = cfg.save * (1 + (len(range(cfg.save_every, total, cfg.save_every)) if cfg.save_every else 0))
    export_bytes = case.shape().num_params() * exported.itemsize
    # The old export is deleted only once the new one is complete.
    checkpoint.check_disk(case, out, saves, cfg.keep, export_bytes * (1 + (out / "hf").exists()))
    run_id = run.start(_settings(cfg), meta.get("run_id"), **prints)  # a resume without run.json keeps its id
    _repair_metrics(out / "metrics.jsonl", start)
    return start, resume_from, meta, export_only, run_id


def _check_resumed(cfg: TrainConfig, out: Path, recorded: dict, d: Path, meta: dict, prints: dict) -> None:
    """Checkpoint d (its trainer.json `meta`) held to the resumed run, whose run.json is `recorded`: the state of its
    system, trusted, of this run, and what it trains on unchanged since the run started, as run.json or trainer.json
    records it (one must)."""
    checkpoint.check_system(d, meta["files"], cfg.system,
                            f"its trainer.json names --system {cfg.system} (edited, or copied from another run)")
    trust.check_trusted(d, meta, system_spec(cfg.system).pickled, cfg.trust_checkpoint)
    run_ids = (recorded.get("run_id"), meta.get("run_id"))
    if None not in run_ids and run_ids[0] != run_ids[1]:
        raise ValueError(f"--resume {out}: {d} is a checkpoint of run {run_ids[1]}, and {out / RUN_FILE} is of run "
                         f"{run_ids[0]}: a checkpoint copied in from another run's directory; resume that run (to "
                         "branch a run, copy its whole directory)")
    _check_inputs(meta, prints, out, d / checkpoint.META_FILE)
    if "data_files" not in recorded and "data_files" not in meta:
        raise ValueError(f"--resume {out}: neither {out / RUN_FILE} nor {d / checkpoint.META_FILE} records what the "
                         "run's data was (run.json deleted, and a checkpoint of an older megatrain), so a change since "
                         "the run started could not be told: restore run.json, or start a new run in another --out")


def _check_inputs(recorded: dict, prints: dict, out: Path, where: Path) -> None:
    """Refuse a resume whose data, tokenizer or config.json fingerprints `prints` differ from those `recorded` (by
    the file `where`, run.json or a checkpoint's trainer.json, where it records them)."""
    for key, what, why in INPUTS:
        if recorded.get(key) is not None and not fingerprints_record(recorded[key]):
            raise ValueError(f"{where}: {key} is not what a run records (file names to their size, modification "
                             "time and hash): it was edited; restore it, or start a new run in another --out")
        if recorded.get(key) is not None and (change := fingerprint_change(recorded[key], prints[key])):
            raise ValueError(f"--resume {out}: {what} changed: {change}; resuming would train {why}: restore "
                             "the file, or start a new run in another --out")


def _silent(line: str) -> None:
    """The log of a rank other than 0: rank 0 speaks for the run."""


def _train(cfg: TrainConfig, run: RunDir | None, case, rows, eval_rows, total: int, tokenizer_dir: str | None,
           log: RunLog, ranks: Ranks, reporters: Reporters, prints: dict, init: Checkpoint | None) -> int:
    """The run in --out (run None: a rank other than 0, which takes rank 0's decisions and writes nothing)."""
    out, report, first = Path(cfg.out), log, ranks.first
    log = log if first else RunLog(_silent)
    exported, whence = export_dtype(cfg.export_dtype, init.config if init else None, case)
    start, resume_from, meta, export_only, run_id = ranks.from_first(
        _prepare(cfg, run, case, total, log, prints, exported) if run is not None else (None,) * 5)
    layout = f"packed into {len(rows)} rows" if cfg.pack else f"one per row, {rows.truncated} truncated"
    log(f"train: {case.model} on {cfg.system}, {rows.examples} examples {layout} of {cfg.seq + 1} tokens "
        f"({rows.fill:.0%} data, the rest padding), {total} steps of {cfg.batch} x {cfg.seq}"
        + (f" over {ranks.world} ranks" if ranks.launched else ""))
    reporters.start(run_id, start, _settings(cfg))
    identity = {"run_id": run_id, **prints}  # every checkpoint records the run and what it trains on
    engine = Engine.built(case, init, ranks)  # the one a program opens, of the same plan; its first weights below
    system = engine.system
    progress = Progress(start, meta["data_rows_consumed"])
    handlers = {s: signal.signal(s, lambda signum, _: setattr(progress, "signal", signum))  # finish the step, save
                for s in STOPS}
    memory = {"host_peak_gib_built": peak_host_rss_gib()}
    try:
        if resume_from is not None:
            t0 = time.perf_counter()
            engine.load_state(resume_from, meta["files"], cfg.trust_checkpoint)
            memory.update(load_s=time.perf_counter() - t0, host_peak_gib_loaded=peak_host_rss_gib())
            torch.set_rng_state(torch.tensor(meta["torch_rng"], dtype=torch.uint8))
            log(f"resumed from {resume_from} at step {start}" + ("; nothing to train, exporting it (its export "
                                                                 "was cut short)" if export_only else ""))
        else:
            engine.load_checkpoint()
        _run_steps(cfg, system, case, rows, eval_rows, progress, total, out, identity, log, ranks, reporters)
        # a signal that reached any rank after the last step stops every rank alike
        progress.signal = ranks.agree(progress.signal)
        if progress.nonfinite_steps:  # the periodic save's rule: a state whose last step was not finite is kept nowhere
            last = checkpoint.latest(out / "checkpoints")
            diverged = cfg.max_nonfinite_steps and progress.nonfinite_steps >= cfg.max_nonfinite_steps
            n = progress.nonfinite_steps
            log(("diverged: " if diverged else "") + f"the loss or gradient norm was not finite for {n} "
                f"step{'s' * (n > 1)} in a row (to step {progress.step}); stopped without saving that state or "
                f"exporting; the last checkpoint saved while training was finite: {last or 'none'}")
            return 128 + progress.signal if progress.signal and not diverged else 1
        memory["host_peak_gib_trained"] = peak_host_rss_gib()
        if cfg.save and progress.step > start:
            t0 = time.perf_counter()
            _save(cfg, system, out, progress, total, identity)
            memory.update(save_s=time.perf_counter() - t0, host_peak_gib_saved=peak_host_rss_gib())
        if progress.signal:
            if progress.step == start:  # nothing trained since the start or the resumed checkpoint: nothing saved
                kept = f"nothing trained; {resume_from} stands, --resume {out} continues" if resume_from is not None \
                    else "nothing trained, no checkpoint: run the same command again"
            else:
                kept = f"checkpoint at step {progress.step} in {out / 'checkpoints'}; --resume {out} continues" \
                    if cfg.save else "no checkpoint (--no-save)"
            log(f"interrupted ({signal.Signals(progress.signal).name}) at step {progress.step}: {kept}")
            return 128 + progress.signal
        t0 = time.perf_counter()
        with _writing(out / "hf", progress, out):  # every rank gives its part of the weights, rank 0 writes them
            engine.write_export(out / "hf", tokenizer_dir, {"step": progress.step, "run_id": run_id}, exported)
        if not first:
            return 0
        memory.update(export_s=time.perf_counter() - t0, host_peak_gib_exported=peak_host_rss_gib())
        with _writing(out / "memory.json", progress, out):
            (out / "memory.json").write_text(json.dumps(memory, indent=1) + "\n")
        if progress.signal:  # it came during the export, which was finished all the same: exit as asked to stop
            log(f"interrupted ({signal.Signals(progress.signal).name}) during the export, which was finished: "
                f"{progress.step} steps; Hugging Face checkpoint in {out / 'hf'}")
            return 128 + progress.signal
        log(f"done: {progress.step} steps; Hugging Face checkpoint in {out / 'hf'} ({whence}); host peak RSS (GiB) "
            + ", ".join(f"{k.removeprefix('host_peak_gib_')} {v:.2f}" for k, v in memory.items() if "gib" in k))
        return 0
    except distributed.RankLost as exc:  # said while the signal handlers stand: torchrun's SIGTERM follows
        last = checkpoint.latest(out / "checkpoints")
        report(f"error: {exc}; the run stopped at step {progress.step}, its last complete checkpoint "
               f"{last or '(none yet)'} is intact: --resume {out} continues")
        return 1
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
        engine.close()


def _run_steps(cfg, system, case, rows, eval_rows, progress: Progress, total, out, identity: dict, log: RunLog,
               ranks: Ranks, reporters: Reporters) -> None:
    flops_per_token = model_flops(case.shape().active_params(), tokens=1)  # the records' 6NT
    first, bar = ranks.first, None
    if sys.stderr.isatty() and first:
        from tqdm import tqdm

        bar = log.bar = tqdm(total=total, initial=progress.step, unit="step", dynamic_ncols=True)
    metrics = out / "metrics.jsonl"
    while progress.step < total and not ranks.agree(progress.signal):
        lr = lr_at(progress.step, total, cfg.lr, cfg.lr_schedule, cfg.warmup_steps, cfg.min_lr)
        system.set_lr(lr)
        inputs, labels, segments = rows.batch(progress.rows_consumed, cfg.batch)
        if (draws := getattr(system, "draws", None)) is not None:  # dropout's seeds, by the step (a resumed run's too)
            draws.step = progress.step
        t0 = time.perf_counter()
        loss = system.step(inputs, labels, segments)
        if case.device == "cuda":
            torch.cuda.synchronize()
        step_s = time.perf_counter() - t0
        progress.step += 1
        progress.rows_consumed += cfg.batch
        step = progress.step
        if ranks.launched:
            fault(f"rank-{ranks.rank}-step-{step}")
        finite = math.isfinite(loss) and math.isfinite(system.last_grad_norm)
        progress.nonfinite_steps = 0 if finite else progress.nonfinite_steps + 1
        tokens = inputs.numel()
        targets = int((labels != IGNORE_INDEX).sum())
        line = {"step": step, "loss": loss, "lr": lr, "grad_norm": system.last_grad_norm, "tokens": tokens,
                "target_tokens": targets, "tokens_per_s": tokens / step_s, "target_tokens_per_s": targets / step_s,
                "tflops": flops_per_token * tokens / step_s / 1e12, "step_s": step_s,
                "host_peak_gib": peak_host_rss_gib(),
                **({"gpu_peak_gib": torch.cuda.max_memory_allocated() / GIB} if case.device == "cuda" else {})}
        if first:
            _append(metrics, line, progress, out)
            reporters.log(line)
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{line['tokens_per_s']:.0f}", lr=f"{lr:.2e}")
            bar.update(1)
        if step % cfg.log_every == 0 or step == total:
            log.step(f"step {step}/{total}: loss {loss:.4f}, lr {lr:.3e}, grad norm {line['grad_norm']:.3f}, "
                     f"{line['tokens_per_s']:.0f} tok/s, {line['tflops']:.3g} TFLOPS, ETA "
                     f"{(total - step) * step_s:.0f} s")
        if cfg.max_nonfinite_steps and progress.nonfinite_steps >= cfg.max_nonfinite_steps:
            break
        if eval_rows is not None and (step % cfg.eval_every == 0 or step == total):
            held_out = _evaluate(system, eval_rows, cfg.batch)
            if first:
                _append(metrics, {"step": step, **held_out}, progress, out)
                reporters.log({"step": step, **held_out})
            log(f"step {step}/{total}: held-out loss {held_out['eval_loss']:.4f} over {held_out['eval_tokens']} "
                "tokens")
        if cfg.save_every and step % cfg.save_every == 0 and step < total and finite:  # never a diverging state
            _save(cfg, system, out, progress, total, identity)
    if bar is not None:
        log.bar = None
        bar.close()


def _evaluate(system, rows: Rows, batch: int) -> dict:
    """The held-out loss: the mean over every target token of every row, a batch of rows at a time."""
    loss_sum, tokens = 0.0, 0
    for first in range(0, len(rows), batch):
        inputs, labels, segments = rows.batch(first, min(batch, len(rows) - first))
        valid = int((labels != IGNORE_INDEX).sum())
        loss_sum += system.evaluate(inputs, labels, segments) * max(valid, 1)
        tokens += valid
    return {"eval_loss": loss_sum / max(tokens, 1), "eval_tokens": tokens}


@contextmanager
def _writing(where: Path, progress: Progress, out: Path):
    """A full disk, or a place made read-only, while writing `where` ends the run with one line (exit 2): the step
    reached and the last complete checkpoint, which is intact (checkpoints are swapped in only when complete)."""
    try:
        yield
    except OSError as exc:
        if (failed := _unwritable(where, exc, out, progress.step)) is None:
            raise
        raise failed from None


def _unwritable(where: Path, exc: OSError, out: Path, step: int | None = None) -> ValueError | None:
    """The line that ends a run whose write of `where` failed with `exc` (at `step`), for a full disk or a place made
    read-only; None for another error."""
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
    if not full and exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
        return None
    last = checkpoint.latest(out / "checkpoints")
    fix = "free space" if full else "make it writable"
    return ValueError(("disk full writing " if full else f"cannot write ({exc.strerror}) ") + f"{where}"
                      + (f" at step {step}" if step is not None else "") + ": "
                      + (f"the last complete checkpoint, {last}, is intact; {fix}, then --resume {out}" if last else
                         "no checkpoint to resume from (none saved yet, or --no-save): "
                         f"{fix}, then train again with --overwrite"))


def _append(path: Path, line: dict, progress: Progress, out: Path) -> None:
    with _writing(path, progress, out), path.open("a") as f:  # opened per line: a failed write leaves no buffer
        f.write(json.dumps(line) + "\n")


def _repair_metrics(path: Path, through_step: int) -> None:
    """Cut a torn last line (a kill or a full disk mid-write) and the lines of steps after through_step, which are
    trained again: metrics then hold one line per step (and per held-out evaluation)."""
    if not path.exists():
        return
    text = path.read_text(errors="replace")
    lines = text[:text.rfind("\n") + 1].splitlines(keepends=True)
    kept = "".join(line for number, line in enumerate(lines, 1) if _metrics_step(path, number, line) <= through_step)
    if kept != text:
        tmp = aside(path, "tmp")
        tmp.write_text(kept)
        os.replace(tmp, path)


def _metrics_step(path: Path, number: int, line: str) -> int:
    """The step of line `number` of metrics.jsonl; ValueError naming it when it is not a line a run writes."""
    try:
        step = json.loads(line).get("step")
    except (json.JSONDecodeError, AttributeError, RecursionError):
        step = None
    if type(step) is not int:
        raise ValueError(f"{path}:{number} is not a metrics line a run writes ({line.strip()[:60]!r}): delete that "
                         "line, then resume")
    return step


def _settings(cfg: TrainConfig) -> dict:
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in PER_INVOCATION}


def _save(cfg: TrainConfig, system, out: Path, progress: Progress, total: int, identity: dict) -> Path | None:
    """A checkpoint of the state at progress.step; its trainer.json also holds `identity` (the run's id and the
    fingerprints of its inputs, which a resume checks whether run.json is there or not)."""
    if not distributed.current(cfg.device).first:  # every rank takes part, rank 0 writes the one copy of the state
        system.save_state(None)
        return None
    meta = {"step": progress.step, "total_steps": total, "data_rows_consumed": progress.rows_consumed,
            "torch_rng": torch.get_rng_state().tolist(), **identity, "train_config": _settings(cfg)}
    with _writing(out / "checkpoints", progress, out):
        return checkpoint.save(out / "checkpoints", progress.step, system.save_state, meta, cfg.keep,
                               system_spec(cfg.system).pickled)


def _exported_step(out: Path) -> int | None:
    """The step hf/ holds (None: no export yet); ValueError naming the file when it is not one an export writes."""
    path = out / "hf" / EXPORT_FILE
    if not path.exists():
        return None
    try:
        step = json.loads(path.read_bytes()).get("step")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, RecursionError):
        step = None
    if type(step) is not int:
        raise ValueError(f"{path} is not what an export writes: delete it (the next export writes it again)")
    return step
