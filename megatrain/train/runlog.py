"""OUT/train.log: every line a run says, as its terminal showed them without the progress bar, appended by each
invocation (a resumed run continues its log)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from pathlib import Path

LOG_FILE = "train.log"


class RunLog:
    """A run's lines: to the terminal through `say`, and to `path` (None: no file, as on ranks other than 0). While a
    progress bar shows the steps (`bar`), a line is written above it (tqdm's external write mode) and the steps' own
    lines go to the file alone."""

    def __init__(self, say: Callable[[str], None], path: Path | None = None):
        self.say, self.bar, self.path = say, None, path
        self.file = None  # opened by the first line

    def __call__(self, line: str) -> None:
        self.to_file(line)
        if self.bar is None:
            self.say(line)
            return
        with self.bar.external_write_mode(file=sys.stderr):  # the bar is cleared, the line said, the bar redrawn
            self.say(line)

    def step(self, line: str) -> None:
        """A step's progress line: the bar shows it on the terminal where there is one."""
        if self.bar is None:
            self(line)
        else:
            self.to_file(line)

    def to_file(self, line: str) -> None:
        """A line the terminal shows by other means (an error the caller prints). A file that cannot take it (a full
        disk) raises an OSError naming it, once: the lines after it go to the terminal alone."""
        if self.path is None:
            return
        try:
            if self.file is None:
                self.file = self.path.open("a", encoding="utf-8")
            self.file.write(line + "\n")
            self.file.flush()  # a kill loses no line said
        except OSError as exc:
            path, self.path, file, self.file = self.path, None, self.file, None
            if file is not None:
                with contextlib.suppress(OSError):  # what it could not write goes with it
                    file.close()
            raise OSError(exc.errno, exc.strerror, str(path)) from None

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
