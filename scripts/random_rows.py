"""Random pre-tokenized JSONL rows for the train measurements (scripts/train_memory.sh, scripts/pack_cost.sh):
ROWS lines of {"input_ids": [...]}, ids uniform over MODEL's vocabulary, lengths uniform in MIN_LEN..MAX_LEN, seed 0.
    python scripts/random_rows.py OUT MODEL ROWS MIN_LEN MAX_LEN
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere: this checkout's package
from megatrain.models import model_shape  # noqa: E402

out, model, rows, lo, hi = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
vocab = model_shape(model).vocab_size
gen = torch.Generator().manual_seed(0)
with open(out, "w") as f:
    for _ in range(rows):
        n = int(torch.randint(lo, hi + 1, (), generator=gen)) if hi > lo else lo
        f.write(json.dumps({"input_ids": torch.randint(0, vocab, (n,), generator=gen).tolist()}) + "\n")
