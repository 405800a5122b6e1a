"""The Python API on the GPU. Needs CUDA, about a minute: pytest tests/gpu/test_api_gpu.py -m gpu (records as
tests/gpu/test_engine_gpu.py says).

1. Engine, fp32 (TF32 off), streamed under random stream delays: its own loop over train's batches against `train` of
   the same settings, losses to 1e-5 relative (the engine's seq is train's + 1: other shapes, the same predictions);
   saved after step 2 and loaded by a fresh engine, the steps after it bit for bit.
2. Trainer with --report-to tensorboard on CUDA: every metrics line carries the GPU peak, and TensorBoard's event files
   under --out hold each step's loss and GPU peak.
"""

import json

import pytest
import torch
from train_helpers import BATCH, BETAS, CLIP, EPS, LR, SEQ, WD, hf_model, metrics, pretokenized, train_args

import megatrain
from megatrain.cli import main

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_tf32")]
pytest.importorskip("transformers")
STREAMED = {"resident_embedding": False, "resident_layers": 0, "stream_stress": 5}
STEPS = 6


def test_an_engine_loop_on_the_gpu_trains_as_train_does_and_resumes_bit_for_bit(tmp_path, check):
    init = hf_model("qwen2", tmp_path / "init")
    data = pretokenized(tmp_path / "data.jsonl", rows=12)
    options = [a for k, v in STREAMED.items() for a in ("--option", f"{k}={json.dumps(v)}")]
    extra = ["--lr-schedule", "constant", "--warmup-steps", "0", *options]
    assert main(train_args(init, data, tmp_path / "cli", steps=STEPS, extra=extra, device="cuda")) == 0
    rows = torch.tensor([json.loads(line)["input_ids"] for line in data.read_text().splitlines()])
    batches = [rows[[(i * BATCH + j) % len(rows) for j in range(BATCH)]] for i in range(STEPS)]
    settings = dict(seq=SEQ + 1, batch=BATCH, micro_batch=2, lr=LR, weight_decay=WD, max_grad_norm=CLIP,
                    adam_betas=BETAS, adam_eps=EPS, dtype="float32", device="cuda", option=STREAMED)
    with megatrain.Engine(init, **settings) as engine:
        losses = [engine.step(b) for b in batches[:2]]
        engine.save(tmp_path / "state")
        losses += [engine.step(b) for b in batches[2:]]
    with megatrain.Engine(init, **settings) as engine:
        engine.load(tmp_path / "state")
        resumed = [engine.step(b) for b in batches[2:]]
    ref = [m["loss"] for m in metrics(tmp_path / "cli")]
    check.update(engine_losses=losses, train_losses=ref, resumed_losses=resumed, rtol=1e-5)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=0)
    assert resumed == losses[2:]


def test_tensorboard_holds_each_steps_loss_and_gpu_peak(tmp_path, check):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    init = hf_model("qwen2", tmp_path / "init")
    data = pretokenized(tmp_path / "data.jsonl", rows=12)
    result = megatrain.Trainer(init_from=init, data=data, seq=SEQ, batch=BATCH, steps=4, device="cuda",
                               dtype="bfloat16", out=tmp_path / "run", report_to="tensorboard").train()
    lines = metrics(tmp_path / "run")
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    logged = {key: [(e.step, e.value) for e in events.Scalars(key)] for key in ("loss", "gpu_peak_gib")}
    check.update(losses=result.losses, gpu_peak_gib=[m["gpu_peak_gib"] for m in lines])
    assert result.exit_code == 0 and all(m["gpu_peak_gib"] > 0 for m in lines)
    for key, values in logged.items():
        assert values == [(m["step"], pytest.approx(m[key], rel=1e-6)) for m in lines], key
