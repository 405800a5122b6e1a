"""megatrain.compile_check against Dynamo doing each thing it reports. CPU, seconds (the eager backend, no Inductor):
pytest tests/unit/test_compile_check.py"""

import torch
from torch._dynamo.utils import counters

from megatrain.compile_check import compile_check


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
    assert compile_check() == {"compiled_frames": 8, "failed_frames": 1, "recompile_limit_hits": 1, "recompiles": 7,
                               "graph_breaks": 0, "eager_fallback": True}


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
    assert compile_check(fell_back=True)["eager_fallback"], "a system's own fallback (LayerTemplate) is eager too"
