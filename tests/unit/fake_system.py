"""A test-only system that fails on demand, and a `bench` entry point that trains with it.

SPEC is native's SystemSpec built as FailingSystem: one SYSTEMS entry registers it (test_boundaries registers it
under a name of its own). Run as a script with `python -m megatrain bench` arguments (the suite runner's
`bench_command` in tests/unit/test_suite_runner.py): the system registered as 'native' becomes FailingSystem, which
trains like NativeSystem unless the case's seed asks it to fail (every system's options are typed, so a
test cannot add its own). Seeds 102, 103 and 105 fail as the script starts (fail_at_start), the others in the system:
    seed 101: raise a CUDA-style OOM          seed 102: exit without a record
    seed 103: hang                             seed 104: OOM from batch 2 (a batch ladder's ceiling)
    seed 105: be killed by a signal that is not the OOM killer's
    seed 106: be refused by its own pre-flight (memory taken between the suite's check and the case's start)
    seed 107: start a worker process (as compile workers and DeepSpeed do), then hang
    seed 108: start a worker that outlives the case holding its output (DeepSpeed SuperOffload's CPU-Adam process
              after a bench that exits without the interpreter's teardown), then train and end with a record
"""

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

FAILURES = {101: "oom", 102: "crash", 103: "hang", 104: "oom_from_batch_2", 105: "sigterm", 106: "refused",
            107: "worker", 108: "orphan"}


def fail_at_start(argv: list[str]) -> None:
    """The failures the runner sees only as a process ending (or not) without a record, which the bench's code has no
    part in: before torch's import (3-4 s of a CI core a case saved). The others go through the bench."""
    failure = FAILURES.get(int(argv[argv.index("--seed") + 1])) if "--seed" in argv else None
    if failure == "crash":
        print(f"injected crash: exiting without a record\n  File \"{__file__}\", line 1", file=sys.stderr, flush=True)
        os._exit(3)
    if failure == "hang":
        time.sleep(3600)
    if failure == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    fail_at_start(sys.argv)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: make `megatrain` importable
from megatrain.systems import native  # noqa: E402


class FailingSystem(native.NativeSystem):
    def __init__(self, case, *args, **kwargs):
        if FAILURES.get(case.seed) == "refused":  # as megatrain.preflight.preflight refuses, before allocating
            raise ValueError("native tiny b2 s16 does not fit here: host memory: needs 9.0 GiB but 8.9 GiB is usable "
                             "here; try --micro-batch 1")
        super().__init__(case, *args, **kwargs)

    def step(self, inputs_BS, labels_BS):
        failure = FAILURES.get(self.case.seed)
        if failure == "oom" or (failure == "oom_from_batch_2" and self.case.batch >= 2):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        if failure == "worker":  # a worker of the case's own, whose group the runner must take down with it
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)  # fake_system worker"])
            time.sleep(3600)
        if failure == "orphan" and not getattr(self, "orphan", None):  # inherits stdout and stderr, never stopped
            orphan = "import time; time.sleep(3600)  # fake_system orphan"
            self.orphan = subprocess.Popen([sys.executable, "-c", orphan])
        return super().step(inputs_BS, labels_BS)


SPEC = dataclasses.replace(native.SPEC, factory=FailingSystem)


if __name__ == "__main__":
    import megatrain.systems
    from megatrain.cli import main

    megatrain.systems.SYSTEMS["native"] = megatrain.systems.Registered("fake_system:SPEC")
    sys.exit(main(["bench", *sys.argv[1:]]))
