"""python -m splitkv.cli: the same as `splitkv`."""

import sys

from . import main

sys.exit(main())
