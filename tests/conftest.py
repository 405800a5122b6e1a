import os
import tempfile

import pytest
import torch

from megatrain.probe import QUICK_ENV

if not torch.cuda.is_available():  # every suite run probes the machine: on CPU, tests take its quick rates
    os.environ.setdefault(QUICK_ENV, "1")

# One of several test processes (pytest-xdist) sharing the cores: an equal share of them each (one on CI's two cores),
# for the processes it starts too. Two threads each on two cores spin against each other (the fast session took 5.5
# min so, 2.4 with one); on the GPU host's 16 cores 8 workers take two each (the host AdamW of a published width).
if os.environ.get("PYTEST_XDIST_WORKER"):
    threads = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))


# The tests' checkpoint key (megatrain.train.trust) in a directory of their own, never the user's, set before any
# test module is imported: the processes they start inherit it, those started with an environment a module copied
# at import included (a session fixture came after those copies, so their processes signed with the user's key).
os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="megatrain-tests-config-")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
