"""A measurement script's record.json: what was run, with what settings, on which machine and commit.
    python scripts/record_env.py OUT_JSON WHAT COMMAND [KEY=VALUE ...]
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere: this checkout's package
from megatrain.bench.env import environment  # noqa: E402

out, what, command, *pairs = sys.argv[1:]
record = {"what": what, "command": command, **dict(p.split("=", 1) for p in pairs), "env": environment()}
Path(out).write_text(json.dumps(record, indent=1) + "\n")
