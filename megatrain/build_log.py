"""The build's lines (logger megatrain.build): each phase of a system's build as it ends, and the host AdamW kernel's
compile, which a fresh machine's first step waits on for minutes. On stderr by default (a suite case cut short keeps
its stderr tail); `build_lines_to(say)` gives them to a caller's log instead (train's run log, the Engine's `log=`)."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable

BUILD_LOG = logging.getLogger("megatrain.build")


class _Say(logging.Handler):
    """Each record to say(line); the default, to the process's stderr of the moment (a test's capture, a pipe)."""

    def __init__(self, say: Callable[[str], None] | None = None):
        super().__init__()
        self.say = say

    def emit(self, record: logging.LogRecord) -> None:
        if self.say is None:
            print(self.format(record), file=sys.stderr, flush=True)
        else:
            self.say(self.format(record))


BUILD_LOG.setLevel(logging.INFO)
BUILD_LOG.propagate = False
if not any(type(h).__name__ == "_Say" for h in BUILD_LOG.handlers):  # once, where this module is imported again
    BUILD_LOG.addHandler(_Say())


@contextlib.contextmanager
def build_lines_to(say: Callable[[str], None]):
    """The build's lines to say(line), and not to stderr, while in the block."""
    handlers = BUILD_LOG.handlers[:]
    BUILD_LOG.handlers = [_Say(say)]
    try:
        yield
    finally:
        BUILD_LOG.handlers = handlers
