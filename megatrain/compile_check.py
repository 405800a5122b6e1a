"""Whether torch.compile took: Dynamo's own counts of what it compiled in this process, for a compiled case's record.

A system asked to compile that ran its layers eager (Dynamo gave up on a frame, at its recompile limit or on an
error it suppressed; or the system's own fallback after a compiler failure) is eager, and its record says so.
"""

from __future__ import annotations

RECOMPILE_LIMIT = "Dynamo recompile limit exceeded"  # how Dynamo's counters name a frame it stopped compiling


def compile_check(fell_back: bool = False) -> dict:
    """Dynamo's counts since this process started (every torch.compile in it: the layers', FlexAttention's), read
    after the timed steps; `fell_back`: the system itself gave up compiling (LayerTemplate on a compiler failure).

    compiled_frames: frames Dynamo compiled; failed_frames: frames it gave up on, which ran eager (recompile_limit_hits
    of them at its recompile limit); recompiles: compiles of a frame after its first (a guard failed: a new input
    kind, or a guard on per-layer state); graph_breaks: splits of a frame into graphs with eager code between, met at
    each compile of it; eager_fallback: whether layers ran eager (a failed frame, nothing compiled, or the system's
    own fallback)."""
    from torch._dynamo.convert_frame import input_codes
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import counters

    frames = counters["frames"]
    failed = frames["total"] - frames["ok"]
    codes = [code for ref in input_codes.seen if (code := ref()) is not None]
    return {"compiled_frames": frames["ok"], "failed_frames": failed,
            "recompile_limit_hits": sum(n for msg, n in counters["unimplemented"].items()
                                        if msg.startswith(RECOMPILE_LIMIT)),
            "recompiles": sum(max(len(_debug_get_cache_entry_list(code)) - 1, 0) for code in codes),
            "graph_breaks": sum(counters["graph_break"].values()),
            "eager_fallback": fell_back or failed > 0 or frames["ok"] == 0}
