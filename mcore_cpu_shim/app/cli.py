"""The command line: ``mcore-cpu-shim SUBCOMMAND`` or ``python -m mcore_cpu_shim SUBCOMMAND``.

Each subcommand lives in its own module with ``add_parser(subparsers)``, which adds the
subparser and sets ``func``: a function of the parsed arguments that returns the exit status.
Exit status 2 means bad input: an unknown option, or a bad ``MCORE_CPU_SHIM_*`` value.
"""

import argparse
import sys

from . import convert, demo, doctor, run
from .. import __version__

SUBCOMMANDS = (convert, demo, doctor, run)


def build_parser():
    parser = argparse.ArgumentParser(
        prog="mcore-cpu-shim",
        description="Megatron-Core checkpoint conversion on hosts without a GPU.",
    )
    parser.add_argument("--version", action="version", version=f"mcore-cpu-shim {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in SUBCOMMANDS:
        module.add_parser(subparsers)
    return parser


def main(argv=None) -> int:
    from .. import apply

    args = build_parser().parse_args(argv)  # exits 2 with a usage message on bad options
    try:
        apply()  # again: the package's import let a bad switch value pass for the CLI to say it
    except ValueError as exc:
        print(f"mcore-cpu-shim: error: {exc}", file=sys.stderr)
        return 2
    return args.func(args)
