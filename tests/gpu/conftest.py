"""GPU checks leave a record: with MEGATRAIN_GPU_CHECKS=FILE set, every test that takes the `check` fixture appends one
JSON line to FILE: the check's id, what it measured (option set, largest differences, tolerances), whether it passed,
its failure text, and the environment (commit, GPU, driver, torch). results/gpu_checks/ keeps the committed ones."""

import json
import os
import time

import pytest
import torch

from megatrain.bench.env import environment
from megatrain.bench.record import append_jsonl, relative_paths


@pytest.fixture(scope="module")
def no_tf32():
    """fp32 matmuls in full fp32 (TF32 off) for a module's tight parity checks; restored after it."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture
def check(request) -> dict:
    """A dict the test fills with what it measured; written out with the test's outcome."""
    data: dict = {}
    request.node.user_properties.append(("check", data))
    return data


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    path = os.environ.get("MEGATRAIN_GPU_CHECKS")
    data = dict(item.user_properties).get("check")
    if not path or data is None or report.when != "call":
        return
    append_jsonl(path, {
        "check": item.nodeid.split("::", 1)[1],
        "file": item.nodeid.split("::", 1)[0],
        "passed": report.passed,
        **json.loads(json.dumps(data, default=str)),
        "failure": relative_paths(str(report.longrepr))[-3000:] if report.failed else None,
        "duration_s": round(report.duration, 2),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "env": environment(),
    })
