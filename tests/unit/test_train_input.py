"""`python -m megatrain train` refuses each mistake in its input with exit 2 and one line saying what to change, before
anything is built. CPU, seconds: pytest tests/unit/test_train_input.py"""

import dataclasses
import json

import pytest
import torch

from megatrain.cli import main
from megatrain.engine.state import read_tiles
from megatrain.train.config import TrainConfig
from megatrain.train.data import Example, Rows


def refused(capsys, argv) -> str:
    """The one line `train` answers argv with, after checking the exit code 2."""
    assert main(["train", *argv]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def tiny(data, tmp_path, *extra) -> list[str]:
    """A from-scratch run of the tiny shape on `data`, with extra flags (--steps 1 unless --epochs is given)."""
    length = [] if "--epochs" in extra else ["--steps", "1"]
    return ["--model", "tiny", "--data", str(data), "--seq", "8", "--batch", "4", *length, "--out",
            str(tmp_path / "run"), *extra]


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
    ('{"text": null}', "text must be a string, got null"),
    ('{"instruction": "a"}', "output must be a string, got null"),
    ('{"messages": "hi"}', "messages must be a list of {role, content} objects"),
    ('{"messages": [{"role": "user", "content": 5}]}', "content must be a string, got 5"),
    ('{"conversations": [{"from": "alien", "value": "x"}]}', "unknown role 'alien'"),
])
def test_a_bad_data_line_is_refused_naming_flag_file_and_line(tmp_path, capsys, line, says):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"input_ids": [1, 2, 3]}\n\n' + line + "\n")
    line = refused(capsys, tiny(path, tmp_path))
    assert line.startswith(f"error: --data {path}:3: ") and says in line


def test_bytes_that_are_not_utf8_are_refused_naming_file_and_line(tmp_path, capsys):
    jsonl, txt = tmp_path / "bad.jsonl", tmp_path / "bad.txt"
    jsonl.write_bytes(b'{"input_ids": [1, 2]}\n{"text": "caf\xe9"}\n')
    txt.write_bytes(b"one document\n\nanother,\nover lines \xff\n")
    assert f"--data {jsonl}:2: byte 0xe9 is not UTF-8" in refused(capsys, tiny(jsonl, tmp_path))
    assert f"--data {txt}:4: byte 0xff is not UTF-8" in refused(capsys, tiny(txt, tmp_path))


def test_data_without_a_target_token_is_refused(tmp_path, capsys):
    one_token_docs = tmp_path / "short.jsonl"
    one_token_docs.write_text("".join(json.dumps({"input_ids": [i]}) + "\n" for i in range(12)))
    assert "--data: no token of the data is a target" in refused(capsys, tiny(one_token_docs, tmp_path))
    prompts_only = [Example([1, 2, 3], [False, False, False], "chat.jsonl:1")]  # a chat without an assistant turn
    with pytest.raises(ValueError, match="^--eval-data: no token of the data is a target"):
        Rows(prompts_only, seq=8, vocab_size=16, shuffle=False, seed=0, flag="--eval-data")
