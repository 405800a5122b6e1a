"""The Python API: Trainer reproduces `python -m megatrain train` bit for bit and returns what the run left; Engine,
driven by a loop of its own, trains as train does, saves and loads bit for bit and exports a checkpoint transformers
loads; scripts/api_example.py runs. CPU, seconds (the example ~30 s, in the subprocess session):
pytest tests/unit/test_api.py"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from train_helpers import (  # noqa: E402
    BATCH,
    BETAS,
    CLIP,
    EPS,
    LR,
    MIN_LR,
    SEQ,
    SHAPE,
    VOCAB,
    WARMUP,
    WD,
    chat_tokenizer,
    hf_model,
    metrics,
    pretokenized,
    train_args,
)

import megatrain  # noqa: E402
from megatrain.cli import main  # noqa: E402
from megatrain.train.lr import lr_at  # noqa: E402

STEPS = 4


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("case")
    return hf_model("llama", root / "init"), pretokenized(root / "data.jsonl", rows=12)


def test_trainer_reproduces_the_cli_bit_for_bit_and_returns_the_run(tmp_path, case):
    init, data = case
    held_out = ["--eval-data", str(data), "--eval-every", "2"]
    assert main(train_args(init, data, tmp_path / "cli", steps=STEPS, extra=held_out)) == 0
    result = megatrain.Trainer(
        init_from=Path(init), data=data, shuffle=False, seq=SEQ, batch=BATCH, micro_batch=2, steps=STEPS, lr=LR,
        lr_schedule="cosine", warmup_steps=WARMUP, min_lr=MIN_LR, weight_decay=WD, adam_betas=BETAS, adam_eps=EPS,
        max_grad_norm=CLIP, out=tmp_path / "api", dtype="float32", device="cpu", eval_data=str(data), eval_every=2,
    ).train()
    cli = metrics(tmp_path / "cli")
    assert result.losses == [m["loss"] for m in cli if "loss" in m] == [m["loss"] for m in metrics(tmp_path / "api")
                                                                          if "loss" in m]
    assert result.eval_losses == {m["step"]: m["eval_loss"] for m in cli if "eval_loss" in m} and \
        list(result.eval_losses) == [2, 4]
    assert (result.exit_code, result.step) == (0, STEPS)
    assert result.checkpoint == tmp_path / "api" / "checkpoints" / f"step-{STEPS}"
    assert result.export == tmp_path / "api" / "hf" and (result.export / "config.json").exists()
    assert result.run_id == json.loads((tmp_path / "api" / "run.json").read_text())["run_id"]


def test_trainer_refuses_a_wrong_setting_before_anything_is_read(tmp_path):
    with pytest.raises(ValueError, match="--lr must be a finite number > 0"):
        megatrain.Trainer(model="tiny", data="x.jsonl", steps=1, lr=0.0, out=tmp_path / "run")
    with pytest.raises(ValueError, match="bad train setting:.*'lerning_rate'"):
        megatrain.Trainer(model="tiny", data="x.jsonl", steps=1, lerning_rate=1e-3)
    assert not (tmp_path / "run").exists()


def _engine_batches(data):
    """train's batches of rows (seq + 1 tokens each), in file order and round again."""
    rows = torch.tensor([json.loads(line)["input_ids"] for line in data.read_text().splitlines()])
    return [rows[[(i * BATCH + j) % len(rows) for j in range(BATCH)]] for i in range(STEPS)]


def seed_oss_model(path):
    """A tiny random Seed-OSS saved in `path`: a family only transformers' own modules train (the generic path), its
    dropout off (train and the engine alike leave it out today: issue 62)."""
    torch.manual_seed(0)
    config = transformers.SeedOssConfig(**SHAPE, head_dim=16, attention_dropout=0.0, residual_dropout=0.0)
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(path)
    return path


@pytest.mark.parametrize("kind", ["llama", "seed_oss"])
def test_an_engine_loop_trains_and_exports_as_train_does(tmp_path, kind):
    """A hand-written family and a generic one, each with its tokenizer and generation config: the Engine takes train
    --init-from's road (megatrain.models.checkpoint), so it trains the same model to the same losses (rows of seq + 1
    tokens: the engine's seq is seq + 1, its last position predicting nothing; other shapes, other kernels: to float
    rounding) and exports the same files: the source's config.json, its tokenizer files and generation config, the
    weights."""
    init = hf_model("llama", tmp_path / "init") if kind == "llama" else seed_oss_model(tmp_path / "init")
    chat_tokenizer(init)
    data = pretokenized(tmp_path / "data.jsonl", rows=12)
    constant = ["--lr-schedule", "constant", "--warmup-steps", "0"]
    assert main(train_args(init, data, tmp_path / "cli", steps=STEPS, extra=constant)) == 0
    with megatrain.Engine(init, seq=SEQ + 1, batch=BATCH, micro_batch=2, lr=LR, weight_decay=WD,
                          max_grad_norm=CLIP, adam_betas=BETAS, adam_eps=EPS, dtype="float32",
                          device="cpu") as engine:
        losses = [engine.step(rows) for rows in _engine_batches(data)]
        engine.export(tmp_path / "engine-hf")
    ref = [m["loss"] for m in metrics(tmp_path / "cli")]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=0)
    ours, trained = tmp_path / "engine-hf", tmp_path / "cli" / "hf"
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in trained.iterdir())
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= {p.name for p in ours.iterdir()}
    assert json.loads((ours / "config.json").read_text()) == json.loads((trained / "config.json").read_text())
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (ours / name).read_bytes() == (trained / name).read_bytes(), name
    exported = transformers.AutoModelForCausalLM.from_pretrained(ours)
    reference = transformers.AutoModelForCausalLM.from_pretrained(trained)
    for (name, p), q in zip(exported.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)


def test_train_is_an_engine_loop_to_the_bit(tmp_path):
    """train drives the Engine a program opens (one build: the model, the system, --init-from, the export): the same
    run made by train and by a loop of ours over megatrain.Engine (the seed, the rows, the schedule through set_lr,
    AdamW) has every step's loss exactly and the export byte for byte, its megatrain_export.json aside (it names who
    exported). Rows of SEQ tokens, one a row: train's last position of a row is then padding, as the Engine's is."""
    init = hf_model("llama", tmp_path / "init")
    chat_tokenizer(init)
    ids = torch.randint(0, VOCAB, (12, SEQ), generator=torch.Generator().manual_seed(5))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"input_ids": row}) + "\n" for row in ids.tolist()))
    adamw = dict(lr=LR, weight_decay=WD, adam_betas=BETAS, adam_eps=EPS, max_grad_norm=CLIP)
    run = dict(seq=SEQ, batch=BATCH, micro_batch=2, dtype="float32", device="cpu", **adamw)
    trained = megatrain.Trainer(init_from=init, data=data, shuffle=False, steps=STEPS, lr_schedule="cosine",
                                warmup_steps=WARMUP, min_lr=MIN_LR, out=tmp_path / "train", **run).train(log=_quiet)
    losses = []
    with megatrain.Engine(init, **run, log=_quiet) as engine:
        for step in range(STEPS):
            engine.set_lr(lr_at(step, STEPS, LR, "cosine", WARMUP, MIN_LR))
            losses.append(engine.step(ids[[(step * BATCH + row) % len(ids) for row in range(BATCH)]]))
        ours = engine.export(tmp_path / "engine-hf")
    assert trained.exit_code == 0 and losses == trained.losses
    files = sorted(p.relative_to(ours) for p in ours.rglob("*") if p.name != "megatrain_export.json")
    assert files == sorted(p.relative_to(trained.export) for p in trained.export.rglob("*")
                           if p.name != "megatrain_export.json")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {str(p) for p in files}
    for name in files:
        assert (ours / name).read_bytes() == (trained.export / name).read_bytes(), name


def _quiet(line: str) -> None:
    """A log that keeps nothing."""


@pytest.mark.parametrize("model", ["tiny", "tiny-hf-seed-oss"])  # the second with dropout: its draws go on too
def test_an_engine_saved_and_loaded_steps_on_bit_for_bit_and_pads_short_batches(tmp_path, model):
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 256, (3, 7), generator=gen) for _ in range(4)]  # fewer rows and tokens than 4 x 8
    settings = dict(seq=8, batch=4, lr=1e-3, device="cpu", dtype="float32")
    with megatrain.Engine(model, **settings) as engine:
        straight = [engine.step(b) for b in batches[:2]]
        engine.save(tmp_path / "state")
        straight += [engine.step(b) for b in batches[2:]]
    with megatrain.Engine(model, **settings) as engine:  # a fresh engine, of the same seed's initial weights
        engine.load(tmp_path / "state")
        cut = straight[:2] + [engine.step(b) for b in batches[2:]]
        labels = batches[0].clone()
        labels[:, :4] = -100
        assert engine.evaluate(batches[0], labels) != engine.evaluate(batches[0])  # labels mask as in transformers
        with pytest.raises(ValueError, match="larger than the engine's batch x seq, 4 x 8"):
            engine.step(torch.zeros(5, 8, dtype=torch.long))
        with pytest.raises(ValueError, match="the batch has no target"):
            engine.step(torch.zeros(0, 8, dtype=torch.long))
    assert cut == straight


@pytest.mark.parametrize("settings, says", [
    *[({"lr": lr}, "--lr must be a finite number > 0, got ") for lr in (float("nan"), float("inf"), -1e-3, 0.0)],
    ({"lr": "1e-3"}, "train setting lr='1e-3': expected a number"),
    ({"batch": "2"}, "train setting batch='2': expected an integer"),
    ({"seq": 8.5}, "train setting seq=8.5: expected an integer"),
    ({"seed": -1}, "--seed must be in [0, 2**32), got -1"),
    ({"adam_betas": (0.9,)}, "train setting adam_betas=(0.9,): expected a list of 2"),
    ({"system": "paper"}, "--system paper is a benchmark peer"),
    ({"device": "cuda"}, "--device cuda: torch sees no CUDA device"),
    ({"model": None}, "Engine's model is a Hugging Face checkpoint directory or a registry name, got None"),
    ({"model": "/no/such/checkpoint"}, "/no/such/checkpoint: no such directory"),  # not 'unknown model'
    ({"model": Path("typo")}, "typo: no such directory"),
    ({"model": "tiny", "generic": True}, "--generic trains an --init-from checkpoint through transformers' own"),
])
def test_an_engine_refuses_a_setting_as_train_does(settings, says):
    if settings.get("device") == "cuda" and torch.cuda.is_available():
        pytest.skip("CUDA is here")
    with pytest.raises(ValueError, match=f"^{re.escape(says)}"):
        megatrain.Engine(**{"model": "tiny", "seq": 8, "batch": 2, **settings})


def test_an_engine_and_a_trainer_say_every_line_through_log(tmp_path, case, capfd):
    """log= takes what they say, the build's lines (and the host AdamW kernel's) included: those went to stderr
    whatever log was; the Engine's generic=True is train's --generic."""
    from megatrain.models.generic import GenericConfig

    init, data = case
    engine_said, trainer_said = [], []
    with megatrain.Engine(init, seq=8, batch=2, generic=True, log=engine_said.append) as engine:
        assert isinstance(engine.checkpoint.shape, GenericConfig)  # transformers' own modules, not our Llama
        engine.step(torch.randint(0, SHAPE["vocab_size"], (2, 8)))
    result = megatrain.Trainer(init_from=init, data=data, steps=1, seq=SEQ, batch=BATCH, out=tmp_path / "run",
                               dtype="float32").train(log=trainer_said.append)
    assert "megatrain build:" not in "".join(capfd.readouterr())
    for said in (engine_said, trainer_said):
        assert any(line.startswith("megatrain build: optimizer") for line in said), said
    assert (result.out / "train.log").read_text().splitlines() == trainer_said


def test_an_engine_refuses_what_it_cannot_train_on_naming_what_to_change(tmp_path):
    vocab = 256
    ids = torch.randint(0, vocab, (2, 8))
    with megatrain.Engine("tiny", seq=8, batch=2, lr=1e-3) as engine:
        for lr in (float("nan"), float("inf"), -1e-3):
            with pytest.raises(ValueError, match=r"^lr must be a finite number >= 0, got "):
                engine.set_lr(lr)
        engine.set_lr(0.0)  # a schedule's end
        for step in (engine.step, engine.evaluate):
            for bad, says in ((ids.tolist(), "input_ids must be a 2-D torch.Tensor .*, got a list"),
                              (ids.float(), "got a 2-D tensor of float32"), (ids[0], "got a 1-D tensor"),
                              (torch.full((2, 8), vocab), f"input_ids holds {vocab}, which is not a token id of the "
                                                          f"model's vocabulary \\(0 to {vocab - 1}\\)"),
                              (ids - vocab, "input_ids holds -")):
                with pytest.raises(ValueError, match=says):
                    step(bad)
            with pytest.raises(ValueError, match="labels holds 300, which is not -100 \\(no loss\\) or a token id"):
                step(ids, torch.full((2, 8), 300))
            with pytest.raises(ValueError, match="the batch has no target: .* fewer than two tokens"):
                step(ids[:, :0])
        engine.evaluate(torch.full((2, 8), vocab - 1, dtype=torch.uint8))  # in the vocabulary, however typed
        (tmp_path / "file").write_text("")
        for where in (tmp_path / "file" / "state", Path("/proc/megatrain-state")):
            for write, name in ((engine.save, "save"), (engine.export, "export")):
                with pytest.raises(ValueError, match=f"Engine.{name}\\(.*\\): cannot write there \\((Not a "
                                                     "directory|No such file or directory)\\); nothing was replaced"):
                    write(where)
        (tmp_path / "project").mkdir()
        (tmp_path / "project" / "code.py").write_text("mine")
        for mine in (tmp_path / "project", tmp_path / "file"):  # what saving there would delete
            with pytest.raises(ValueError, match="Engine.save did not write it, and saving there would delete it"):
                engine.save(mine)
        with pytest.raises(ValueError, match="is a file, which the export would replace: choose a folder"):
            engine.export(tmp_path / "file")
        assert (tmp_path / "project" / "code.py").read_text() == "mine" and (tmp_path / "file").is_file()
        engine.save(tmp_path / "state")
        engine.save(tmp_path / "state")  # its own save, replaced
    engine.close()  # again: nothing
    with pytest.raises(ValueError, match="the engine is closed"):
        engine.step(ids)


@pytest.mark.subprocess
def test_the_api_example_runs(tmp_path):
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(root / "scripts" / "api_example.py"), str(tmp_path / "example")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout.splitlines()
    assert any(line.startswith("Trainer: 8 steps") for line in said)  # after the run's own lines
    assert said[-1].startswith("Engine: Hugging Face checkpoint")
    assert sum(line.startswith("Engine step") for line in said) == 8
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "example" / "engine-hf")


def test_an_engine_loads_no_changed_state_and_no_pickle_another_user_saved(tmp_path, monkeypatch):
    from dataclasses import replace

    from megatrain import systems
    from megatrain.train.engine import STATE_FILE

    # the engine's own state holds no pickle; here it stands for one that does (DeepSpeed's, FSDP's)
    spec = replace(systems.system_spec("megatrain"), pickled=("**/*.bin",))
    monkeypatch.setattr("megatrain.train.engine.system_spec", lambda name: spec)
    settings = dict(seq=8, batch=4, lr=1e-3, device="cpu", dtype="float32")
    with megatrain.Engine("tiny", **settings) as engine:
        engine.save(tmp_path / "state")
        assert list((tmp_path / "state").rglob("*.bin")), "a file the stand-in pattern names"
    with megatrain.Engine("tiny", **settings) as engine:
        engine.load(tmp_path / "state")  # this user's, unchanged
        monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "another-user"))
        with pytest.raises(ValueError, match="not written by this user .* pass --trust-checkpoint"):
            engine.load(tmp_path / "state")
        engine.load(tmp_path / "state", trust_checkpoint=True)
        victim = next(p for p in (tmp_path / "state").rglob("*") if p.is_file() and p.name != STATE_FILE)
        damaged = bytearray(victim.read_bytes())
        damaged[0] ^= 0xFF
        victim.write_bytes(bytes(damaged))
        with pytest.raises(ValueError, match="does not match its checksum: the state in .* was changed"):
            engine.load(tmp_path / "state", trust_checkpoint=True)
        for files in ([], {"../x": {"bytes": 1, "sha256": []}}, {"x": {"bytes": "1", "sha256": []}}):
            (tmp_path / "state" / STATE_FILE).write_text(json.dumps({"files": files}))
            with pytest.raises(ValueError, match="engine_state.json: files must be an object of"):
                engine.load(tmp_path / "state", trust_checkpoint=True)


def test_an_engine_refuses_the_state_another_system_saved_naming_it(tmp_path):
    settings = dict(seq=8, batch=4, lr=1e-3, device="cpu", dtype="float32")
    for saver, loader, lacks in (("native", "megatrain", "no state.json"), ("megatrain", "native",
                                                                            "no native_state.pt")):
        with megatrain.Engine("tiny", system=saver, **settings) as engine:
            engine.save(tmp_path / saver)
        with megatrain.Engine("tiny", system=loader, **settings) as engine, \
                pytest.raises(ValueError, match=f"^{tmp_path / saver} holds no {loader} state \\({lacks}; it holds "
                                                f".*another system saved it; load it into an Engine of that system"):
            engine.load(tmp_path / saver)
