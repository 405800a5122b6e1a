"""The configs of published checkpoints people fine-tune, as their releases set them: one JSON file here per
checkpoint, named by its hub id (`org--name.json`), holding the text model's config.json values (`config`: the
text_config of a multimodal release) and where they were read (`source`: the checkpoint's own config.json as a public
repository copies it, or the part of it that repository copies; a key it leaves out takes its config class's
default). Nothing here is guessed: a checkpoint whose values no source gave is not in the table.

megatrain.checks.walk trains each at the walk's tiny widths with every switch as published (scripts/
walk_transformers.py --published), and at its published widths on a GPU (--published --curves cuda).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

TABLE_DIR = Path(__file__).parent


@dataclass(frozen=True)
class Published:
    """One published checkpoint.

    Attributes:
        hub_id: its Hugging Face hub id ('google/gemma-4-31B-it').
        source: where its values were read.
        config_json: its text model's config.json as sorted JSON (`config` the dict).
    """

    hub_id: str
    source: str
    config_json: str

    @property
    def config(self) -> dict:
        return json.loads(self.config_json)

    @property
    def model_type(self) -> str:
        return self.config["model_type"]


@functools.cache
def published() -> tuple[Published, ...]:
    """Every checkpoint of the table, by hub id."""
    rows = []
    for path in sorted(TABLE_DIR.glob("*.json")):
        row = json.loads(path.read_text())
        assert path.stem == row["hub_id"].replace("/", "--"), f"{path.name} holds {row['hub_id']}"
        rows.append(Published(row["hub_id"], row["source"], json.dumps(row["config"], sort_keys=True)))
    return tuple(sorted(rows, key=lambda r: r.hub_id.lower()))


def get_published(hub_id: str) -> Published:
    """The table's row of `hub_id`; ValueError naming the table's ids when it has none."""
    rows = {r.hub_id: r for r in published()}
    if hub_id not in rows:
        raise ValueError(f"no published config of {hub_id!r}; the table has: {', '.join(rows)}")
    return rows[hub_id]
