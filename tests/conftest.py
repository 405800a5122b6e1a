import os

import pytest
import torch

from megatrain.probe import QUICK_ENV

if not torch.cuda.is_available():  # every suite run probes the machine: on CPU, tests take its quick rates
    os.environ.setdefault(QUICK_ENV, "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
