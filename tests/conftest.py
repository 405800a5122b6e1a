import os

import pytest
import torch

from megatrain.probe import QUICK_ENV

if not torch.cuda.is_available():  # every suite run probes the machine: on CPU, tests take its quick rates
    os.environ.setdefault(QUICK_ENV, "1")


@pytest.fixture(autouse=True, scope="session")
def _private_config_dir(tmp_path_factory):
    """The tests' checkpoint key (megatrain.train.trust) in a directory of their own, never the user's; the
    processes they start inherit it."""
    os.environ["XDG_CONFIG_HOME"] = str(tmp_path_factory.mktemp("config"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
