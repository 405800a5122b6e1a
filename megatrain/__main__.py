import sys

from megatrain.cli import main

code = main()
if "torch.distributed" in sys.modules:  # a command that never loaded torch is no torchrun rank with process groups
    from megatrain.engine.distributed import exit_rank, launched

    if launched():
        exit_rank(code)  # a torchrun rank skips the interpreter's teardown (megatrain.engine.distributed.exit_rank)
sys.exit(code)
