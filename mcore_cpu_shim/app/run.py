"""``mcore-cpu-shim run -- COMMAND...``: run a program with the shim active in every Python in it.

For scripts one cannot edit (e.g. a Megatron-Bridge conversion example). The command replaces
this process (same pid, signals and exit status) with ``_autoload`` first on PYTHONPATH: its
``sitecustomize`` imports the shim at every Python startup, then runs the ``sitecustomize``
that was there before, if any. Children inherit the environment, so torchrun workers start
with the shim too. Pythons started with ``-I``, ``-E`` or ``-S`` skip PYTHONPATH or site and
run without it.
"""

import os
import sys

from .. import engine

AUTOLOAD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_autoload")


def add_parser(subparsers):
    parser = subparsers.add_parser(
        "run",
        help="run COMMAND with the shim active in it and in every Python it starts",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
        usage="%(prog)s [-h] -- COMMAND [ARG ...]",
    )
    parser.add_argument("command", nargs="+", metavar="COMMAND", help="the program and its arguments")
    parser.set_defaults(func=run_command, parser=parser)


def environment(base=None):
    """``base`` (default: this process's environment) with the shim's autoload in front."""
    env = dict(os.environ if base is None else base)
    folder = os.path.dirname(os.path.dirname(AUTOLOAD))
    for _ in range(engine.PACKAGE.count(".")):  # a vendored copy: the folder of its top package
        folder = os.path.dirname(folder)
    env["MCORE_CPU_SHIM_AUTOLOAD"] = f"{engine.PACKAGE}:{folder}"
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != AUTOLOAD]
    env["PYTHONPATH"] = os.pathsep.join([AUTOLOAD, *rest])
    return env


def run_command(args):
    command = args.command
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        args.parser.error("COMMAND is missing")  # exits 2
    try:
        os.execvpe(command[0], command, environment())
    except OSError as exc:
        print(f"mcore-cpu-shim run: cannot run {command[0]!r}: {exc.strerror or exc}", file=sys.stderr)
        return 127 if isinstance(exc, FileNotFoundError) else 126
