"""Gemma 4's large checkpoints compiled in every system, each in a fresh process (Dynamo's counts its own): minutes of
torch.compile on the CPU, in a file of their own so that tests_subprocess's workers (a file each, --dist loadfile)
share them out with test_generic.py's other subprocess cases."""

import functools
import json

import pytest
import torch

pytest.importorskip("transformers")

from train_helpers import needs_deepspeed, python_process  # noqa: E402


def _bench_large_gemma4(system: str, *flags: str) -> dict:
    """`python -m megatrain bench` of tiny-hf-gemma4-26b-a4b (Gemma 4's large checkpoints' switches) for 3 steps on
    the CPU in fp32, in a fresh process (Dynamo's counts its own): its record."""
    cli = "import sys; from megatrain.cli import exit_process, main; exit_process(main(sys.argv[1:]))"
    proc = python_process(cli, "bench", "--system", system, "--model", "tiny-hf-gemma4-26b-a4b", "--batch", "4",
                          "--micro-batch", "2", "--seq", "80", "--steps", "3", "--device", "cpu", "--dtype", "float32",
                          "--json", *flags)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@functools.cache
def _eager_native_large_gemma4() -> dict:
    return _bench_large_gemma4("native")


@pytest.mark.parametrize("system", ["megatrain", "native", "fsdp", pytest.param("deepspeed", marks=needs_deepspeed)])
@pytest.mark.subprocess
@pytest.mark.slow  # torch.compile on CPU
def test_gemma4_large_checkpoints_compile_in_every_system(system):
    """Compiled, Gemma 4's large checkpoints' layers (keys equal to values on the full layers past the 64-token
    window, experts beside the MLP) run as compiled graphs in every system, none left eager, at eager native's
    losses."""
    compiled = _bench_large_gemma4(system, "--compile")
    assert compiled["status"] == "ok", compiled["error"]
    check = compiled["system_config"]["compile_check"]
    assert check["compiled_frames"] >= 1 and not check["eager_fallback"], check
    torch.testing.assert_close(torch.tensor(compiled["losses"]), torch.tensor(_eager_native_large_gemma4()["losses"]),
                               rtol=1e-5, atol=0)
