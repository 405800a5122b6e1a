"""A test-only system that fails on demand, and a `bench` entry point that trains with it.

Run as a script with `python -m megatrain bench` arguments (the suite runner's `bench_command` in
tests/unit/test_suite_runner.py): the system registered as 'native' becomes FailingSystem, which
trains like NativeSystem unless the case's options ask it to fail:
    inject_failure = "oom" | "crash" | "hang" | "sigterm"
        (raise CUDA-style OOM, exit without a record, sleep, be killed by a signal that is not the OOM killer's)
    oom_from_batch = N                           (OOM when batch >= N: a batch ladder's ceiling)
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: make `baselines` importable
from baselines.native import NativeSystem  # noqa: E402


class FailingSystem(NativeSystem):
    def step(self, inputs_BS, labels_BS):
        failure = self.case.options.get("inject_failure")
        if failure == "oom" or self.case.batch >= self.case.options.get("oom_from_batch", sys.maxsize):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        if failure == "crash":
            print(f"injected crash: exiting without a record\n  File \"{__file__}\", line 1", file=sys.stderr,
                  flush=True)
            os._exit(3)
        if failure == "hang":
            time.sleep(3600)
        if failure == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        return super().step(inputs_BS, labels_BS)


if __name__ == "__main__":
    import baselines.protocol
    from megatrain.cli import main

    baselines.protocol.SYSTEMS["native"] = "fake_system:FailingSystem"
    sys.exit(main(["bench", *sys.argv[1:]]))
