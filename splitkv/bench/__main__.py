"""python -m splitkv.bench: the same as `splitkv bench`."""

import argparse
import sys

from ..cli.bench import add_arguments, run

parser = argparse.ArgumentParser(prog="python -m splitkv.bench", description=__doc__)
add_arguments(parser)
sys.exit(run(parser.parse_args()))
