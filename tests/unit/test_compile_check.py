"""megatrain.compile_check against Dynamo doing each thing it reports. CPU, seconds (the eager backend, no Inductor):
pytest tests/unit/test_compile_check.py"""

import torch
from torch._dynamo.utils import counters

import megatrain.compile_check
from megatrain.compile_check import compile_check, watch


def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()


def test_a_frame_past_the_recompile_limit_is_an_eager_fallback():
    _fresh_dynamo()

    @torch.compile(backend="eager", dynamic=False)
    def scale(x, n):
        return x * n

    for n in range(10):  # a guard on the integer: a compile per value, up to the limit (8)
        scale(torch.ones(2), n)
    check = compile_check()
    assert check == {"compiled_frames": 8, "failed_frames": 1, "recompile_limit_hits": 1, "recompiles": 7,
                     "graph_breaks": 0, "eager_fallback": True, "why": check["why"]}
    assert len(check["why"]) == 1 and check["why"][0].startswith("Dynamo recompile limit exceeded: "), check


def test_one_graph_per_input_kind_took_and_a_graph_break_is_counted():
    _fresh_dynamo()

    @torch.compile(backend="eager", dynamic=False)
    def layer(x):
        y = x.sin()
        torch._dynamo.graph_break()  # eager code between two graphs
        return y.cos()

    for _ in range(3):
        layer(torch.ones(2))
    layer(torch.ones(3))  # a new shape: one recompile, as a second layer structure would be
    check = compile_check()
    assert (check["recompiles"], check["failed_frames"], check["eager_fallback"]) == (2, 0, False), check
    # each shape: the frame and its resumed half compiled, the break met once in each compile of the frame
    assert (check["compiled_frames"], check["graph_breaks"]) == (4, 2)
    assert check["why"] == ["Call to `torch._dynamo.graph_break()`: User-inserted graph break. Message: None"], check
    assert compile_check(fell_back=True)["eager_fallback"], "a system's own fallback (LayerTemplate) is eager too"


def test_a_compiler_error_dynamo_suppressed_is_an_eager_fallback_that_says_why(monkeypatch):
    """Native's Gemma-4-26B-A4B layer ran eager on the H200 (a failed frame, nothing compiled) and its record could
    not say why: a suppressed compiler error is said only in Dynamo's log, kept from watch() on, without folders."""
    _fresh_dynamo()
    monkeypatch.setattr(torch._dynamo.config, "suppress_errors", True)
    monkeypatch.setattr(megatrain.compile_check, "_given_up", [])  # what another test's frames left in this process
    watch()

    def failing_backend(gm, example_inputs):
        raise RuntimeError("no kernel for this layer in /home/someone/site-packages/kernels.py")

    @torch.compile(backend=failing_backend, dynamic=False)
    def layer(x):
        return x * 2

    assert torch.equal(layer(torch.ones(2)), torch.full((2,), 2.0)), "the frame runs eager"
    check = compile_check()
    assert (check["compiled_frames"], check["failed_frames"], check["eager_fallback"]) == (0, 1, True), check
    assert len(check["why"]) == 1 and check["why"][0].startswith("layer: "), check
    assert "RuntimeError: no kernel for this layer in kernels.py" in check["why"][0], check


def test_nothing_to_say_where_every_frame_compiled_whole():
    _fresh_dynamo()

    @torch.compile(backend="eager", dynamic=False)
    def layer(x):
        return x.sin()

    layer(torch.ones(2))
    assert "why" not in compile_check()
