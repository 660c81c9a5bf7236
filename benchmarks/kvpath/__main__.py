"""`python -m benchmarks.kvpath`: the benchmark without the CLI (a GPU box without vLLM)."""

import argparse
import sys

from benchmarks.kvpath.kvpath import __doc__ as description
from benchmarks.kvpath.kvpath import add_arguments, main

parser = argparse.ArgumentParser(prog="python -m benchmarks.kvpath", description=description)
add_arguments(parser)
sys.exit(main(parser.parse_args()))
