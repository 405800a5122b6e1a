import sys

from megatrain.cli import main
from megatrain.engine.distributed import exit_rank, launched

code = main()
if launched():
    exit_rank(code)  # a torchrun rank skips the interpreter's teardown (megatrain.engine.distributed.exit_rank)
sys.exit(code)
