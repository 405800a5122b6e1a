"""The reference trainer and the bench CLI contract. CPU, seconds: pytest tests/unit/test_native.py"""

import json
import subprocess
import sys

import pytest

from megatrain.bench.case import run_case
from megatrain.bench.record import Record, validate
from megatrain.config import CaseConfig
from megatrain.optim.config import OptimConfig


def test_native_tiny_loss_falls_over_50_steps_on_a_repeated_batch():
    case = CaseConfig(system="native", model="tiny", batch=2, seq=32, steps=50, repeat_batch=True,
                      optim=OptimConfig(lr=3e-3, weight_decay=0.0))
    record = run_case(case)
    assert record["status"] == "ok", record.get("error")
    losses = record["losses"]
    assert len(losses) == 50
    assert losses[-1] < 0.5 * losses[0]


def test_grad_accumulation_matches_full_batch():
    full = run_case(CaseConfig(system="native", model="tiny", batch=4, seq=16, steps=3))
    accum = run_case(CaseConfig(system="native", model="tiny", batch=4, micro_batch=1, seq=16, steps=3))
    assert accum["losses"] == pytest.approx(full["losses"], rel=1e-5)


HEAD = ["status", "system", "model", "num_layers", "num_params", "active_params", "batch", "micro_batch", "seq",
        "precision", "dtype", "tokens_per_step", "step_time_s", "tokens_per_s", "tflops", "peak_gpu_alloc_gib",
        "peak_host_rss_gib", "losses", "skipped_steps", "error", "config", "env"]


def test_a_records_keys_keep_their_order_on_every_path():
    """Record.to_dict() writes the keys records were always written with, in the same order."""
    ok = run_case(CaseConfig(system="native", model="tiny", batch=2, seq=8, steps=2), gemm_peak_tflops=1.0)
    assert list(ok) == [*HEAD, "build_s", "system_config", "step_time_min_s", "step_time_max_s", "step_time_iqr_s",
                        "step_times_s", "timed_steps", "tflops_no_embed", "hw_tflops", "paper_tflops",
                        "gemm_peak_tflops", "mfu", "tflops_all_experts", "metrics", "trace"]
    assert ok["peak_gpu_alloc_gib"] == 0.0 and ok["gemm_peak_tflops"] == 1.0 and ok["trace"] is None
    timeout = Record(CaseConfig(system="native", model="tiny"), "timeout", "killed", stderr_tail="tail").to_dict()
    assert list(timeout) == [*HEAD, "stderr_tail"] and timeout["step_time_s"] is None and timeout["error"] == "killed"


def _bench(*args):
    return subprocess.run([sys.executable, "-m", "megatrain", "bench", *args], capture_output=True, text=True)


def _assert_refused(code: int, stderr: str, message: str) -> None:
    assert code == 2, stderr
    assert message in stderr
    assert len(stderr.strip().splitlines()) == 1, "one line saying what to change, no traceback"


def _main(monkeypatch, *args) -> int:
    """`python -m megatrain bench ARGS` through the command line's main() in this process (a process of its own cost
    ~5 s of a CI core); capfd, at the file descriptors, sees what C code would write there too."""
    from megatrain import cli

    monkeypatch.setattr(cli.warnings, "formatwarning", cli.warnings.formatwarning)  # main() sets its own: undone after
    return cli.main(["bench", *args])


def test_cli_prints_record_as_last_line_with_json_and_appends(tmp_path, capfd, monkeypatch):
    out = tmp_path / "r.jsonl"
    args = ("--system", "native", "--model", "tiny", "--batch", "2", "--seq", "64", "--steps", "5", "--device", "cpu",
            "--dtype", "float32", "--seed", "0")
    assert _main(monkeypatch, *args) == 0
    plain = capfd.readouterr().out
    assert not any(line.startswith("{") for line in plain.splitlines()), "the record only with --json"
    assert plain.splitlines()[-1].startswith("native tiny")  # the summary line
    assert _main(monkeypatch, *args, "--out", str(out), "--json") == 0
    record = json.loads(capfd.readouterr().out.strip().splitlines()[-1])
    validate(record)
    assert record["status"] == "ok" and len(record["losses"]) == 5
    assert record["tokens_per_step"] == 128 and record["tflops"] > 0
    assert record["env"]["torch"]
    assert json.loads(out.read_text().splitlines()[-1])["losses"] == record["losses"]


# Refused by argument parsing or a system's typed options, before anything is built: in this process, through the
# command line's own main() (a process per case cost ~6 s here, 12 times)
@pytest.mark.parametrize("args, message", [
    (["--model", "nope"], "unknown model"),
    (["--seq", "0"], "seq must be"),
    (["--batch", "3", "--micro-batch", "2"], "must divide batch"),
    (["--system", "nope"], "unknown system"),
    (["--system", "megatrain", "--option", "resident_layers=-3"], "resident_layers must be"),
    (["--system", "megatrain", "--option", "compile=false"], "use --compile"),
    (["--system", "megatrain", "--option", "ofload_activations=true"],
     "megatrain has no option 'ofload_activations'; its options: host_mem_gib, offload_activations, "),
    (["--system", "megatrain", "--option", "offload_activations=maybe"], "offload_activations='maybe': expected true"),
    (["--system", "native", "--option", "offload_activations=true"],
     "native has no option 'offload_activations' (an option of megatrain)"),
    (["--system", "megatrain", "--option", "optimizer_kernel=bogus"], "expected 'fused' or 'torch'"),
    (["--system", "megatrain", "--option", "mlp_chunk_tokens=true"], "mlp_chunk_tokens=True: expected an integer"),
    (["--system", "fsdp", "--option", "host_mem_gib"], "--option takes KEY=VALUE"),
])
def test_cli_rejects_bad_input_with_exit_code_2(args, message, capsys, monkeypatch):
    try:
        code = _main(monkeypatch, *args)
    except SystemExit as exc:  # argparse's refusals
        code = exc.code
    _assert_refused(code, capsys.readouterr().err, message)


# Refused by the memory pre-flight, which alone stands between these and a 72B model's allocation: in a process of
# their own, whose exit code and stderr are the contract
@pytest.mark.parametrize("args, message", [
    (["--system", "native", "--model", "qwen2.5-72b", "--steps", "1"], "does not fit here: needs ~"),
    (["--system", "megatrain", "--model", "qwen2.5-72b", "--steps", "1"], "no precision or micro-batch"),
])
@pytest.mark.subprocess
def test_cli_refuses_what_does_not_fit_with_exit_code_2_before_allocating(args, message):
    proc = _bench(*args)
    _assert_refused(proc.returncode, proc.stderr, message)


def test_a_sequence_beyond_the_models_published_context_is_said_before_the_run(capfd, monkeypatch):
    assert _main(monkeypatch, "--system", "native", "--model", "tiny", "--seq", "2049", "--batch", "1", "--steps",
                 "1") == 0
    assert "seq 2049 is beyond tiny's published context of 2048 tokens" in capfd.readouterr().err


def test_ddp_stops_syncing_buffers_by_the_keyword_this_torch_has(monkeypatch):
    # torch 2.13 renamed broadcast_buffers to forward_sync_buffers; the GPU hosts' 2.11 refused the new name (a
    # 2-GPU native run died on it: results/gpu_checks/run-8b21ddc-h200x2-multi-gpu.jsonl)
    from megatrain.systems import native

    class Torch211DDP:
        def __init__(self, module, device_ids=None, broadcast_buffers=True, gradient_as_bucket_view=False):
            pass

    class Torch213DDP:
        def __init__(self, module, device_ids=None, broadcast_buffers=None, forward_sync_buffers=None):
            pass

    monkeypatch.setattr(native, "DistributedDataParallel", Torch211DDP)
    assert native._no_buffer_sync() == {"broadcast_buffers": False}
    monkeypatch.setattr(native, "DistributedDataParallel", Torch213DDP)
    assert native._no_buffer_sync() == {"forward_sync_buffers": False}
