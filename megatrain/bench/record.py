"""The one benchmark record schema: build (Record), validate, append to JSONL.

Units sit in the key names. Status is one of: ok, oom, error, timeout, skipped, killed (ended by a signal
that was not the kernel's OOM killer: Ctrl-C, a kill from outside).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from megatrain.bench.env import environment
from megatrain.config import CaseConfig
from megatrain.models.flops import hardware_flops, mfu, model_flops, paper_flops
from megatrain.workspace import CHECKOUT

STATUSES = ("ok", "oom", "error", "timeout", "skipped", "killed")
REQUIRED_KEYS = ("status", "system", "model", "num_params", "batch", "seq", "tokens_per_step", "step_time_s",
                 "tokens_per_s", "tflops", "peak_gpu_alloc_gib", "peak_host_rss_gib", "losses", "env", "config")


_SITE_PACKAGES = re.compile(r"/[^\s\"']*/(site-packages|dist-packages)/")


def relative_paths(text: str) -> str:
    """`text` (a traceback, a stderr tail) without this machine's paths: files in the checkout
    relative to its root, installed packages (this one too, when installed) from `site-packages/`. Records are
    committed."""
    return _SITE_PACKAGES.sub(r"\1/", text.replace(f"{CHECKOUT}/", "") if CHECKOUT else text)


@dataclass(frozen=True)
class Timing:
    """The timed steps' median and every rate derived from it."""

    step_time_s: float
    step_time_min_s: float
    step_time_max_s: float
    step_time_iqr_s: float
    step_times_s: list[float]  # every step, the untimed warmup too
    timed_steps: int
    tokens_per_s: float
    tflops: float  # 6NT, N the parameters a token uses (a mixture of experts' routed ones: ModelConfig.active_params)
    tflops_no_embed: float
    hw_tflops: float
    paper_tflops: float
    gemm_peak_tflops: float | None
    mfu: float | None
    tflops_all_experts: float | None = None  # a mixture of experts' 6NT with every expert in N, as some sources count

    @staticmethod
    def of(case: CaseConfig, step_times_s: list[float], gemm_peak_tflops: float | None = None,
           extra_layer_forwards: int = 0) -> Timing:
        """extra_layer_forwards: decoder-layer forwards the system ran beyond forward, recompute and backward, in the
        hardware FLOPs."""
        timed = step_times_s[case.warmup:] if len(step_times_s) > case.warmup else step_times_s
        median = statistics.median(timed)
        cfg = case.shape()
        hw = hardware_flops(cfg, case.batch, case.seq, recompute=True, extra_layer_forwards=extra_layer_forwards) \
            / median / 1e12
        quartiles = statistics.quantiles(timed, n=4) if len(timed) >= 2 else None
        return Timing(
            step_time_s=median, step_time_min_s=min(timed), step_time_max_s=max(timed),
            step_time_iqr_s=quartiles[2] - quartiles[0] if quartiles else 0.0, step_times_s=step_times_s,
            timed_steps=len(timed), tokens_per_s=case.tokens_per_step / median,
            tflops=model_flops(cfg.active_params(), case.tokens_per_step) / median / 1e12,
            tflops_no_embed=model_flops(cfg.matmul_params(), case.tokens_per_step) / median / 1e12, hw_tflops=hw,
            paper_tflops=paper_flops(cfg, case.batch, case.seq) / median / 1e12, gemm_peak_tflops=gemm_peak_tflops,
            mfu=mfu(hw, gemm_peak_tflops),
            tflops_all_experts=model_flops(cfg.num_params(), case.tokens_per_step) / median / 1e12 if cfg.is_moe
            else None)


@dataclass(frozen=True)
class Peaks:
    """What a run measured however it ended: its resource trace and memory peaks."""

    trace: dict | None  # megatrain.bench.trace; None when nobody asked for one
    peak_host_rss_gib: float
    peak_gpu_alloc_gib: float  # 0.0 on CPU
    peak_gpu_reserved_gib: float | None = None  # CUDA only


@dataclass
class Record:
    """One case's record, by section: the case, how it ended, the system's settings and metrics, timing, peaks; a
    section a case did not reach is None. to_dict() is the JSON, in the key order records always had; readers take
    it as a dict."""

    case: CaseConfig
    status: str
    error: str | None = None
    env: dict = field(default_factory=environment)
    build_s: float | None = None  # model init, host state, pinning, zero.Init
    system_config: dict | None = None
    timing: Timing | None = None
    skipped_steps: int = 0  # steps whose gradient norm was not finite, so no update was applied
    losses: list[float] = field(default_factory=list)
    metrics: dict | None = None
    traceback: str | None = None
    peaks: Peaks | None = None
    stderr_tail: str | None = None  # the suite runner's, for a case that wrote no record

    def to_dict(self) -> dict:
        case, cfg = self.case, self.case.shape()
        timing = dataclasses.asdict(self.timing) if self.timing else {}
        peaks = dataclasses.asdict(self.peaks) if self.peaks else {}
        head = {"status": self.status, "system": case.system, "model": case.model, "num_layers": cfg.num_layers,
                "num_params": cfg.num_params(), "active_params": cfg.active_params(), "batch": case.batch,
                "micro_batch": case.micro_batch, "seq": case.seq,
                "precision": case.precision, "dtype": case.dtype, "tokens_per_step": case.tokens_per_step,
                **{k: timing.pop(k, None) for k in ("step_time_s", "tokens_per_s", "tflops")},
                **{k: peaks.pop(k, None) for k in ("peak_gpu_alloc_gib", "peak_host_rss_gib")},
                "losses": self.losses, "skipped_steps": self.skipped_steps, "error": self.error,
                "config": case.to_dict(), "env": self.env}
        if peaks.get("peak_gpu_reserved_gib") is None:
            peaks.pop("peak_gpu_reserved_gib", None)
        tail = {"build_s": self.build_s, "system_config": self.system_config, **timing, "metrics": self.metrics,
                "traceback": self.traceback}
        return {**head, **{k: v for k, v in tail.items() if k in timing or v is not None}, **peaks,
                **({"stderr_tail": self.stderr_tail} if self.stderr_tail is not None else {})}


def problem(record: dict) -> str | None:
    """What makes `record` unreadable as a record (a key missing, a status or value of another kind), or None."""
    missing = [k for k in REQUIRED_KEYS if k not in record]
    if missing:
        return f"lacks {', '.join(missing)}"
    if record["status"] not in STATUSES:
        return f"has status {str(record['status'])[:40]!r}, not one of {', '.join(STATUSES)}"
    kinds = {"system": str, "model": str, "num_params": int, "batch": int, "seq": int, "tokens_per_step": int,
             "losses": list, "env": dict, "config": dict}
    wrong = [k for k, kind in kinds.items() if not isinstance(record[k], kind) or isinstance(record[k], bool)]
    wrong += [k for k in REQUIRED_KEYS if k not in kinds and k != "status"
              and not (record[k] is None or isinstance(record[k], int | float) and not isinstance(record[k], bool))]
    names = {str: "a string", int: "an integer", float: "a number or null", list: "a list", dict: "an object"}
    return f"has {wrong[0]} {json.dumps(record[wrong[0]])[:40]}, not {names[kinds.get(wrong[0], float)]}" \
        if wrong else None


def validate(record: dict) -> None:
    assert problem(record) is None, problem(record)


def check_appendable(path: str | Path, flag: str = "--out") -> None:
    """Refuse (ValueError) a records file that append_jsonl could not write, before a case runs: its record would be
    lost after the run. Leaves no file behind that was not there."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder: name a JSONL file (records are appended to it)")
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("ab"):
            pass
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot write there ({exc.strerror}): name a file in a writable folder") \
            from None
    if not existed:
        path.unlink()


def append_jsonl(path: str | Path, record: dict) -> None:
    """Append `record` as one line. A torn last line (a kill mid-write left no newline) is ended first, so it stays
    one bad line that read_jsonl skips instead of swallowing this record."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(record) + "\n").encode()
    with path.open("a+b") as f:
        size = f.seek(0, os.SEEK_END)
        if size:
            f.seek(size - 1)
            if f.read(1) != b"\n":
                line = b"\n" + line
        f.write(line)  # one write: the newline guard and the record land together


def read_jsonl(path: str | Path, check=None) -> list[dict]:
    """The records of a JSONL file. A line that is not a JSON object (a write cut short, a hand edit, bytes that are
    not UTF-8), or whose object check(record) finds a problem with (a sentence, else None), is skipped with a warning
    naming the file and line, so one bad line never makes a results folder unusable."""
    path = Path(path)
    if not path.exists():
        return []
    if not path.is_file() and not path.is_dir():  # a folder says so as it is read
        raise ValueError(f"{path} is no file (a FIFO, a socket or a device), whose reading would wait without end: it "
                         "should be the records' JSONL file")
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:  # a folder named like the file, one this user cannot read
        raise ValueError(f"{path} cannot be read ({exc.strerror}): it should be the records' JSONL file") from None
    records = []
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode())
        except UnicodeDecodeError:
            record, why = None, "not UTF-8 text"
        except json.JSONDecodeError as exc:
            record, why = None, f"not JSON ({exc.msg} at column {exc.colno})"
        except RecursionError:
            record, why = None, "JSON nested too deep to read"
        else:
            why = "not a JSON object"
        if isinstance(record, dict) and check is not None and (found := check(record)):
            record, why = None, f"a record that {found}"
        if not isinstance(record, dict):
            warnings.warn(f"{path}:{number}: skipped a line that is {why}", stacklevel=2)
            continue
        records.append(record)
    return records


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
