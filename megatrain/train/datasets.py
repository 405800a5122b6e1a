"""Hugging Face `datasets` as train data (the optional extra [data]): a dataset saved with `save_to_disk`, a local
data file or folder of parquet/arrow/json files, or a hub dataset's name with its split (--data-split). Each row is
read as a JSONL line is (megatrain.train.data), so the same columns make the same examples: input_ids (labels,
attention_mask), text, messages/conversations, instruction/input/output/system; a null column is an absent one.

A saved dataset is memory-mapped from its Arrow files and read row by row, never loaded whole; files and hub
datasets are first converted to Arrow in the `datasets` cache (HF_DATASETS_CACHE) as `datasets` always does. A hub
name is read only where `datasets` reaches the hub: offline (HF_HUB_OFFLINE=1, or no network) it is refused with
what to do instead.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".json": "json"}  # a data file's suffix -> datasets' builder
SAVED_FILES = ("state.json", "dataset_dict.json")  # what save_to_disk writes: of a Dataset, of a DatasetDict
HUB_NAME = re.compile(r"[\w.-]+(/[\w.-]+)?")
SPLIT_FLAGS = {"--data": "--data-split", "--eval-data": "--eval-split"}


@dataclass(frozen=True)
class HFData:
    """A Hugging Face dataset that a data flag names: a local path, or a hub name (hub=True), and its split (None:
    the dataset's only split)."""

    name: str
    split: str | None
    hub: bool = False

    def __str__(self) -> str:
        return self.name + (f"[{self.split}]" if self.split else "")


def hf_source(path: Path, split: str | None, flag: str) -> HFData | None:
    """The dataset `path` names for `flag`, or None for what megatrain reads itself (a .jsonl/.txt file, a folder
    holding them, a path that is not there and no hub name). ValueError when it is a dataset and `datasets` is
    missing."""
    if path.is_dir():
        own = any(p.suffix.lower() in (".jsonl", ".txt") for p in path.iterdir())
        saved = any((path / name).exists() for name in SAVED_FILES)
        found = not own and (saved or any(p.suffix.lower() in BUILDERS for p in path.rglob("*")))  # else _folder_files
    else:
        found = path.suffix.lower() in BUILDERS if path.exists() else \
            split is not None and HUB_NAME.fullmatch(str(path))
    if not found:
        return None
    try:
        import datasets  # noqa: F401  (read soon after: the import is not wasted)
    except ImportError:
        raise ValueError(f"{flag} {path} is a Hugging Face dataset, which needs the datasets package: pip install "
                         "'megatrain[data]'") from None
    return HFData(str(path), split, hub=not path.exists())


def hf_records(source: HFData, flag: str) -> Iterator[tuple[str, dict]]:
    """(where, row) of every row of the dataset, in order, a null column (and a null key of a turn) absent: Arrow
    gives every row every column, null where its line had none; `where` names the flag, dataset and row."""
    for row, record in enumerate(_load(source, flag)):
        yield f"{flag} {source} row {row}", {key: [_present(t) if isinstance(t, dict) else t for t in value]
                                             if isinstance(value, list) else value
                                             for key, value in _present(record).items()}


def _present(record: dict) -> dict:
    return {key: value for key, value in record.items() if value is not None}


def _load(source: HFData, flag: str):
    """The one split of the dataset to read, as a `datasets.Dataset`."""
    import datasets

    path = Path(source.name)
    try:
        if source.hub:
            return datasets.load_dataset(source.name, split=source.split)
        if path.is_file():
            loaded = datasets.load_dataset(BUILDERS[path.suffix.lower()], data_files=str(path))
        elif any((path / name).exists() for name in SAVED_FILES):
            loaded = datasets.load_from_disk(str(path))
        else:
            loaded = datasets.load_dataset(str(path))
    except ConnectionError as exc:  # an OSError: said apart, with what to do offline
        raise ValueError(f"{flag} {source.name}: not a local path, and the hub is out of reach ({exc}); where it is "
                         "reachable, load it and save_to_disk, then give that folder") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{flag} {source}: {exc}") from None
    except IndexError as exc:  # datasets concatenates a saved dataset's Arrow files, and one saved empty has none
        raise ValueError(f"{flag} {source}: datasets cannot load it (IndexError: {exc}), as it fails on a dataset "
                         "saved with no rows: give data that has rows") from None
    if not isinstance(loaded, datasets.DatasetDict):  # a saved Dataset is one split
        return loaded
    splits = list(loaded)
    split = source.split or (splits[0] if len(splits) == 1 else None)
    if split not in loaded:
        said = f"has no split {source.split!r}" if source.split else "has several splits"
        raise ValueError(f"{flag} {source.name} {said}: give {SPLIT_FLAGS[flag]} one of {', '.join(splits)}")
    return loaded[split]
