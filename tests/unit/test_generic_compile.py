"""Gemma 4's large checkpoints compiled in every system, each in a fresh process (Dynamo's counts its own): minutes of
torch.compile on the CPU, in a file of their own so that tests_subprocess's workers (a file each, --dist loadfile)
share them out with test_generic.py's other subprocess cases."""

import functools
import json

import pytest
import torch

pytest.importorskip("transformers")

from train_helpers import needs_deepspeed, python_process  # noqa: E402


def _bench_gemma4(model: str, system: str, *flags: str) -> dict:
    """`python -m megatrain bench` of `model` for 3 steps on the CPU in fp32, in a fresh process (Dynamo's counts its
    own): its record."""
    cli = "import sys; from megatrain.cli import exit_process, main; exit_process(main(sys.argv[1:]))"
    proc = python_process(cli, "bench", "--system", system, "--model", model, "--batch", "4",
                          "--micro-batch", "2", "--seq", "80", "--steps", "3", "--device", "cpu", "--dtype", "float32",
                          "--json", *flags)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@functools.cache
def _eager_native(model: str, *flags: str) -> dict:
    return _bench_gemma4(model, "native", *flags)


@pytest.mark.parametrize("system", ["megatrain", "native", "fsdp", pytest.param("deepspeed", marks=needs_deepspeed)])
@pytest.mark.subprocess
@pytest.mark.slow  # torch.compile on CPU
def test_gemma4_large_checkpoints_compile_in_every_system(system):
    """Compiled, Gemma 4's large checkpoints' layers (keys equal to values on the full layers past the 64-token
    window, experts beside the MLP) run as compiled graphs in every system, none left eager and none broken, at eager
    native's losses. transformers' layer stores each layer type's last keys and values for layers that share them
    (none here): inside native's and FSDP2's activation checkpoint that broke the layer's graph in two until the
    store was left out of the recompute (megatrain.systems.common.compile_layers)."""
    _compiles_whole_at_eager_natives_losses("tiny-hf-gemma4-26b-a4b", system)


@pytest.mark.parametrize("system", ["megatrain", "native", "fsdp"])
@pytest.mark.subprocess
@pytest.mark.slow  # torch.compile on CPU
def test_gemma4_e_sizes_shared_keys_compile_whole(system):
    """Gemma 4's E-sizes, whose last layers read the keys and values an earlier layer stored, compile whole at eager
    native's losses. Native and FSDP2: with the store left out of the checkpoint's recompute (the readers recompute
    before the writer, from what its forward stored). The engine: its readers' taps made before the layer's call
    (megatrain.engine.programs.generic.Published); made inside it, they had broken every reading layer's graph (10
    graph breaks in Gemma-4-E4B's H200 records)."""
    _compiles_whole_at_eager_natives_losses("tiny-hf-gemma4", system)


@pytest.mark.subprocess
@pytest.mark.slow  # torch.compile on CPU
def test_native_mixed_casts_its_experts_inside_one_compiled_graph():
    """Native's mixed precision casts transformers' experts to autocast's dtype at each call
    (megatrain.models.generic.experts), inside the compiled layer: whole, at eager native mixed's losses. Through a
    closure's default argument the GPU's torch 2.11 broke each 26B-A4B layer there (torch 2.13 did not). Compiled bf16
    rounds once per fused kernel where eager rounds per op (1.3e-4 of the loss apart here): the losses within 2e-3
    (one bf16 rounding is up to 3.9e-3); that the experts multiply in bf16 at all is test_generic_experts.py's."""
    _compiles_whole_at_eager_natives_losses("tiny-hf-gemma4-26b-a4b", "native", "--dtype", "bfloat16",
                                            "--precision", "mixed", rtol=2e-3)


def _compiles_whole_at_eager_natives_losses(model: str, system: str, *flags: str, rtol: float = 1e-5) -> None:
    compiled = _bench_gemma4(model, system, "--compile", *flags)
    assert compiled["status"] == "ok", compiled["error"]
    check = compiled["system_config"]["compile_check"]
    assert check["compiled_frames"] >= 1 and not check["eager_fallback"] and not check["graph_breaks"], check
    torch.testing.assert_close(torch.tensor(compiled["losses"]), torch.tensor(_eager_native(model, *flags)["losses"]),
                               rtol=rtol, atol=0)
