"""Shared by the CPU and GPU train tests: a tiny Hugging Face model and pre-tokenized data on disk, and the train
command over them."""

import copy
import ctypes
import errno
import importlib.util
import json
import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import transformers
from families import family_config, generic_config

from megatrain.cli import main
from megatrain.tokenizer import Tokenizer
from megatrain.train.lr import lr_at

# the marks of a test that needs DeepSpeed installed (its optional extra)
needs_deepspeed = [pytest.mark.deepspeed,
                   pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")]
VOCAB, SEQ, BATCH, STEPS = 128, 16, 4, 10
LR, WARMUP, MIN_LR, WD, BETAS, EPS, CLIP = 3e-3, 3, 3e-4, 0.1, (0.9, 0.95), 1e-8, 0.5
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)


def hf_model(kind: str, path):
    """A tiny random transformers model of `kind` (families.KINDS) saved in `path`."""
    torch.manual_seed(0)
    config = family_config(kind, **SHAPE)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    model.save_pretrained(path, safe_serialization=True)
    return path


def generic_model(kind: str, path, **extra):
    """A tiny random transformers model of generic `kind` (families.GENERIC_KINDS) saved in `path`, its buffers
    (DeepSeek's router score correction) random too, so that a path that lost them would differ."""
    torch.manual_seed(0)
    config = generic_config(kind, **{**SHAPE, **extra})
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if "correction_bias" in name:
                buffer.normal_(0, 0.1)
    model.save_pretrained(path)
    return path


def pretokenized(path, rows: int = 24, seed: int = 1, varied: bool = False):
    """Rows of exactly SEQ + 1 random ids (one sequence each), or with varied=True documents of 3 to SEQ + 1 ids."""
    gen = torch.Generator().manual_seed(seed)
    with path.open("w") as f:
        for _ in range(rows):
            n = int(torch.randint(3, SEQ + 2, (), generator=gen)) if varied else SEQ + 1
            f.write(json.dumps({"input_ids": torch.randint(0, VOCAB, (n,), generator=gen).tolist()}) + "\n")
    return path


def chat_tokenizer(path):
    """A word-level tokenizer with a ChatML template, saved as a local Hugging Face tokenizer directory."""
    from tokenizers import Regex, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer

    words = ["<unk>", "<|im_start|>", "<|im_end|>", "<eos>", "user", "assistant", "system", "\n", " "] + \
        [f"w{i}" for i in range(20)]
    raw = RawTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex(r"<\|im_start\|>|<\|im_end\|>|\n| "), "isolated")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fast.save_pretrained(path)
    return Tokenizer(str(path))


def run_train(init, data, out, system="megatrain", steps=STEPS, extra=(), dtype="float32", device="cpu"):
    """`python -m megatrain train` of a case; returns its exit code."""
    return main(train_args(init, data, out, system, steps, extra, dtype, device))


def train_args(init, data, out, system="megatrain", steps=STEPS, extra=(), dtype="float32", device="cpu"):
    """The arguments of `python -m megatrain` that train a case."""
    return ["train", "--system", system, "--init-from", str(init), "--data", str(data), "--no-shuffle",
            "--seq", str(SEQ), "--batch", str(BATCH), "--micro-batch", "2", "--steps", str(steps), "--lr", str(LR),
            "--lr-schedule", "cosine", "--warmup-steps", str(WARMUP), "--min-lr", str(MIN_LR), "--weight-decay",
            str(WD), "--adam-betas", *map(str, BETAS), "--adam-eps", str(EPS), "--max-grad-norm", str(CLIP),
            "--out", str(out), "--dtype", dtype, "--device", device, *extra]


def one_error(capsys) -> str:
    """The one error line of the last command (log lines, notes and warnings before it aside)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err
    return errors[0]


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def at_step(monkeypatch, n: int, action) -> None:
    """action() once step n of the next train run has computed, before the run records it."""
    import megatrain.train.engine as engine  # the Engine train's loop opens builds the system

    build = engine.build_system

    def built(case):
        system = build(case)
        step, count = system.step, [0]

        def stepped(*args):
            loss = step(*args)
            count[0] += 1
            if count[0] == n:
                action()
            return loss

        system.step = stepped
        return system

    monkeypatch.setattr(engine, "build_system", built)


def interrupt_at_step(monkeypatch, n: int, sig=signal.SIGINT) -> None:
    """Ctrl-C (or another signal) during step n of the next train run: the step finishes, is saved, and the run
    stops (exit 130; 143 for SIGTERM)."""
    at_step(monkeypatch, n, lambda: os.kill(os.getpid(), sig))


def reference_training(init, data, attn="eager", steps=STEPS, float64=False):
    """(losses, model) of run_train's `steps` done with the transformers model in train mode, torch.optim.AdamW,
    clip_grad_norm_ and the same schedule; with float64, in float64 (float32 rounding's judge). A config with dropout
    or jitter draws each layer's masks from the seed train's systems draw them from (megatrain.models.draws: one per
    step, unit and micro-batch), set by forward pre-hooks on transformers' own modules, which apply the masks; such a
    model's attention must be the one our systems run (attn: sdpa), whose dropout draws where eager's does not."""
    model = transformers.AutoModelForCausalLM.from_pretrained(init, attn_implementation=attn).float()
    model = (float64_twin(model) if float64 else model).train()
    draws = seeded_draws(model)
    params = [p for p in model.parameters()]
    decay = [p for name, p in model.named_parameters() if p.ndim >= 2 and not name.endswith("bias")]  # experts' [E, n]
    groups = [{"params": decay, "weight_decay": WD},
              {"params": [p for p in params if all(p is not d for d in decay)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS)
    rows = [json.loads(line)["input_ids"] for line in data.read_text().splitlines()]
    losses = []
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, LR, "cosine", WARMUP, MIN_LR)
        block = torch.tensor([rows[(step * BATCH + i) % len(rows)] for i in range(BATCH)])
        inputs, targets = block[:, :-1], block[:, 1:]
        total = 0.0
        for m, mb in enumerate((slice(0, 2), slice(2, 4))):
            draws.step, draws.micro_batch = step, m
            out = model(inputs[mb])
            loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, VOCAB), targets[mb].reshape(-1),
                                                     reduction="sum") / targets.numel()
            if getattr(out, "aux_loss", None) is not None:  # the mean over the step's two micro-batches
                loss = loss + model.config.router_aux_loss_coef * out.aux_loss / 2
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, model


def float64_twin(model):
    """A float64 copy of a transformers model, the judge of float32 rounding; its experts run their per-expert loop
    (grouped_mm, their default, has no float64 kernel)."""
    twin = copy.deepcopy(model).double()
    twin.set_experts_implementation("eager")
    return twin


# How near a float32 result must be to transformers' own: judged by the same computation in float64, at most
# AS_NEAR times as far from it as transformers' float32 result is (each tensor's largest difference over its largest
# value, against the reference's largest over them all; FLOOR_ULPS of float32 the least). A bound derived so holds on
# any CPU: another vector width or thread count moves both float32 results alike, where a constant held to
# transformers' float32 result failed on another CPU (gemma3's exported logits 1.12e-4 from it, 1e-4 allowed). Tiny
# models amplify rounding a hundredfold and more, unevenly: Gemma's embedding scale (sqrt(hidden)) and softcapped
# logits, Gemma 4's unscaled attention over normed queries and keys, near ties between experts, and Adam's first
# update of a gradient that is rounding noise (lr either way). Measured: at most 3.3x, over the 12 generic families'
# losses and exported logits after 10 steps (megatrain and native) and Gemma 4's gradients under every plan, on the
# AVX2 path of an AMD EPYC and on the second path (nox -s tolerance). Still caught: a learning rate 0.1% off, in each
# of gemma3, gemma4, mixtral, llama4 and olmo2.
AS_NEAR = 8
# The reference's spread is taken as at least this many float32 epsilons (2^-23): transformers' float32 logits can
# land within 2.5 of float64's by chance (granite's, on an Intel Xeon), where ours, as right, were 23 off (9.3x).
# Measured there: a learning rate 0.1% off is still caught in granite, gemma3, llama4, mixtral and olmo2 (its losses
# 3.4x past the bound in mixtral, the closest; 12.7x the spread in gemma3's, whose spread is 28)
FLOOR_ULPS = 8


def assert_as_near_as_transformers(ours: dict, reference: dict, judge: dict, factor: float = AS_NEAR) -> None:
    """Each tensor of `ours` (by name) as near the float64 `judge` as transformers' float32 `reference` is: its
    largest difference over its largest value at most `factor` times the reference's largest such (FLOOR_ULPS the
    least)."""
    ours, reference, judge = ({k: torch.as_tensor(v, dtype=torch.float64) for k, v in d.items()}
                              for d in (ours, reference, judge))
    scale = {k: float(j.abs().max()) for k, j in judge.items()}
    spread = max(FLOOR_ULPS * torch.finfo(torch.float32).eps, *(float((reference[k] - j).abs().max()) / scale[k]
                                                                for k, j in judge.items()))
    for k, j in judge.items():
        error = float((ours[k] - j).abs().max()) / scale[k]
        assert error <= factor * spread, f"{k}: {error:.2e} of its largest value from float64, where transformers' " \
            f"float32 is {spread:.2e} ({factor}x allowed)"


def seeded_draws(model, seed=0):
    """The Draws (megatrain.models.draws) of a transformers causal LM, train's default seed, reseeding its units as
    every system does (megatrain.models.generic.module.reseed_units); set its step and micro-batch."""
    from megatrain.models.draws import Draws
    from megatrain.models.generic.module import reseed_units
    from megatrain.models.generic.skeleton import Parts

    draws = Draws(seed)
    reseed_units(Parts(model), draws, lambda: model.training)
    return draws


ROOT = Path(__file__).resolve().parents[1]
OFFLOAD = ("deepspeed", "fsdp")  # each owns a process group, and DeepSpeed patches torch at import: a fresh process
WORKER = """
import json, sys
import pytest
from train_helpers import train_any
from megatrain.cli import exit_process
exit_process(train_any(**json.loads(sys.argv[1]), fresh_process=False))  # as python -m megatrain ends
"""


def python_process(code: str, *args: str) -> subprocess.CompletedProcess:
    """`python -c code args` in a fresh process of one thread that imports this checkout and these helpers."""
    paths = [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, paths))}
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)


def train_any(system, init, data, out, extra=(), interrupt=0, resume=False, steps=STEPS, dtype="float32",
              device="cpu", fresh_process=None) -> int:
    """`train` of a case, interrupted by Ctrl-C during step `interrupt` or resumed; returns its exit code. The
    offload systems run in a fresh process (as in test_baselines)."""
    if fresh_process is None:
        fresh_process = system in OFFLOAD
    if fresh_process:
        job = {"system": system, "init": str(init), "data": str(data), "out": str(out), "extra": list(extra),
               "interrupt": interrupt, "resume": resume, "steps": steps, "dtype": dtype, "device": device}
        proc = python_process(WORKER, json.dumps(job))
        assert proc.returncode in (0, 130), proc.stdout[-2000:] + proc.stderr[-4000:]
        return proc.returncode
    with pytest.MonkeyPatch.context() as mp:
        if interrupt:
            interrupt_at_step(mp, interrupt)
        if resume:
            return main(["train", "--resume", str(out)])
        return run_train(init, data, out, system=system, steps=steps, extra=extra, dtype=dtype, device=device)


def fill(path, leave_bytes: int = 0) -> None:
    """Fill the disk under path, then free leave_bytes of it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, bytes(2**16)):
            pass
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.ftruncate(fd, max(os.fstat(fd).st_size - leave_bytes, 0))
        os.close(fd)


MS_RDONLY, MS_REMOUNT, MS_BIND = 1, 32, 4096


@contextmanager
def tmpfs(path, options: str, read_only: bool = False):
    """A tmpfs mounted at path (root, where the sandbox allows it); skips the test otherwise."""
    path.mkdir()
    if _libc.mount(b"tmpfs", str(path).encode(), b"tmpfs", MS_RDONLY if read_only else 0, options.encode()) != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here ({os.strerror(ctypes.get_errno())})")
    try:
        yield path
    finally:
        unmount(path)


def make_read_only(path) -> None:
    """Bind-mount directory path read-only over itself (as a folder made read-only mid-run, which root's writes
    ignore a chmod of); undone by unmount(path)."""
    for source, flags in ((str(path).encode(), MS_BIND), (None, MS_BIND | MS_REMOUNT | MS_RDONLY)):
        if _libc.mount(source, str(path).encode(), None, flags, None) != 0:
            pytest.skip(f"bind mounts are not permitted here ({os.strerror(ctypes.get_errno())})")


def unmount(path) -> None:
    _libc.umount2(str(path).encode(), 2)  # MNT_DETACH


_libc = ctypes.CDLL(None, use_errno=True)
