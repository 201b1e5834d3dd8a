"""``mcore-cpu-shim`` / ``python -m mcore_cpu_shim``: the command line."""

import argparse

from . import demo


def main(argv=None):
    parser = argparse.ArgumentParser(prog="mcore-cpu-shim", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    demo.add_parser(subparsers)
    args = parser.parse_args(argv)
    return args.func(args)
