"""Where the package and its working files are: the source checkout it runs from, and the workspace that holds
suites/, results/ and reports/ (and the paper's code, .paper/)."""

from __future__ import annotations

import os
from pathlib import Path

_PARENT = Path(__file__).resolve().parents[1]
# the source checkout this package runs from (pyproject.toml beside the package), None for an installed package
CHECKOUT: Path | None = _PARENT if (_PARENT / "pyproject.toml").is_file() else None
# where suites/, results/ and reports/ are: $MEGATRAIN_WORKSPACE, else the checkout, else the current directory
WORKSPACE = Path(os.environ.get("MEGATRAIN_WORKSPACE") or CHECKOUT or Path.cwd()).resolve()
