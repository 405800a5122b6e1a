"""The paper's code as a system (megatrain/systems/paper_code.py), its CPU-checkable parts: options, the refusals
(one line each; the CLI's exit 2), the pre-flight estimate against a measured run, the labels it is handed, the initial
checkpoint, and how the adapter calls their code (those skipped where .paper/ or MEGATRAIN_PAPER_CODE gives none).
CPU, seconds: pytest tests/unit/test_paper_code.py (their code trains on a GPU only: tests/gpu/test_paper_code_gpu.py)
"""

import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatrain import preflight
from megatrain.config import CaseConfig
from megatrain.engine import distributed
from megatrain.models import Transformer
from megatrain.models.checkpoint import open_checkpoint
from megatrain.models.init import init_module
from megatrain.models.loss import IGNORE_INDEX
from megatrain.probe import Machine
from megatrain.systems import build_system, paper_code, parse_options
from megatrain.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30
MACHINE = Machine(cpu="test", cpu_cores=16, host_mem_gib=252.0, host_available_gib=248.0, gpu_mem_gib=139.8)


def _case(**kw) -> CaseConfig:
    """A case the paper's code runs: one GPU, bf16, eager, the whole batch in one micro-batch."""
    return CaseConfig(**{"system": "paper", "model": "tiny", "batch": 2, "seq": 32, "device": "cuda",
                         "dtype": "bfloat16", "precision": "bf16", **kw})


@pytest.fixture
def installed(monkeypatch):
    """The code found and every package it needs installed but flash-attn, whatever this machine has; a test
    uninstalls one with installed(name, False)."""
    monkeypatch.setattr(paper_code, "missing_code", lambda: None)
    found = importlib.util.find_spec
    present = {"transformers": True, "yaml": True, "accelerate": True, "deepspeed": True, "flash_attn": False}

    def set_installed(name: str, is_installed: bool = True):
        present[name] = is_installed
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (object() if present[name] else None) if name in present else found(name, *a))
    return set_installed


def test_options_default_to_the_paper_codes_own_settings():
    opts = parse_options("paper", {})
    assert (opts.attn_implementation, opts.optimizer, opts.checkpoint_interval, opts.num_grad_slabs) == \
        ("auto", "deepspeed_adam", None, None)
    assert parse_options("paper", {"checkpoint_interval": 2, "optimizer": "adamw"}).checkpoint_interval == 2
    with pytest.raises(ValueError, match="option num_grad_slabs must be >= 1"):
        parse_options("paper", {"num_grad_slabs": 0})
    with pytest.raises(ValueError, match="attn_implementation='eager': expected 'auto' or 'flash_attention_2' or "
                                         "'sdpa'"):
        parse_options("paper", {"attn_implementation": "eager"})
    with pytest.raises(ValueError, match="paper has no option 'resident_layers' \\(an option of megatrain\\)"):
        parse_options("paper", {"resident_layers": 0})


@pytest.mark.parametrize("change, reason", [
    (dict(device="cpu", dtype="float32", precision="mixed"), "runs on a CUDA GPU only"),
    (dict(precision="mixed"), "keeps bf16 weights and no fp32 master: run it with --precision bf16"),
    (dict(compile=True), "runs eager (transformers' layers, called by its own loop): run it without --compile"),
    (dict(batch=4, micro_batch=2), "runs a step's 4 rows in one forward and backward"),
    (dict(model="tiny-moe"), "compared on dense models here; tiny-moe is a mixture of experts"),
    (dict(model="tiny-sliding"), "tiny-sliding has sliding-window layers, and under SDPA the paper's code passes no "
                                 "mask"),
    (dict(options={"attn_implementation": "flash_attention_2"}), "needs flash-attn, which is not installed"),
])
def test_what_it_cannot_run_is_refused_in_one_line_before_anything_is_built(installed, change, reason):
    case = _case(**change)
    plan = preflight.plan_case(case, MACHINE)
    assert not plan["fits"] and "host_bytes" not in plan and reason in plan["reason"] and "\n" not in plan["reason"]
    with pytest.raises(ValueError, match="^" + plan["reason"].replace("(", "\\(").replace(")", "\\)") + "$"):
        build_system(case)


def test_a_launch_of_several_ranks_and_a_missing_package_are_refused(installed, monkeypatch):
    installed("deepspeed", False)
    assert "needs DeepSpeed: pip install -e '.[deepspeed]', or --option optimizer=adamw" in \
        preflight.plan_case(_case(), MACHINE)["reason"]
    assert preflight.plan_case(_case(options={"optimizer": "adamw"}), MACHINE)["fits"]  # torch's AdamW needs none
    installed("accelerate", False)
    assert preflight.plan_case(_case(options={"optimizer": "adamw"}), MACHINE)["reason"] == \
        "the paper's code needs accelerate, which is not installed (pip install accelerate)"
    installed("accelerate")
    installed("deepspeed")
    monkeypatch.setattr(distributed, "launch_size", lambda: (2, 2))
    assert "this launch has 2 ranks: run it without torchrun" in preflight.plan_case(_case(), MACHINE)["reason"]


def test_absent_code_is_refused_with_how_to_bring_it(tmp_path, monkeypatch):
    monkeypatch.setenv(paper_code.CODE_ENV, str(tmp_path))
    # what the environment lacks, marked so: a suite that resumes plans the case again (the code carried by then)
    assert preflight.plan_case(_case(), MACHINE) == {"fits": False, "reason": f"{tmp_path} holds no infinity/ "
        "package: point MEGATRAIN_PAPER_CODE at a checkout of github.com/DLYuanGod/MegaTrain, or make .paper/ with "
        "scripts/paper_code.sh", "missing": True}
    monkeypatch.delenv(paper_code.CODE_ENV)
    monkeypatch.setattr(paper_code, "WORKSPACE", tmp_path)  # no .paper/ there
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "infinity" else found(name, *a))
    assert preflight.plan_case(_case(), MACHINE)["reason"].startswith("the paper's code is not here: make .paper/ "
                                                                      "from a checkout")
    (tmp_path / ".paper" / "infinity").mkdir(parents=True)
    (tmp_path / ".paper" / "infinity" / "__init__.py").touch()
    assert paper_code.code_dir() == tmp_path / ".paper" and paper_code.missing_code() is None


@pytest.mark.subprocess
def test_bench_without_the_code_exits_2_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megatrain", "bench", "--system", "paper", "--model", "tiny",
                           "--device", "cuda", "--dtype", "bfloat16", "--precision", "bf16"], cwd=ROOT,
                          env={**os.environ, paper_code.CODE_ENV: str(tmp_path)}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [f"error: {tmp_path} holds no infinity/ package: point "
                                                "MEGATRAIN_PAPER_CODE at a checkout of github.com/DLYuanGod/MegaTrain, "
                                                "or make .paper/ with scripts/paper_code.sh"]


def test_train_refuses_a_benchmark_peer():
    with pytest.raises(ValueError, match="--system paper is a benchmark peer \\(bench and suites\\), not a trainer: "
                                         "train with megatrain, native, deepspeed, fsdp, torchao$"):
        TrainConfig(system="paper", model="tiny", data=["rows.jsonl"], steps=1)


def test_estimate_is_the_measured_run_of_issue_45():
    # Qwen2.5-7B, seq 1024, batch 16, one H200, their commit 919520f (SDPA, DeepSpeedCPUAdam): host RSS 111.7 GiB,
    # GPU 12.7 GiB. The host: 12 B/param of bf16 weights and gradients and fp32 moments (91.1 GiB), 30 pinned blocks
    # of 512 MiB (the 28 layers' flat copies and two staging layers) and 12 gradient slabs of 512 MiB, the head's and
    # the embedding's 2 GiB blocks.
    case = _case(model="qwen2.5-7b", batch=16, seq=1024)
    host, gpu = paper_code.memory_bytes(case)
    params = case.shape().num_params()
    assert host == 12 * params + (28 + 2 + 12) * 2**29 + 2 * 2**31
    assert abs(host / GIB - 111.7) < 0.05 * 111.7 and abs(gpu / GIB - 12.7) < 0.1 * 12.7
    adamw = dataclasses.replace(case, options={"optimizer": "adamw"})  # torch's AdamW: bf16 moments
    assert paper_code.memory_bytes(adamw)[0] == host - 4 * params
    # the loss's log-softmax of every position outgrows a layer's backward at large batches: their 148 on 80 GB fits
    large = paper_code.memory_bytes(dataclasses.replace(case, batch=148, micro_batch=148))[1]
    assert 60 * GIB < large < 70 * GIB


def test_shifted_labels_score_each_position_against_its_own_next_token():
    labels = torch.tensor([[5, 6, IGNORE_INDEX, 8], [1, 2, 3, 4]])
    shifted = paper_code.shifted_labels(labels)
    assert shifted.tolist() == [[IGNORE_INDEX, 5, 6, IGNORE_INDEX], [IGNORE_INDEX, 1, 2, 3]]
    # their loss (infinity.model.cpu_master): position t's logits against labels[:, t + 1], t < seq - 1, summed over
    # valid labels and divided by their count: ours over every position but the last
    logits = torch.randn(2, 4, 10)
    theirs = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 10), shifted[:, 1:].reshape(-1),
                                               ignore_index=IGNORE_INDEX)
    ours = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 10), labels[:, :-1].reshape(-1),
                                             ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=0)


def test_initial_checkpoint_holds_natives_initial_weights_and_is_written_once(tmp_path):
    case = _case(seed=7)
    out = paper_code.initial_checkpoint(case, tmp_path, "cpu")
    native = Transformer(case.shape())
    init_module(native, 7)
    expected = {n: p.detach().to(torch.bfloat16) for n, p in native.named_parameters()}
    written = dict(open_checkpoint(out).weights())
    assert written.keys() == expected.keys()
    for name, tensor in written.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected[name]), name
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert paper_code.initial_checkpoint(case, tmp_path, "cpu") == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp and list(tmp_path.iterdir()) == [out]
    assert paper_code.initial_checkpoint(dataclasses.replace(case, seed=8), tmp_path, "cpu") != out


def _their_code():
    if paper_code.missing_code():
        pytest.skip(f"the paper's code is not here ({paper_code.missing_code()})")
    return paper_code._import_code()


def test_their_config_is_their_defaults_but_the_cases_shape_hyperparameters_and_options(tmp_path):
    infinity, commit = _their_code()
    case = _case(model="qwen2.5-7b", batch=16, seq=1024)
    config = paper_code.their_config(infinity, case, tmp_path)
    assert (config.checkpoint_interval, config.num_grad_slabs, config.devices, config.world_size) == (4, 12, [0], 1)
    assert (config.batch_size, config.max_seq_len, config.learning_rate, config.beta2, config.max_grad_norm) == \
        (16, 1024, case.optim.lr, case.optim.beta2, case.optim.max_grad_norm)
    assert config.dtype == torch.bfloat16 and config.attn_implementation == paper_code.attention(case.opts)
    given = paper_code.their_config(infinity, _case(options={"checkpoint_interval": 2, "num_grad_slabs": 6}), tmp_path)
    assert (given.checkpoint_interval, given.num_grad_slabs) == (2, 6)
    assert commit is None or len(commit) == 40


def test_without_flash_attn_their_layers_get_no_mask():
    infinity, _ = _their_code()
    theirs = object.__new__(infinity.CPUMasterModel)  # the kwargs builder reads only what the layers accept
    theirs.layer_accepts_cache_position = theirs.layer_accepts_position_embeddings = True
    theirs.layer_accepts_position_ids = False
    mask = torch.ones(2, 8)
    assert theirs._build_layer_kwargs(mask, "cache", "ids", "rope")["attention_mask"] is mask
    unmasked = object.__new__(paper_code._unmasked(infinity.CPUMasterModel))
    unmasked.__dict__.update(theirs.__dict__)
    assert unmasked._build_layer_kwargs(mask, "cache", "ids", "rope") == {
        "attention_mask": None, "use_cache": False, "output_attentions": False, "cache_position": "cache",
        "position_embeddings": "rope"}


class _FakeMaster:
    """Their CPUMasterModel's calls as train.py makes them, on the host: every gradient `grad` (1), their timings
    fixed."""

    def __init__(self, hf_model, config):
        self.config, self.params, self.calls = config, list(hf_model.parameters()), []
        self.gpu_contexts = [type("Context", (), {"ce_loss": None})()]
        self.grad = 1.0

    def forward_and_backward(self, input_ids, attention_mask, labels):
        self.calls.append(("forward_and_backward", input_ids, attention_mask, labels))
        for p in self.params:
            p.grad = torch.full_like(p, self.grad)
        return 5.0, input_ids.numel(), {"forward": 0.25, "backward": 0.5, "total": 0.75}

    def get_parameters(self):
        return self.params

    def _sync_params_to_gpu(self):
        self.calls.append(("_sync_params_to_gpu",))

    def zero_grad(self):
        self.calls.append(("zero_grad",))

    def cleanup(self):
        self.calls.append(("cleanup",))


def test_the_system_loads_the_checkpoint_and_steps_as_train_py_does(tmp_path, monkeypatch):
    """The adapter around their model, on the host (their model itself needs CUDA): transformers loads the initial
    checkpoint as train.py does, their config and a stand-in of their CPUMasterModel get it, and a step is train.py's
    (forward_and_backward on our rows with our labels shifted, clipping, AdamW, the weights back, both zero_grads)."""
    infinity, _ = _their_code()
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(paper_code, "refusal", lambda case, world: None)
    monkeypatch.setattr(paper_code, "WORKSPACE", tmp_path)
    real_checkpoint, load = paper_code.initial_checkpoint, transformers.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(paper_code, "initial_checkpoint", lambda case, root, device: real_checkpoint(case, root, "cpu"))
    loaded = {}

    def from_pretrained(path, device_map, **kw):  # accelerate, which device_map needs, may be absent here
        loaded.update(kw, device_map=device_map)
        return load(path, **kw)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(infinity, "CPUMasterModel", _FakeMaster)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    case = _case(options={"optimizer": "adamw"})
    system = build_system(case)
    assert loaded == {"torch_dtype": torch.bfloat16, "device_map": "cpu", "trust_remote_code": True,
                      "attn_implementation": paper_code.attention(case.opts)}
    before = system.named_parameters_fp32()
    assert before.keys() == case.shape().param_shapes().keys()
    inputs, labels = torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32))
    assert system.step(inputs, labels) == 5.0
    name, given_inputs, mask, given_labels = system.model.calls[0]
    assert given_inputs is inputs and torch.equal(mask, torch.ones_like(inputs))
    assert torch.equal(given_labels, paper_code.shifted_labels(labels))
    assert [c[0] for c in system.model.calls] == ["forward_and_backward", "_sync_params_to_gpu", "zero_grad"]
    assert system.last_grad_norm == pytest.approx(case.shape().num_params() ** 0.5, rel=1e-2)
    after = system.named_parameters_fp32()
    # AdamW moved every matrix (~0.02: its 1e-4 update is above half a bf16 ulp there) and no norm weight (1.0: the
    # same update is below half an ulp): without an fp32 master, their small updates are lost
    norms = {n for n in before if n.endswith("norm.weight")}
    assert all(not torch.equal(before[n], after[n]) for n in before.keys() - norms)
    assert all(torch.equal(before[n], after[n]) for n in norms)
    assert all(p.grad is None for p in system.model.params), "optimizer.zero_grad after model.zero_grad"
    metrics = system.metrics()
    assert (metrics["forward_s"], metrics["backward_s"]) == (0.25, 0.5) and 0 < metrics["exposed_optim_frac"] < 1
    assert metrics["grad_norms"] == [system.last_grad_norm]  # before clipping to 1.0: the gradient's own
    system.model.grad = float("inf")  # a gradient gone non-finite: its norm is recorded, and their loop steps on it
    system.step(inputs, labels)
    assert system.metrics()["grad_norms"][1:] == [float("inf")] == [system.last_grad_norm]
    assert all(not p.isfinite().any() for p in system.named_parameters_fp32().values())
    config = system.system_config()
    assert (config["checkpoint_interval"], config["num_grad_slabs"]) == (4, 12)
    assert config["optimizer"] == "torch.optim.AdamW, bf16 moments"
    assert config["scored_positions"].startswith("31 of 32")
    system.close()
