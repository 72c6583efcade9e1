"""python -m splitkv.bench: the same as `splitkv bench`."""

import sys

from ..cli.args import Parser
from ..cli.bench import add_arguments, run

parser = Parser(prog="python -m splitkv.bench", description=__doc__)
add_arguments(parser)
sys.exit(run(parser.parse_args()))
