"""`python -m megatrain train` refuses each mistake in its input with exit 2 and one line saying what to change, before
anything is built. CPU, seconds: pytest tests/unit/test_train_input.py"""

import argparse
import dataclasses
import json
import re
import shutil
import sys

import pytest
import torch

import megatrain.train.config as train_config
from megatrain.cli import main
from megatrain.engine.state import read_tiles
from megatrain.train.config import TrainConfig
from megatrain.train.data import Example, Rows, read_examples


def refused(capsys, argv) -> str:
    """The one line `train` answers argv with, after checking the exit code 2."""
    assert main(["train", *argv]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"input_ids": list(range(i, i + 9))}) + "\n" for i in range(4)))
    return path


def tiny(data, tmp_path, *extra) -> list[str]:
    """A from-scratch run of the tiny shape on `data`, with extra flags (--steps 1 unless --epochs is given)."""
    length = [] if "--epochs" in extra else ["--steps", "1"]
    return ["--model", "tiny", "--data", str(data), "--seq", "8", "--batch", "4", *length, "--out",
            str(tmp_path / "run"), *extra]


@pytest.mark.parametrize("flags, says", [
    (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    (["--lr", "inf"], "--lr must be a finite number > 0"),
    (["--lr", "0"], "--lr must be a finite number > 0"),
    (["--lr", "-1"], "--lr must be a finite number > 0"),
    (["--adam-eps", "0"], "--adam-eps must be a finite number > 0"),
    (["--adam-eps", "-1"], "--adam-eps must be"),
    (["--adam-eps", "nan"], "--adam-eps must be"),
    (["--weight-decay", "nan"], "--weight-decay must be a finite number >= 0"),
    (["--weight-decay", "-5"], "--weight-decay must be"),
    (["--min-lr", "1"], "--min-lr must be a number from 0 to --lr (1e-05), got 1.0"),
    (["--min-lr", "-1"], "--min-lr must be"),
    (["--min-lr", "nan"], "--min-lr must be"),
    (["--adam-betas", "1", "0.9"], "--adam-betas must be two numbers in [0, 1), got 1.0 0.9"),
    (["--adam-betas", "0.9", "nan"], "--adam-betas must be"),
    (["--max-grad-norm", "nan"], "--max-grad-norm must be a finite number >= 0"),
    (["--max-grad-norm", "inf"], "--max-grad-norm must be"),
    (["--max-grad-norm", "-1"], "--max-grad-norm must be"),
    (["--epochs", "inf"], "--epochs must be a finite number > 0, got inf"),
    (["--epochs", "nan"], "--epochs must be"),
    (["--epochs", "0"], "--epochs must be"),
    (["--epochs", "-1"], "--epochs must be"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--steps", "-1"], "--steps must be >= 1"),
    (["--seq", "0"], "--seq must be >= 1"),
    (["--seq", "-1"], "--seq must be >= 1"),
    (["--batch", "0"], "--batch must be >= 1"),
    (["--micro-batch", "3"], "--micro-batch must be a divisor of --batch (4), or 0 for the whole batch, got 3"),
    (["--micro-batch", "-2"], "--micro-batch must be a divisor"),
    (["--warmup-steps", "-1"], "--warmup-steps must be >= 0, got -1"),
    (["--seed", "-1"], "--seed must be in [0, 2**32)"),
    (["--seed", str(2**62)], "--seed must be in [0, 2**32)"),
    (["--save-every", "-1"], "--save-every must be >= 0"),
    (["--keep", "0"], "--keep must be >= 1"),
    (["--log-every", "0"], "--log-every must be >= 1, got 0"),
    (["--eval-data", "x.jsonl", "--eval-every", "-1"], "--eval-every must be >= 0"),
    (["--generic"], "--generic trains an --init-from checkpoint through transformers' own modules; --model tiny is a "
                    "registry shape, which trains as registered: drop --generic"),
    (["--data-split", "train"], "--data-split train names a split of a Hugging Face dataset, and --data names none "
                                "(JSONL and text files have no splits): drop it"),
    (["--eval-split", "test"], "--eval-split test names a split of --eval-data, which is not given"),
])
def test_a_nonsensical_hyperparameter_is_refused_naming_its_flag(tmp_path, capsys, data, flags, says):
    assert says in refused(capsys, tiny(data, tmp_path, *flags))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("line, says", [
    ('lr = "abc"', "train setting lr='abc': expected a number"),
    ("batch = 2.5", "train setting batch=2.5: expected an integer"),
    ("steps = true", "train setting steps=True: expected an integer or null"),
    ("data = 3", "train setting data=3: expected a list, each a string"),
    ("data = [3]", "train setting data=[3]: expected a list, each a string"),
    ("option = 5", "train setting option=5: expected a table"),
    ('pack = "no"', "train setting pack='no': expected true or false"),
    ("adam_betas = [0.9]", "train setting adam_betas=[0.9]: expected a list of 2, each a number"),
    ("data = " + "[" * 100_000 + "]" * 100_000, "run.toml: maximum recursion depth exceeded"),
])
def test_a_config_file_value_of_the_wrong_type_is_refused_naming_key_type_and_value(tmp_path, capsys, data, line,
                                                                                   says):
    key, value = line.split(" = ")
    settings = {"model": '"tiny"', "data": json.dumps([str(data)]), "steps": "1", "out": json.dumps(str(tmp_path)),
                key: value}
    (tmp_path / "run.toml").write_text("".join(f"{k} = {v}\n" for k, v in settings.items()))
    assert says in refused(capsys, ["--config", str(tmp_path / "run.toml")])


def test_an_init_from_that_is_not_a_checkpoint_is_refused_naming_it(tmp_path, capsys, data):
    def init_from(path):
        return refused(capsys, ["--init-from", str(path), "--data", str(data), "--steps", "1"])

    assert init_from(tmp_path / "nowhere").endswith(f"--init-from {tmp_path / 'nowhere'}: no such directory")
    (tmp_path / "ckpt").mkdir()
    assert f"--init-from {tmp_path / 'ckpt'} has no config.json" in init_from(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "config.json").write_text("{not json")
    assert f"{tmp_path / 'ckpt' / 'config.json'} is not valid JSON" in init_from(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 8}))
    assert "config.json lacks hidden_size, intermediate_size" in init_from(tmp_path / "ckpt")
    config = {"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
              "num_hidden_layers": 1, "num_attention_heads": 1}
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    assert "neither model.safetensors nor model.safetensors.index.json" in init_from(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "model.safetensors").mkdir()
    assert init_from(tmp_path / "ckpt").endswith("model.safetensors is not a file (a folder, a FIFO): the weights "
                                                 "are a safetensors file")
    (tmp_path / "ckpt" / "model.safetensors").rmdir()
    (tmp_path / "ckpt" / "model.safetensors.index.json").mkdir()
    assert "model.safetensors.index.json cannot be read (Is a directory)" in init_from(tmp_path / "ckpt")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """A tiny Mixtral, its experts stored one per tensor as Mixtral publishes them (transformers stacks them)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                        num_experts_per_tok=2)
    path = tmp_path_factory.mktemp("mixtral")
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).save_pretrained(path)
    return path


EXPERT = "model.layers.1.block_sparse_moe.experts.{}.w2.weight"


@pytest.mark.parametrize("edit, says", [
    (lambda t: t.pop(EXPERT.format(3)), f"the checkpoint lacks tensor {EXPERT.format(3)}, which the other experts "
                                        "under it have"),
    (lambda t: t.update({EXPERT.format(3): torch.zeros(32, 63)}), f"model.safetensors: {EXPERT.format(3)} has shape "
                                                                  "(32, 63), the other experts' w2.weight (32, 64)"),
    (lambda t: t.update({EXPERT.format(4): torch.zeros(32, 64)}), "the checkpoint stores experts 0-4 under "
                                                                  "model.layers.1.block_sparse_moe.experts.N, and the "
                                                                  "config's layers have 4 experts (0 to 3)"),
    ({"num_experts_per_tok": 5}, "config.json num_experts_per_tok=5 must be from 1 to the experts a layer has (4): "
                                 "the experts each token is routed to"),
    ({"num_experts_per_tok": 0}, "config.json num_experts_per_tok=0 must be from 1 to the experts a layer has (4)"),
])
def test_a_mixtral_checkpoint_of_a_wrong_expert_is_refused_before_anything_is_built(tmp_path, capsys, data, mixtral,
                                                                                    edit, says):
    from safetensors.torch import load_file, save_file

    ckpt = tmp_path / "ckpt"
    shutil.copytree(mixtral, ckpt)
    if isinstance(edit, dict):
        (ckpt / "config.json").write_text(json.dumps({**json.loads((ckpt / "config.json").read_text()), **edit}))
    else:
        tensors = load_file(ckpt / "model.safetensors")
        edit(tensors)
        save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    line = refused(capsys, ["--init-from", str(ckpt), "--data", str(data), "--steps", "1", "--seq", "8", "--batch",
                            "2", "--out", str(tmp_path / "run")])
    assert line.startswith(f"error: --init-from {ckpt}: {says}")
    assert not (tmp_path / "run").exists()


def test_experts_that_transformers_cannot_convert_are_one_line(tmp_path, capsys, data, mixtral):
    """Every expert's w3 of another width than its w1: each name's shapes agree, which the headers show, but the two
    cannot be fused into gate_up_proj; transformers' conversion fails as the weights load."""
    from safetensors.torch import load_file, save_file

    ckpt = tmp_path / "ckpt"
    shutil.copytree(mixtral, ckpt)
    tensors = load_file(ckpt / "model.safetensors")
    tensors.update({f"model.layers.1.block_sparse_moe.experts.{e}.w3.weight": torch.zeros(64, 31) for e in range(4)})
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    from train_helpers import one_error

    assert main(["train", "--init-from", str(ckpt), "--data", str(data), "--steps", "1", "--seq", "8", "--batch", "2",
                 "--out", str(tmp_path / "run")]) == 2
    assert one_error(capsys).startswith(f"error: {ckpt}: transformers cannot load the checkpoint's tensors into its "
                                        "model (")


def test_a_checkpoints_own_code_is_not_run_said_and_left_out_of_the_export(tmp_path, capsys):
    from train_helpers import hf_model, pretokenized

    init = hf_model("qwen2", tmp_path / "init")
    config = json.loads((init / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_mine.MineForCausalLM"}  # no such file: never run
    (init / "config.json").write_text(json.dumps(config))
    assert main(["train", "--init-from", str(init), "--data", str(pretokenized(tmp_path / "data.jsonl", rows=4)),
                 "--seq", "16", "--batch", "2", "--steps", "1", "--out", str(tmp_path / "run")]) == 0
    assert f"note: {init / 'config.json'} names code of its own (auto_map), which megatrain never runs: it trains " \
           "as transformers' own 'qwen2' model" in capsys.readouterr().err
    exported = json.loads((tmp_path / "run" / "hf" / "config.json").read_text())
    assert "auto_map" not in exported and exported["model_type"] == "qwen2"


def test_device_cuda_without_cuda_is_refused(tmp_path, capsys, data, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "--device cuda: torch sees no CUDA device" in refused(capsys, tiny(data, tmp_path, "--device", "cuda"))


@pytest.fixture
def started(tmp_path, data, monkeypatch):
    """A run directory whose latest checkpoint was started with --model tiny --data DATA --steps 4 (its settings as
    a checkpoint's meta keeps them)."""
    saved = json.loads(json.dumps(dataclasses.asdict(TrainConfig(model="tiny", data=[str(data)], steps=4,
                                                                 out=str(tmp_path / "run")))))
    monkeypatch.setattr(train_config, "resumed_config", lambda run_dir, fallback=False: dict(saved))
    return tmp_path / "run"


def test_resume_refuses_a_change_to_the_runs_data_or_model_naming_each_change(tmp_path, capsys, started):
    line = refused(capsys, ["--resume", str(started), "--batch", "16", "--no-pack", "--system", "native"])
    assert f"--resume {started}: system 'megatrain' -> 'native', pack True -> False, batch 8 -> 16: " in line
    for flags in (["--seq", "64"], ["--seed", "1"], ["--no-shuffle"], ["--data", "other.jsonl"], ["--train-on-prompt"],
                  ["--tokenizer", "tok"], ["--init-from", "ckpt"], ["--model", "small"], ["--dtype", "bfloat16"],
                  ["--precision", "bf16"]):
        assert "a resumed run keeps the settings of its data, model and saved state" in refused(
            capsys, ["--resume", str(started), *flags]), flags


def test_resume_takes_a_new_length_schedule_or_micro_batch_and_a_config_files_resume_key(tmp_path, started):
    from megatrain.train.config import add_train_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    cfg = config_from_args(parser.parse_args(["--resume", str(started), "--epochs", "2", "--lr", "1e-4",
                                              "--micro-batch", "2", "--save-every", "1"]))
    assert (cfg.model, cfg.steps, cfg.epochs, cfg.lr, cfg.micro_batch, cfg.out) == ("tiny", None, 2, 1e-4, 2,
                                                                                     str(started))
    (tmp_path / "resume.toml").write_text(f'resume = "{started}"\nsteps = 8\n')
    cfg = config_from_args(parser.parse_args(["--config", str(tmp_path / "resume.toml")]))
    assert (cfg.model, cfg.steps, cfg.out) == ("tiny", 8, str(started))


def test_a_checkpoint_of_another_shape_is_refused_in_one_short_line(tmp_path):
    tiles = {"weights": torch.zeros(6, dtype=torch.bfloat16), "master": torch.zeros(6), "exp_avg": torch.zeros(6)}
    saved = [{"name": "weights", "dtype": "float32", "numel": 6}, {"name": "exp_avg", "dtype": "float32", "numel": 6}]
    with pytest.raises(ValueError) as refusal:
        read_tiles(tmp_path / "tiles.bin", tiles, saved)
    assert str(refusal.value) == (f"{tmp_path} holds another model, dtype or precision than this engine: 3 of 3 tiles "
                                  "differ, the first saved as weights (float32 x 6), here weights (bfloat16 x 6)")


def test_schedule_notes_say_a_warmup_as_long_as_the_run_and_a_decay_restretched_on_resume():
    from megatrain.train.lr import schedule_notes

    cfg = TrainConfig(model="tiny", data=["x"], steps=10, lr=1e-3, warmup_steps=20)
    (warmup,) = schedule_notes(cfg, 10)
    assert "--warmup-steps 20 is not shorter than the run's 10 steps" in warmup and "to 0.0005 at the last" in warmup
    cfg = dataclasses.replace(cfg, warmup_steps=2)
    assert schedule_notes(cfg, 10) == [] and schedule_notes(cfg, 10, resumed_total_steps=10) == []
    (stretched,) = schedule_notes(cfg, 20, resumed_total_steps=10)
    assert "the run's length changes from 10 to 20 steps: the cosine decay" in stretched
    assert schedule_notes(dataclasses.replace(cfg, lr_schedule="constant"), 20, resumed_total_steps=10) == []


@pytest.mark.parametrize("line, says", [
    ('{"input_ids": [1, -2, 3]}', "input_ids must be a non-empty list of token ids (integers >= 0); -2 is not"),
    ('{"input_ids": [1, [2], 3]}', "[2] is not"),
    ('{"input_ids": [1, null, 3]}', "null is not"),
    ('{"input_ids": [1, 2.5]}', "2.5 is not"),
    ('{"input_ids": [1, "2"]}', '"2" is not'),
    ('{"input_ids": "123"}', '"123" is not'),
    ('{"input_ids": []}', "[] is not"),
    ('{"input_ids": [1, 256]}', "token id 256 is outside the model's vocabulary of 256"),
    ('"a string with text in it"', 'a line must be a JSON object such as {"text": ...}, got "a string'),
    ("5", "a line must be a JSON object"),
    ("{oops", "not a JSON record"),
    ('{"text": "a\\ud800b"}', "text holds a lone surrogate, '\\ud800' at character 1, half of a UTF-16 pair"),
    ('{"input_ids": ' + "[" * 200_000 + "]" * 200_000 + "}", "a JSON record nested too deep to read"),
    ('{"input_ids": ' + "[" * 900 + "]" * 900 + "}", "[[[[[[[[[[[[[[[["),  # as deep as Python reads: read, refused
    ('{"text": null}', "text must be a string, got null"),
    ('{"instruction": "a"}', "output must be a string, got null"),
    ('{"messages": "hi"}', "messages must be a list of {role, content} objects"),
    ('{"messages": [{"role": "user", "content": 5}]}', "content must be a string, got 5"),
    ('{"conversations": [{"from": "alien", "value": "x"}]}', "unknown role 'alien'"),
    ('{"text": "w", "url": "x"}', "holds 'url', which megatrain does not read (the keys of text lines: text): drop it, "
                                  "or --ignore-column url to train without it"),
    ('{"input_ids": [1, 2], "position_ids": [0, 1]}', "holds 'position_ids', which megatrain does not read (the keys "
                                                      "of pre-tokenized lines: input_ids, labels, attention_mask)"),
    ('{"instruction": "a", "output": "b", "history": []}', "holds 'history', which megatrain does not read (the keys "
                                                           "of alpaca lines: instruction, input, output, system)"),
    ('{"text": "w", "messages": []}', "holds text and messages, the keys of two formats (text and chat): one line is "
                                      "one example; --ignore-column messages trains its text alone"),
    ('{"messages": [{"role": "user", "content": "w", "weight": 0}]}', "a turn of messages holds 'weight', which "
                                                                       "megatrain does not read (a turn is role and "
                                                                       "content)"),
    ('{"input_ids": [1, 2, 3], "labels": [-100, 5, 3]}', "labels[1] is 5, neither input_ids[1] (2) nor -100: labels "
                                                         "only say which tokens are trained"),
    ('{"input_ids": [1, 2, 3], "labels": [1, 2]}', "labels must be a list of 3 integers, one per input_ids token"),
    ('{"input_ids": [1, 2, 3], "attention_mask": [1, 0, 1]}', "attention_mask holds 0s between 1s, at 1: its 0s are "
                                                              "read as padding, at the line's start or end"),
    ('{"input_ids": [1, 2, 3], "attention_mask": [1, 2, 1]}', "attention_mask must hold 1s (tokens) and 0s "
                                                              "(padding), got 2"),
])
def test_a_bad_data_line_is_refused_naming_flag_file_and_line(tmp_path, capsys, line, says):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"input_ids": [1, 2, 3]}\n\n' + line + "\n")
    line = refused(capsys, tiny(path, tmp_path))
    assert line.startswith(f"error: --data {path}:3: ") and says in line


def test_labels_and_attention_mask_train_the_tokens_transformers_would(tmp_path):
    """A -100 label is no target; an attention mask's 0s are padding, neither attended to nor trained: a right-padded
    line trains the (position, target) pairs transformers' causal LM takes from the same columns (labels shifted
    inside, padding labelled -100 as its collators label it), a left-padded one as its unpadded tokens."""
    ids = list(range(10, 19))
    lines = [{"input_ids": ids, "labels": [-100, 11, -100, -100, *ids[4:]]},
             {"input_ids": ids, "attention_mask": [1] * 6 + [0] * 3},
             {"input_ids": ids, "labels": [*ids[:7], -100, -100], "attention_mask": [0, 0, *[1] * 7]}]
    data = tmp_path / "columns.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    _, labels, _ = Rows(read_examples([data], None, False), seq=8, vocab_size=32, shuffle=False, seed=0,
                        pack=False).batch(0, 3)

    def transformers_targets(line):  # position t predicts labels[t + 1], where the mask keeps token t + 1
        label = line.get("labels", line["input_ids"])
        mask = line.get("attention_mask", [1] * len(label))
        return [label[t + 1] if mask[t + 1] else -100 for t in range(8)]

    assert labels[0].tolist() == transformers_targets(lines[0]) == [11, -100, -100, 14, 15, 16, 17, 18]
    assert labels[1].tolist() == transformers_targets(lines[1])
    assert labels[2].tolist() == [13, 14, 15, 16, -100, -100, -100, -100]  # ids[2:7]: unpadded, its first no target


def test_a_system_key_is_the_conversations_first_turn(tmp_path, capsys):
    pytest.importorskip("transformers")
    from train_helpers import chat_tokenizer

    tok = chat_tokenizer(tmp_path / "tok")
    data = tmp_path / "chat.jsonl"
    turns = [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}]
    data.write_text(json.dumps({"instruction": "w1", "output": "w2", "system": "w3"}) + "\n"
                    + json.dumps({"messages": turns, "system": "w3"}) + "\n"
                    + json.dumps({"conversations": [{"from": "human", "value": "w1"}, {"from": "gpt", "value": "w2"}],
                                  "system": "w3"}) + "\n")
    alpaca, chat, sharegpt = read_examples([data], tok, train_on_prompt=False)
    (with_system,) = read_examples([_lines(tmp_path, [{"messages": [{"role": "system", "content": "w3"}, *turns]}])],
                                   tok, train_on_prompt=False)
    assert (alpaca.ids, alpaca.target) == (chat.ids, chat.target) == (sharegpt.ids, sharegpt.target) \
        == (with_system.ids, with_system.target)
    assert [tok.token(i) for i in chat.ids][:4] == ["<|im_start|>", "system", "\n", "w3"]
    data.write_text(json.dumps({"messages": [{"role": "system", "content": "w3"}, *turns], "system": "w4"}) + "\n")
    assert refused(capsys, tiny(data, tmp_path, "--tokenizer", str(tmp_path / "tok"))) == \
        f"error: --data {data}:1: a system key and a system turn: give the system prompt once"


def _lines(tmp_path, records, name="lines.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_ignore_column_drops_a_key_from_every_line_and_turn(tmp_path, capsys):
    rows = [{"input_ids": list(range(i, i + 9)), "id": i, "source": "web"} for i in range(4)]
    data = _lines(tmp_path, rows)
    assert "holds 'id', which megatrain does not read" in refused(capsys, tiny(data, tmp_path))
    assert main(["train", *tiny(data, tmp_path, "--ignore-column", "id", "--ignore-column", "source")]) == 0
    (example,) = read_examples([_lines(tmp_path, [{"input_ids": [1, 2, 3], "text": "w1"}])], None, False,
                               ignored=("text",))
    assert example.ids == [1, 2, 3]
    weighted = [{"conversations": [{"from": "human", "value": "w1", "weight": 0}, {"from": "gpt", "value": "w2"}]}]
    for lines, ignored in (([{"text": "w1 w2", "messages": []}], ("messages",)), (weighted, ("weight",))):
        with pytest.raises(ValueError, match="text and chat data need --tokenizer DIR"):  # read as text or chat
            read_examples([_lines(tmp_path, lines)], None, False, ignored=ignored)


@pytest.mark.parametrize("files, says", [
    (["a.jsonl", "README.txt"], "holds both .jsonl files (a.jsonl) and .txt files (README.txt), and a folder trains "
                                "those of one format: name the files to train (--data FILE, repeatable)"),
    (["README.txt", "train.json"], "holds train.json, which it would not train (a folder trains the .txt files "
                                   "directly in it): name each file to train"),
    (["a.jsonl", "c.parquet", "sub/d.jsonl", ".git/e.jsonl"], "holds c.parquet, sub/d.jsonl, which it would not "
                                                              "train (a folder trains the .jsonl files directly"),
    (["a.jsonl", "b.jsonl.gz", "notes.md"], "holds b.jsonl.gz, which it would not train"),
    (["sub/d.jsonl", "e.csv"], "has no .jsonl or .txt files directly in it, and holds e.csv, sub/d.jsonl, which it "
                               "would not train"),
])
def test_a_data_folder_holding_files_it_would_not_train_is_refused_naming_them(tmp_path, capsys, files, says):
    folder = tmp_path / "data"
    for name in files:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(json.dumps({"input_ids": list(range(9))}) + "\n")
    assert refused(capsys, tiny(folder, tmp_path)).startswith(f"error: --data {folder} ")
    assert says in refused(capsys, tiny(folder, tmp_path))


def test_a_data_folder_trains_its_files_of_one_format_sorted_and_nothing_else(tmp_path):
    from megatrain.train.data import data_files

    folder = tmp_path / "data"
    for name in ("b.jsonl", "a.jsonl", "C.JSONL", "README.md", "LICENSE", ".ipynb_checkpoints/a-checkpoint.jsonl"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("")
    assert data_files([str(folder)]) == [folder / "C.JSONL", folder / "a.jsonl", folder / "b.jsonl"]


def test_bytes_that_are_not_utf8_are_refused_naming_file_and_line(tmp_path, capsys):
    jsonl, txt = tmp_path / "bad.jsonl", tmp_path / "bad.txt"
    jsonl.write_bytes(b'{"input_ids": [1, 2]}\n{"text": "caf\xe9"}\n')
    txt.write_bytes(b"one document\n\nanother,\nover lines \xff\n")
    assert f"--data {jsonl}:2: byte 0xe9 is not UTF-8" in refused(capsys, tiny(jsonl, tmp_path))
    assert f"--data {txt}:4: byte 0xff is not UTF-8" in refused(capsys, tiny(txt, tmp_path))


def test_held_out_data_errors_name_eval_data(tmp_path, capsys, data):
    missing = tmp_path / "held_out.jsonl"
    line = refused(capsys, tiny(data, tmp_path, "--eval-data", str(missing), "--eval-every", "1"))
    assert line == f"error: --eval-data {missing}: no such file or folder"
    missing.write_text('{"input_ids": [1, -1]}\n')
    with pytest.raises(ValueError, match=f"^--eval-data {re.escape(str(missing))}:1: input_ids must be"):
        read_examples([missing], None, False, flag="--eval-data")


def test_chat_data_without_transformers_names_the_extra_and_text_data_needs_none(tmp_path, capsys, monkeypatch):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<eos>": 1, "w": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    chat, text = tmp_path / "chat.jsonl", tmp_path / "text.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "w"}, {"role": "assistant", "content": "w"}]}))
    text.write_text("".join(json.dumps({"text": "w w w"}) + "\n" for _ in range(4)))
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    line = refused(capsys, tiny(chat, tmp_path, "--tokenizer", str(tmp_path / "tok")))
    assert line.endswith("renders chat data with the tokenizer's chat template through transformers, which is not "
                         "installed: pip install 'megatrain[chat]'")
    assert main(["train", *tiny(text, tmp_path, "--tokenizer", str(tmp_path / "tok"), "--seq", "4")]) == 0


def test_a_tokenizer_config_that_is_a_folder_is_refused_naming_it(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<eos>": 1, "w": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (tmp_path / "tok" / "tokenizer_config.json").mkdir(parents=True)
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": "w w w"}) + "\n" for _ in range(4)))
    # train's first look is at what its export will copy (loop.tokenizer_copies), before the tokenizer is read
    assert refused(capsys, tiny(text, tmp_path, "--tokenizer", str(tmp_path / "tok"))) == \
        f"error: {tmp_path / 'tok' / 'tokenizer_config.json'} is not a file (an export copies it from there): put " \
        "the file there, or remove it"
    from megatrain.tokenizer import Tokenizer as Ours  # and the tokenizer's own reading, where no export follows

    with pytest.raises(ValueError, match=r"tokenizer_config.json cannot be read \(Is a directory\)"):
        Ours(tmp_path / "tok")


ALTERNATING = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
               "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("template, line, says", [
    ("{% for m in messages %}{{ m['content'] }", 1, "(TemplateSyntaxError: unexpected '}')"),
    ("{{ messages.__class__.__mro__ }}", 1, "(SecurityError: access to attribute '__class__' of 'list' object is "
                                            "unsafe.)"),
    (ALTERNATING, 2, "(TemplateError: Conversation roles must alternate user/assistant/user/assistant/...)"),
    ("{% include 'other.jinja' %}", 1, "(TypeError: no loader for this environment specified)"),
    ("{% for i in range(10**9) %}{% endfor %}", 1, "(OverflowError: Range too big. The sandbox blocks ranges larger "
                                                  "than MAX_RANGE (100000).)"),
    pytest.param("{{ " + "(" * 1000 + "1" + ")" * 1000 + " }}", 1, "(RecursionError: maximum recursion depth exceeded",
                 id="nested-too-deep-to-parse"),
])
def test_a_chat_template_failing_on_a_conversation_is_refused_naming_the_line(tmp_path, capsys, template, line,
                                                                              says):
    pytest.importorskip("transformers")
    from train_helpers import chat_tokenizer

    tok, chat = tmp_path / "tok", tmp_path / "chat.jsonl"
    chat_tokenizer(tok)
    (tok / "chat_template.jinja").write_text(template)
    chat.write_text("".join(json.dumps({"messages": [{"role": role, "content": "w1"} for role in roles]}) + "\n"
                            for roles in (("user", "assistant"), ("assistant", "assistant"))))
    error = refused(capsys, tiny(chat, tmp_path, "--tokenizer", str(tok)))
    assert error.startswith(f"error: --data {chat}:{line}: the chat template of {tok} fails on this conversation "
                            f"{says}")


def test_named_chat_templates_render_with_the_default_as_transformers_does(tmp_path, capsys):
    pytest.importorskip("transformers")
    from train_helpers import chat_tokenizer

    from megatrain.tokenizer import Tokenizer

    tok, chat = tmp_path / "tok", tmp_path / "chat.jsonl"
    chat_tokenizer(tok)
    chat.write_text(json.dumps({"messages": [{"role": role, "content": "w1"} for role in ("user", "assistant")]}))
    (expected,) = read_examples([chat], Tokenizer(tok), train_on_prompt=False)
    (tok / "additional_chat_templates").mkdir()
    (tok / "additional_chat_templates" / "tool_use.jinja").write_text("{{ raise_exception('not this one') }}")
    (got,) = read_examples([chat], Tokenizer(tok), train_on_prompt=False)  # chat_template.jinja is the default
    (tok / "chat_template.jinja").rename(tok / "additional_chat_templates" / "default.jinja")
    (named,) = read_examples([chat], Tokenizer(tok), train_on_prompt=False)
    assert (got.ids, got.target) == (named.ids, named.target) == (expected.ids, expected.target)
    (tok / "additional_chat_templates" / "default.jinja").unlink()
    assert refused(capsys, tiny(chat, tmp_path, "--tokenizer", str(tok))) == \
        f"error: --data {chat}:1: {tok}: its chat templates are named tool_use, and chat data is rendered with the " \
        "one named 'default' (as transformers renders it): add additional_chat_templates/default.jinja"


@pytest.mark.parametrize("config, chat_only, says", [
    ({"eos_token": 5}, False, "tokenizer_config.json: eos_token must be a token (a string, or an object with its "
                              "content), got 5"),
    ({"eos_token": {"x": 1}}, False, 'eos_token must be a token (a string, or an object with its content), got {"x"'),
    ({"eos_token": "<nope>"}, False, "its eos_token '<nope>' is no token of its tokenizer.json, so no document would "
                                     "end with it"),
    ({"tokenizer_class": 5}, True, "transformers cannot load it to render chat data (AttributeError: "),
    ({"added_tokens_decoder": {"x": 5}}, True, "transformers cannot load it to render chat data (TypeError: "),
    ({"chat_template": 5}, True, "its chat template must be a Jinja template (a string), got 5"),
])
def test_a_damaged_tokenizer_config_is_refused_naming_it(tmp_path, capsys, config, chat_only, says):
    pytest.importorskip("transformers")
    from train_helpers import chat_tokenizer

    tok, chat, text = tmp_path / "tok", tmp_path / "chat.jsonl", tmp_path / "text.jsonl"
    chat_tokenizer(tok)
    if "chat_template" in config:  # else the saved template file stands over the config's
        (tok / "chat_template.jinja").unlink()
    (tok / "tokenizer_config.json").write_text(json.dumps({**json.loads((tok / "tokenizer_config.json").read_text()),
                                                           **config}))
    chat.write_text(json.dumps({"messages": [{"role": role, "content": "w1"} for role in ("user", "assistant")]}))
    text.write_text("".join(json.dumps({"text": "w1 w2 w3"}) + "\n" for _ in range(4)))
    assert says in refused(capsys, tiny(chat, tmp_path, "--tokenizer", str(tok)))
    if chat_only:  # text data needs no transformers
        assert main(["train", *tiny(text, tmp_path, "--tokenizer", str(tok), "--seq", "4")]) == 0
    else:
        assert says in refused(capsys, tiny(text, tmp_path, "--tokenizer", str(tok), "--seq", "4"))


def test_a_conversation_of_no_messages_is_refused_naming_its_line(tmp_path, capsys):
    pytest.importorskip("transformers")
    from train_helpers import chat_tokenizer

    chat_tokenizer(tmp_path / "tok")
    chat = tmp_path / "chat.jsonl"
    talk = [{"role": role, "content": "w1"} for role in ("user", "assistant")]
    chat.write_text(json.dumps({"messages": talk}) + '\n{"messages": []}\n')
    assert refused(capsys, tiny(chat, tmp_path, "--tokenizer", str(tmp_path / "tok"))) == \
        f"error: --data {chat}:2: holds no token to train on: drop the line"


def test_a_seq_this_machine_cannot_hold_is_refused_before_its_rows_are_made(tmp_path, capsys, data):
    line = refused(capsys, tiny(data, tmp_path, "--seq", str(10**12)))  # its rows' padding alone: 8 TB
    assert "megatrain tiny b4 s1000000000000 does not fit here: host memory" in line


def test_data_without_a_target_token_is_refused(tmp_path, capsys):
    one_token_docs = tmp_path / "short.jsonl"
    one_token_docs.write_text("".join(json.dumps({"input_ids": [i]}) + "\n" for i in range(12)))
    assert "--data: no token of the data is a target" in refused(capsys, tiny(one_token_docs, tmp_path))
    prompts_only = [Example([1, 2, 3], [False, False, False], "chat.jsonl:1")]  # a chat without an assistant turn
    with pytest.raises(ValueError, match="^--eval-data: no token of the data is a target"):
        Rows(prompts_only, seq=8, vocab_size=16, shuffle=False, seed=0, flag="--eval-data")
