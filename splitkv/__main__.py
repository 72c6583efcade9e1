"""python -m splitkv: the same as `splitkv`."""

import sys

from .cli import main

sys.exit(main())
