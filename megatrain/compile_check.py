"""Whether torch.compile took: Dynamo's own counts of what it compiled in this process, for a compiled case's record.

A system asked to compile that ran its layers eager (Dynamo gave up on a frame, at its recompile limit or on an
error it suppressed; or the system's own fallback after a compiler failure) is eager, and its record says so.
"""

from __future__ import annotations

import logging
import re

RECOMPILE_LIMIT = "Dynamo recompile limit exceeded"  # how Dynamo's counters name a frame it stopped compiling
REASONS_KEPT, REASON_CHARS = 3, 300
_given_up: list[str] = []  # the first frames Dynamo gave up on in this process, each with its error's last line


class _GivenUp(logging.Handler):
    """Keeps Dynamo's 'WON'T CONVERT' warnings: a compiler error it suppressed (the frame then runs eager) is said
    only there, never in its counters."""

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if len(_given_up) < REASONS_KEPT and text.startswith("WON'T CONVERT"):
            lines = [line.strip() for line in text.splitlines() if line.strip()]
            where = lines[0].split()[2] if len(lines[0].split()) > 2 else "?"
            error = [line for line in lines if re.match(r"[\w.]*(Error|Exception|Unsupported)\b", line)]
            _given_up.append(_short(f"{where}: {(error or lines)[-1]}"))


def _short(text: str) -> str:
    """One reason for a record: folders left out (no machine's paths in a committed record), REASON_CHARS at most."""
    return re.sub(r"(?:/[\w.+-]+)+/", "", text)[:REASON_CHARS]


def _reason(message: str) -> str:
    """A Dynamo counter's message in one line: its first, and its explanation where it gives one ('Backend compiler
    exception: Backend compiler `inductor` failed with aten._local_scalar_dense.default ...')."""
    lines = [line.strip() for line in message.strip().splitlines()]
    why = next((line.removeprefix("Explanation:").strip() for line in lines if line.startswith("Explanation:")), "")
    return _short(f"{lines[0]}: {why}" if why else lines[0])


def watch() -> None:
    """From now on, keep why Dynamo gives up on a frame (compile_check's `why`); a system calls it where it compiles."""
    log = logging.getLogger("torch._dynamo.convert_frame")
    if not any(isinstance(h, _GivenUp) for h in log.handlers):
        log.addHandler(_GivenUp())


def compile_check(fell_back: bool = False) -> dict:
    """Dynamo's counts since this process started (every torch.compile in it: the layers', FlexAttention's), read
    after the timed steps; `fell_back`: the system itself gave up compiling (LayerTemplate on a compiler failure).

    compiled_frames: frames Dynamo compiled; failed_frames: frames it gave up on, which ran eager (recompile_limit_hits
    of them at its recompile limit); recompiles: compiles of a frame after its first (a guard failed: a new input
    kind, or a guard on per-layer state); graph_breaks: splits of a frame into graphs with eager code between, met at
    each compile of it; eager_fallback: whether layers ran eager (a failed frame, nothing compiled, or the system's
    own fallback); why (only where a frame failed or broke): the first reasons Dynamo gave, its suppressed errors
    (kept since watch()) and its graph breaks' and unsupported calls' messages, each cut to one line."""
    from torch._dynamo.convert_frame import input_codes
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import counters

    frames = counters["frames"]
    failed = frames["total"] - frames["ok"]
    codes = [code for ref in input_codes.seen if (code := ref()) is not None]
    check = {"compiled_frames": frames["ok"], "failed_frames": failed,
             "recompile_limit_hits": sum(n for msg, n in counters["unimplemented"].items()
                                         if msg.startswith(RECOMPILE_LIMIT)),
             "recompiles": sum(max(len(_debug_get_cache_entry_list(code)) - 1, 0) for code in codes),
             "graph_breaks": sum(counters["graph_break"].values()),
             "eager_fallback": fell_back or failed > 0 or frames["ok"] == 0}
    if failed or check["graph_breaks"]:
        said = [*_given_up, *(_reason(msg) for msg in [*counters["unimplemented"], *counters["graph_break"]]
                              if msg.strip())]
        check["why"] = list(dict.fromkeys(said))[:REASONS_KEPT] or \
            ["Dynamo said nothing it keeps: run again with TORCH_LOGS=graph_breaks,recompiles"]
    return check
