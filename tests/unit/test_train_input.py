"""`python -m megatrain train` refuses each mistake in its input with exit 2 and one line saying what to change, before
anything is built. CPU, seconds: pytest tests/unit/test_train_input.py"""

import pytest
import torch

from megatrain.engine.state import read_tiles


def test_a_checkpoint_of_another_shape_is_refused_in_one_short_line(tmp_path):
    tiles = {"weights": torch.zeros(6, dtype=torch.bfloat16), "master": torch.zeros(6), "exp_avg": torch.zeros(6)}
    saved = [{"name": "weights", "dtype": "float32", "numel": 6}, {"name": "exp_avg", "dtype": "float32", "numel": 6}]
    with pytest.raises(ValueError) as refusal:
        read_tiles(tmp_path / "tiles.bin", tiles, saved)
    assert str(refusal.value) == (f"{tmp_path} holds another model, dtype or precision than this engine: 3 of 3 tiles "
                                  "differ, the first saved as weights (float32 x 6), here weights (bfloat16 x 6)")
