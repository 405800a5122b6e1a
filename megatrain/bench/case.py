"""Run one benchmark case in this process and return its record.

The suite runner calls this in a fresh subprocess per case (through the CLI), so an OOM or a
crash becomes a recorded outcome rather than a dead sweep.
"""

from __future__ import annotations

import time
import traceback

import torch

from megatrain.bench.record import Peaks, Record, Timing, relative_paths
from megatrain.bench.trace import start_trace, stop_trace
from megatrain.config import CaseConfig
from megatrain.data import make_batches
from megatrain.memory import GIB, peak_host_rss_gib
from megatrain.systems import build_system


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def run_case(case: CaseConfig, gemm_peak_tflops: float | None = None, on_step=None) -> dict:
    """Build the case's system, run case.steps optimizer steps, and return the record.

    Failures inside the run (OOM, errors) come back as records with status 'oom' or 'error';
    invalid configurations raise ValueError before anything is built (the system's constructor refuses them).
    The record is Record.to_dict().
    """
    cuda = case.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for but CUDA is not available; use --device cpu")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    record = Record(case, "ok")
    system = None
    losses: list[float] = []
    step_times: list[float] = []
    invalid = None
    sampler = start_trace()  # NVML/psutil samples to a sidecar file when the suite runner sets MEGATRAIN_TRACE_FILE
    try:
        t_build = time.perf_counter()
        system = build_system(case)
        record.build_s = time.perf_counter() - t_build
        batches = make_batches(case, case.shape().vocab_size)
        for step in range(case.steps):
            inputs, labels = batches.batch_at(step)
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = system.step(inputs, labels)
            if cuda:
                torch.cuda.synchronize()
            step_times.append(time.perf_counter() - t0)
            losses.append(loss)
            if on_step:
                on_step(step, loss, step_times[-1])
        record.system_config = system.system_config()
        record.timing = Timing.of(case, step_times, gemm_peak_tflops, record.system_config.get("recomputed_inputs", 0))
        record.skipped_steps = system.skipped_steps
        record.metrics = system.metrics(warmup_steps=case.warmup)
    except ValueError as exc:
        if system is not None:
            _record_failure(record, exc)
        else:  # an invalid setting the system's constructor refused before allocating: the caller's to report
            invalid = exc
    except Exception as exc:  # recorded, not raised: a sweep goes on after a failed case
        _record_failure(record, exc)
    finally:
        trace = stop_trace(sampler)
        record.losses = losses
        record.peaks = Peaks(trace, peak_host_rss_gib(), torch.cuda.max_memory_allocated() / GIB if cuda else 0.0,
                             torch.cuda.max_memory_reserved() / GIB if cuda else None)
        if system is not None:
            system.close()
    if invalid is not None:
        raise invalid
    return record.to_dict()


def _record_failure(record: Record, exc: BaseException) -> None:
    record.status = "oom" if _is_oom(exc) else "error"
    record.error = relative_paths(f"{type(exc).__name__}: {exc}")[:4000]
    record.traceback = relative_paths(traceback.format_exc())[-4000:]
