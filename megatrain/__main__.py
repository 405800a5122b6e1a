import sys

from megatrain.cli import main

sys.exit(main())
