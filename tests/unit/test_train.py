"""`python -m megatrain train` against transformers + torch.optim.AdamW, resume bit for bit, data formats, packed
documents (of either kind of model) and schedules, for every system (DeepSpeed and FSDP2 each in a fresh process).
CPU, about a minute: pytest tests/unit/test_train.py"""

import argparse
import dataclasses
import functools
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from families import KINDS, generic_config  # noqa: E402
from train_helpers import (  # noqa: E402
    BATCH,
    CLIP,
    LR,
    MIN_LR,
    SEQ,
    SHAPE,
    STEPS,
    VOCAB,
    WARMUP,
    chat_tokenizer,
    generic_model,
    hf_model,
    metrics,
    needs_deepspeed,
    pretokenized,
    reference_training,
    run_train,
    train_any,
)

from megatrain.cli import main  # noqa: E402
from megatrain.config import CaseConfig  # noqa: E402
from megatrain.models import model_shape  # noqa: E402
from megatrain.models.generic import GenericConfig  # noqa: E402
from megatrain.models.init import init_module  # noqa: E402
from megatrain.models.kinds import kind_of  # noqa: E402
from megatrain.models.loss import IGNORE_INDEX  # noqa: E402
from megatrain.train.config import add_train_arguments, config_from_args  # noqa: E402
from megatrain.train.data import Example, Rows, read_examples  # noqa: E402
from megatrain.train.lr import lr_at  # noqa: E402

SYSTEMS = ["megatrain", "native", pytest.param("deepspeed", marks=needs_deepspeed), "fsdp"]


# What a family changes is the model's forward and its checkpoint names, which every system shares (megatrain.models,
# models.handwritten.hf) and which megatrain and native check for every kind in-process. What the offload systems do of
# their own per family: the experts (DeepSpeed's MoE leaf modules, FSDP's units around them), the router's aux loss,
# the attention sinks, and biases and norms in their decay groups; so they train the first two kinds (qwen2's biases,
# llama) and the two mixtures that hold all of those (qwen3-moe-aux: experts, the aux loss, qk-norms; gpt-oss:
# sinks, expert biases, alternating windows), those in a fresh process. (qwen3-moe is qwen3-moe-aux without the aux
# loss; YaRN and sliding windows change the forward alone, which they share.)
OFFLOAD_KINDS = (*KINDS[:2], "gpt-oss", "qwen3-moe-aux")


def _family_cases():
    """megatrain and native x every kind; DeepSpeed and FSDP2 x OFFLOAD_KINDS, those beyond the first two in the
    subprocess session."""
    for system in ("megatrain", "native", "deepspeed", "fsdp"):
        for kind in KINDS if system in ("megatrain", "native") else OFFLOAD_KINDS:
            marks = needs_deepspeed if system == "deepspeed" else []
            if system in ("deepspeed", "fsdp") and kind not in KINDS[:2]:
                marks = [*marks, pytest.mark.subprocess]
            yield pytest.param(system, kind, marks=marks, id=f"{system}-{kind}")


@pytest.mark.parametrize("system,kind", _family_cases())
def test_train_matches_transformers_with_adamw_and_exports_a_checkpoint_transformers_loads(tmp_path, kind, system):
    init = hf_model(kind, tmp_path / "init")
    data = pretokenized(tmp_path / "data.jsonl")
    held_out = pretokenized(tmp_path / "eval.jsonl", rows=6, seed=2)
    extra = ["--eval-data", str(held_out), "--eval-every", "5"]
    assert train_any(system, init, data, tmp_path / "run", extra=extra) == 0
    ref_losses, ref_model = reference_training(init, data)
    lines = metrics(tmp_path / "run")
    ours = [m for m in lines if "loss" in m]
    evals = [m for m in lines if "eval_loss" in m]
    assert [m["step"] for m in evals] == [5, 10] and evals[-1]["eval_tokens"] == 6 * 16
    block = torch.tensor([json.loads(line)["input_ids"] for line in held_out.read_text().splitlines()])
    with torch.no_grad():
        ref_eval = torch.nn.functional.cross_entropy(ref_model(block[:, :-1]).logits.reshape(-1, VOCAB),
                                                     block[:, 1:].reshape(-1))
    # Losses to 1e-5: transformers' own float32 losses are within 1.5e-7 of float64's (qwen2, gpt-oss, qwen3-moe, on
    # both CPU code paths of nox -s tolerance), these families amplifying no rounding as Gemma's do (test_generic)
    assert evals[-1]["eval_loss"] == pytest.approx(float(ref_eval), rel=1e-5)
    assert [m["step"] for m in ours] == list(range(1, STEPS + 1))
    torch.testing.assert_close(torch.tensor([m["loss"] for m in ours]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert ours[0]["lr"] == pytest.approx(LR / WARMUP) and ours[-1]["lr"] > MIN_LR  # the last step trains too
    assert max(m["grad_norm"] for m in ours) > CLIP  # clipping acted
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf")
    source, export = (json.loads((d / "config.json").read_text()) for d in (init, tmp_path / "run" / "hf"))
    assert export == source, "the source's config, whole (its dtype too: float32)"
    ref = dict(ref_model.named_parameters())
    for name, p in exported.named_parameters():
        # Adam divides each element's gradient by its own magnitude: an element whose gradient is rounding noise (a
        # cancellation, a k bias under slow rotations) moves by up to lr in either direction. So: all but 1 in 1000
        # of the model's elements to float noise, and none beyond one step
        assert (p - ref[name]).abs().max() <= LR, name
    far = sum(int((~torch.isclose(p, ref[name], rtol=1e-4, atol=1e-5)).sum())
              for name, p in exported.named_parameters())
    assert far <= sum(p.numel() for p in exported.parameters()) / 1000


# Ctrl-C is the loop's (megatrain.train.loop), the same for every system; what is each system's own is its save and
# load, which DeepSpeed and FSDP2 resume bit for bit in tests/unit/test_distributed_baselines.py (a killed rank)
@pytest.mark.subprocess
@pytest.mark.parametrize("system", ["megatrain", "native"])
def test_ctrl_c_saves_and_the_resumed_run_is_bit_for_bit_the_uninterrupted_one(tmp_path, system):
    init = hf_model("qwen2", tmp_path / "init")
    data = pretokenized(tmp_path / "data.jsonl", rows=10)  # 10 rows, batch 4: steps cross epochs
    extra = ["--save-every", "2", "--keep", "2"]
    assert train_any(system, init, data, tmp_path / "straight", extra=extra) == 0
    assert train_any(system, init, data, tmp_path / "first", extra=extra, interrupt=5) == 130
    checkpoints = sorted(p.name for p in (tmp_path / "first" / "checkpoints").iterdir())
    assert checkpoints == ["step-4", "step-5"], "every 2 steps and at the interruption, the last 2 kept"
    (tmp_path / "first").rename(tmp_path / "cut")  # a run directory resumes from wherever it now is
    assert train_any(system, init, data, tmp_path / "cut", resume=True) == 0
    straight, cut = metrics(tmp_path / "straight"), metrics(tmp_path / "cut")
    assert [m["step"] for m in cut] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in cut] == [m["loss"] for m in straight]
    a = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "straight" / "hf")
    b = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "cut" / "hf")
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_steps_count_from_the_runs_start(tmp_path):
    init = hf_model("llama", tmp_path / "init")
    data = pretokenized(tmp_path / "data.jsonl")
    constant = ["--lr-schedule", "constant", "--warmup-steps", "0"]
    assert run_train(init, data, tmp_path / "straight", steps=6, extra=constant) == 0
    assert run_train(init, data, tmp_path / "cut", steps=3, extra=constant) == 0
    assert main(["train", "--resume", str(tmp_path / "cut"), "--steps", "6"]) == 0
    assert [m["loss"] for m in metrics(tmp_path / "cut")] == [m["loss"] for m in metrics(tmp_path / "straight")]


def test_bad_train_input_is_refused_with_one_line(tmp_path, capsys):
    assert main(["train", "--model", "tiny", "--data", str(tmp_path / "missing.jsonl"), "--steps", "1"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["train", "--model", "tiny", "--system", "zero", "--data", "x", "--steps", "1"]) == 2
    assert "--system must be one of" in capsys.readouterr().err
    assert main(["train", "--resume", str(tmp_path)]) == 2


def test_no_save_exports_without_checkpoints_and_a_full_disk_is_refused_before_training(tmp_path, monkeypatch,
                                                                                      capsys):
    init, data = hf_model("qwen2", tmp_path / "init"), pretokenized(tmp_path / "data.jsonl")
    assert run_train(init, data, tmp_path / "run", steps=2, extra=["--no-save"]) == 0
    assert not (tmp_path / "run" / "checkpoints").exists() and (tmp_path / "run" / "hf" / "config.json").exists()
    import megatrain.train.checkpoint as checkpoint

    usage = checkpoint.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda _: usage._replace(free=600_000))  # ~1.6x the export
    assert run_train(init, data, tmp_path / "full", steps=4, extra=["--save-every", "1", "--keep", "2"]) == 2
    assert "3 checkpoint(s)" in capsys.readouterr().err and not (tmp_path / "full").exists()
    assert run_train(init, data, tmp_path / "fits", steps=4, extra=["--no-save"]) == 0  # the export alone fits


@pytest.mark.parametrize("schedule,min_lr", [("cosine", 0.0), ("cosine", 0.1), ("linear", 0.0)])
def test_schedules_decay_as_transformers_does_so_the_last_step_still_trains(schedule, min_lr):
    """After the warmup, transformers' own schedule (get_cosine_schedule_with_warmup, ..._with_min_lr_..., and
    get_linear_schedule_with_warmup, stepped after each update): the last update trains at more than min_lr (it
    trained at min_lr, 0 by default, and moved nothing). The warmup reaches lr one step before transformers', whose
    first update is at lr 0."""
    from transformers import optimization

    total, warmup, lr = 10, 2, 1.0
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    make = {"linear": optimization.get_linear_schedule_with_warmup,
            "cosine": functools.partial(optimization.get_cosine_with_min_lr_schedule_with_warmup, min_lr=min_lr)}
    scheduler = make[schedule](opt, warmup, total)
    theirs = []
    for _ in range(total):
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    ours = [lr_at(s, total, lr, schedule, warmup, min_lr) for s in range(total)]
    assert ours[warmup:] == pytest.approx(theirs[warmup:], rel=1e-12)
    assert ours[:warmup] == pytest.approx(theirs[1:warmup + 1], rel=1e-12)
    assert ours[-1] > min_lr and all(a >= b for a, b in zip(ours[warmup - 1:], ours[warmup:], strict=False))
    assert lr_at(5, total, lr, "constant", warmup, min_lr) == lr


def test_chat_and_alpaca_data_train_only_on_the_assistant_tokens(tmp_path):
    tok = chat_tokenizer(tmp_path / "tok")
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "w1 w2"},
                                             {"role": "assistant", "content": "w3"}]}) + "\n"
                    + json.dumps({"instruction": "w4", "output": "w5 w6"}) + "\n"
                    + json.dumps({"text": "w7 w8"}) + "\n")
    chat, alpaca, text = read_examples([data], tok, train_on_prompt=False)
    def decode(ids):
        return [tok.token(i) for i in ids]

    assert [t for t, y in zip(decode(chat.ids), chat.target, strict=True) if y] == ["w3", "<|im_end|>", "\n"]
    assert [t for t, y in zip(decode(alpaca.ids), alpaca.target, strict=True) if y] == \
        ["w5", " ", "w6", "<|im_end|>", "\n"]
    assert all(text.target) and decode(text.ids)[-1] == "<eos>"
    everything = read_examples([data], tok, train_on_prompt=True)[0]
    assert all(everything.target)
    rows = Rows([chat], seq=32, vocab_size=64, shuffle=False, seed=0)
    inputs, labels, segments = rows.batch(0, 1)
    assert (labels != IGNORE_INDEX).sum() == 3 and inputs.shape == (1, 32) and segments is None


def _packed_case(name: str):
    """The shape of packed-row case `name` and its tolerances (loss rtol, gradient rtol, gradient atol). The
    hand-written model's document masks alone ("tiny"), and with sliding-window layers, a window shorter than two of
    the documents ("tiny-sliding"); transformers' own masks, kept apart by position ids restarting at each document,
    over sliding and full layers (gemma3) and chunked and full (llama4), whose rounding is ten times ours."""
    if name == "tiny-sliding":
        return dataclasses.replace(model_shape("tiny"), sliding_window=4, layer_types=(
            "sliding_attention", "full_attention", "sliding_attention")), (1e-6, 1e-5, 1e-7)
    if name == "tiny":
        return model_shape("tiny"), (1e-6, 1e-5, 1e-7)
    return GenericConfig.from_hf(generic_config(name, **SHAPE).to_dict()), (1e-5, 1e-4, 1e-6)


@pytest.mark.parametrize("name", ["tiny", "tiny-sliding", "gemma3", "llama4"])
def test_a_packed_row_trains_as_its_documents_apart(name):
    """A packed row's loss and gradients are its documents' apart, for a model of either kind (its kind's module)."""
    cfg, (loss_rtol, grad_rtol, grad_atol) = _packed_case(name)
    gen = torch.Generator().manual_seed(0)
    docs = [Example(ids, [True] * len(ids)) for ids in
            (torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (7, 9, 3))]
    x, y, seg = Rows(docs, seq=24, vocab_size=cfg.vocab_size, shuffle=False, seed=0).batch(0, 1)
    xu, yu, seg_u = Rows(docs, seq=24, vocab_size=cfg.vocab_size, shuffle=False, seed=0, pack=False).batch(0, 3)
    assert seg is not None and seg_u is None and x.shape == (1, 24)
    assert int((y != IGNORE_INDEX).sum()) == int((yu != IGNORE_INDEX).sum()) == 6 + 8 + 2
    model = kind_of(cfg).build_module(cfg, False, 0)
    init_module(model, 0)
    packed = model(x, y, 16, seg)
    packed.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    apart = model(xu, yu, 16)
    apart.backward()
    torch.testing.assert_close(packed, apart, rtol=loss_rtol, atol=0)
    for g, p in zip(grads, model.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=grad_rtol, atol=grad_atol)


@pytest.mark.parametrize("system, pack, kind", [
    ("megatrain", True, "llama"), ("megatrain", False, "llama"), ("megatrain", True, "qwen3-yarn-sliding"),
    ("megatrain", True, "gemma3"), ("fsdp", True, "llama"),
    pytest.param("deepspeed", True, "llama", marks=needs_deepspeed)])
def test_each_system_matches_native_on_documents_of_varied_length(tmp_path, system, pack, kind):
    """Of either kind: a hand-written family's checkpoint (families.KINDS), else transformers' own modules (gemma3)."""
    init = (hf_model if kind in KINDS else generic_model)(kind, tmp_path / "init")
    data = pretokenized(tmp_path / "docs.jsonl", rows=30, varied=True)
    extra = [] if pack else ["--no-pack"]
    assert run_train(init, data, tmp_path / "native", system="native", steps=6, extra=extra) == 0
    assert train_any(system, init, data, tmp_path / "ours", steps=6, extra=extra) == 0
    ours, ref = metrics(tmp_path / "ours"), metrics(tmp_path / "native")
    torch.testing.assert_close(torch.tensor([m["loss"] for m in ours]), torch.tensor([m["loss"] for m in ref]),
                               rtol=1e-5, atol=0)
    assert (sum(m["target_tokens"] for m in ours) > 6 * BATCH * SEQ * 0.6) == pack, "packing fills the rows"


def test_the_guides_toml_example_is_a_valid_train_config(tmp_path):
    readme = (Path(__file__).resolve().parents[2] / "docs" / "GUIDE.md").read_text()
    (tmp_path / "sft.toml").write_text(readme.split("```toml\n", 1)[1].split("```", 1)[0])
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    cfg = config_from_args(parser.parse_args(["--config", str(tmp_path / "sft.toml")]))
    assert (cfg.system, cfg.steps, cfg.save_every, cfg.option) == ("megatrain", 1000, 200, {"resident_layers": "auto"})
    CaseConfig(system=cfg.system, model="tiny", options=cfg.option)  # the options are the system's, typed
