"""`python -m k31jax.cli ...`: the same as the `k31jax` command."""

import sys

from . import main

sys.exit(main())
