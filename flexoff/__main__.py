"""`python -m flexoff` (and `torchrun -m flexoff`): the command line."""

import sys

from flexoff.cli import main

sys.exit(main())
