"""`train --data` from Hugging Face datasets: a save_to_disk folder, parquet/json files and hub names read as their
JSONL lines, splits, and the one-line refusals (no `datasets`, no hub). CPU, seconds:
pytest tests/unit/test_train_datasets.py"""

import json
import sys

import pytest

datasets = pytest.importorskip("datasets")
pytest.importorskip("transformers")  # the chat template of chat_tokenizer

from train_helpers import chat_tokenizer, hf_model, metrics, pretokenized, run_train  # noqa: E402

from megatrain.cli import main  # noqa: E402
from megatrain.train.data import data_files, read_examples  # noqa: E402

FORMATS = {
    "input_ids": [{"input_ids": [5, 9, 12, 3]}, {"input_ids": [7, 8]}],
    "text": [{"text": "w1 w2 w3"}, {"text": "w4"}],
    "alpaca": [{"instruction": "w4", "input": "", "output": "w5 w6"}, {"instruction": "w1", "input": "w2",
                                                                      "output": "w3"}],
    "messages": [{"messages": [{"role": "system", "content": "w0"}, {"role": "user", "content": "w1 w2"},
                               {"role": "assistant", "content": "w3"}]}],
    "conversations": [{"conversations": [{"from": "human", "value": "w1"}, {"from": "gpt", "value": "w2 w7"}]}],
}


@pytest.fixture(autouse=True)
def dataset_cache(tmp_path, monkeypatch):
    """The conversions of data files to Arrow go to the test's folder, not the user's cache."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_reads_from_a_dataset_as_from_its_jsonl(tmp_path, fmt):
    tok = chat_tokenizer(tmp_path / "tok")
    records = FORMATS[fmt]
    table = datasets.Dataset.from_list(records)
    table.save_to_disk(tmp_path / "saved")
    (tmp_path / "parquet").mkdir()
    table.to_parquet(tmp_path / "parquet" / "train-00000.parquet")
    table.to_json(tmp_path / "rows.json")  # JSON lines under the suffix datasets reads
    expected = read_examples([_jsonl(tmp_path / "rows.jsonl", records)], tok, train_on_prompt=False)
    for name in ("saved", "parquet", "rows.json"):
        got = read_examples(data_files([str(tmp_path / name)]), tok, train_on_prompt=False)
        assert [(e.ids, e.target) for e in got] == [(e.ids, e.target) for e in expected], name
    assert got[-1].where == f"--data {tmp_path / 'rows.json'} row {len(records) - 1}"


def test_a_saved_dataset_trains_the_same_losses_as_its_jsonl(tmp_path):
    init = hf_model("qwen2", tmp_path / "init")
    jsonl = pretokenized(tmp_path / "data.jsonl", rows=12)
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "saved")
    assert run_train(init, jsonl, tmp_path / "from-jsonl", steps=3) == 0
    assert run_train(init, tmp_path / "saved", tmp_path / "from-dataset", steps=3) == 0
    losses = [[m["loss"] for m in metrics(tmp_path / run)] for run in ("from-jsonl", "from-dataset")]
    assert len(losses[0]) == 3 and losses[0] == losses[1]


def test_a_split_is_named_where_a_dataset_has_several(tmp_path, capsys):
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(FORMATS["input_ids"]),
                                   "test": datasets.Dataset.from_list(FORMATS["input_ids"][:1])})
    splits.save_to_disk(tmp_path / "dict")
    with pytest.raises(ValueError, match="has several splits: give --data-split one of train, test$"):
        read_examples(data_files([str(tmp_path / "dict")]), None, False)
    with pytest.raises(ValueError, match="has no split 'dev': give --eval-split one of train, test$"):
        read_examples(data_files([str(tmp_path / "dict")], "--eval-data", "dev"), None, False, "--eval-data")
    assert len(read_examples(data_files([str(tmp_path / "dict")], "--eval-data", "test"), None, False)) == 1
    data = [str(tmp_path / "dict"), "--data-split", "train", "--eval-data", str(tmp_path / "dict"), "--eval-split",
            "test", "--eval-every", "1"]
    assert main(["train", "--model", "tiny", "--data", *data, "--seq", "4", "--batch", "2", "--steps", "1", "--out",
                 str(tmp_path / "run")]) == 0
    assert [m["eval_tokens"] for m in metrics(tmp_path / "run") if "eval_tokens" in m] == [3]  # test's one row


def test_a_hub_name_is_read_with_its_split_through_datasets(tmp_path, monkeypatch):
    asked = []

    def load_dataset(name, split=None, **kwargs):
        asked.append((name, split))
        return datasets.Dataset.from_list(FORMATS["input_ids"])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    got = read_examples(data_files(["someone/corpus"], "--data", "train"), None, False)
    assert asked == [("someone/corpus", "train")] and [e.ids for e in got] == [[5, 9, 12, 3], [7, 8]]


def test_no_hub_and_no_datasets_package_are_each_one_line(tmp_path, monkeypatch, capsys):
    def unreachable(name, split=None, **kwargs):
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    flags = ["--model", "tiny", "--seq", "4", "--batch", "2", "--steps", "1", "--out", str(tmp_path / "run")]
    assert main(["train", *flags, "--data", "someone/corpus", "--data-split", "train"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "the hub is out of reach" in err[0] and "save_to_disk" in err[0]
    assert main(["train", *flags, "--data", "someone/corpus"]) == 2  # no split: a missing local path
    assert capsys.readouterr().err.strip().endswith("no such file or folder (a Hugging Face hub dataset: give its "
                                                    "split too, --data-split SPLIT)")
    datasets.Dataset.from_list(FORMATS["input_ids"]).save_to_disk(tmp_path / "saved")
    capsys.readouterr()  # the progress bar of save_to_disk
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets fails, as where it is not installed
    assert main(["train", *flags, "--data", str(tmp_path / "saved")]) == 2
    assert capsys.readouterr().err.strip() == f"error: --data {tmp_path / 'saved'} is a Hugging Face dataset, which " \
        "needs the datasets package: pip install 'megatrain[data]'"


def test_a_folder_of_jsonl_files_and_a_dataset_is_refused_naming_what_it_would_not_train(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    _jsonl(folder / "rows.jsonl", FORMATS["input_ids"])
    (folder / "meta.json").write_text("{}")
    with pytest.raises(ValueError, match="holds meta.json, which it would not train"):
        data_files([str(folder)])
    datasets.Dataset.from_list(FORMATS["input_ids"]).save_to_disk(tmp_path / "saved")
    _jsonl(tmp_path / "saved" / "extra.jsonl", FORMATS["input_ids"])  # beside a save_to_disk's files
    with pytest.raises(ValueError, match="holds data-00000-of-00001.arrow, dataset_info.json, state.json, which it "
                                         "would not train"):
        data_files([str(tmp_path / "saved")])


def test_a_dataset_row_reads_a_null_column_as_an_absent_one(tmp_path):
    tok = chat_tokenizer(tmp_path / "tok")
    lines = [FORMATS["text"][0], FORMATS["messages"][0], FORMATS["alpaca"][0]]
    _jsonl(tmp_path / "mixed.json", lines)  # datasets gives each row every column, null where its line has none
    expected = read_examples([_jsonl(tmp_path / "mixed.jsonl", lines)], tok, train_on_prompt=False)
    got = read_examples(data_files([str(tmp_path / "mixed.json")]), tok, train_on_prompt=False)
    assert [(e.ids, e.target) for e in got] == [(e.ids, e.target) for e in expected]


def test_a_dataset_saved_without_rows_is_one_line(tmp_path, capsys):
    empty = datasets.Dataset.from_dict({"input_ids": []})
    empty.save_to_disk(tmp_path / "saved")
    datasets.DatasetDict({"train": empty}).save_to_disk(tmp_path / "dict")
    empty.to_parquet(tmp_path / "empty.parquet")
    flags = ["--model", "tiny", "--seq", "4", "--batch", "2", "--steps", "1", "--out", str(tmp_path / "run")]
    for data in ("saved", "dict", "empty.parquet"):
        assert main(["train", *flags, "--data", str(tmp_path / data)]) == 2
        (line,) = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # no progress bars
        assert line.startswith(f"error: --data {tmp_path / data}: ")
        assert data == "empty.parquet" or line.endswith("as it fails on a dataset saved with no rows: give data that "
                                                        "has rows")
