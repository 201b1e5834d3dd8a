"""``mcore-cpu-shim convert``: Hugging Face <-> Megatron ``torch_dist`` with Megatron-Bridge, on the CPU.

``convert import --hf DIR --out DIR`` writes a Megatron ``torch_dist`` checkpoint of a Hugging
Face model folder (config.json and safetensors); ``convert export --megatron DIR --hf-config DIR
--out DIR`` writes such a checkpoint back as Hugging Face safetensors, with the config and
tokenizer of the ``--hf-config`` folder. The conversion is Megatron-Bridge's own, through its
public API (``AutoBridge``); this command runs it in fresh worker processes with CUDA hidden
(``CUDA_VISIBLE_DEVICES=""``) and the shim active, ``--ranks`` of them in a Gloo group on
loopback, and prints a line per phase. ``--verify`` reloads what was written and compares
every tensor with the source, exactly.

With ``--overwrite`` an existing ``--out`` is moved aside (a hidden folder next to it) and
deleted only once every phase passed: a failed conversion removes what it wrote and puts the old
``--out`` back. A collective
waits at most ``--timeout`` seconds for a peer; when a rank fails or dies the others are
stopped at once and the error of the rank that failed first is shown (rank logs are kept).

Exit status: 0 converted (and verified, with ``--verify``); 1 the conversion or verification
failed; 2 bad input (the message says what and how to fix it). Nothing here imports torch: the
workers do.
"""

import os
import shutil
import signal
import sys
import tempfile

from . import convert_torchrun, launch
from .convert_spec import check, describe, facts_line, move_aside, settle
from .convert_worker import phases_of
from .inputs import InputError, positive

DTYPES = ("bfloat16", "float32", "float16")


def add_parser(subparsers):
    p = subparsers.add_parser(
        "convert",
        help="convert Hugging Face <-> Megatron torch_dist checkpoints with Megatron-Bridge on the CPU",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
    )
    directions = p.add_subparsers(dest="direction", metavar="DIRECTION", required=True)

    imp = directions.add_parser(
        "import",
        help="Hugging Face model folder -> Megatron torch_dist checkpoint",
        description="Convert a Hugging Face model folder (config.json + *.safetensors) into a "
        "Megatron torch_dist checkpoint with Megatron-Bridge, on the CPU.",
    )
    imp.add_argument("--hf", required=True, metavar="DIR", help="the Hugging Face model folder")
    imp.add_argument("--out", required=True, metavar="DIR", help="where to write the Megatron checkpoint")
    imp.add_argument("--dtype", choices=DTYPES, help="parameter dtype of the checkpoint (default: the model's)")
    imp.add_argument("--ranks", type=positive, help="worker processes (default: TP x PP x EP)")
    imp.add_argument("--tp", type=positive, default=1, help="tensor parallelism (default 1)")
    imp.add_argument("--pp", type=positive, default=1, help="pipeline parallelism (default 1)")
    imp.add_argument("--ep", type=positive, default=1, help="expert parallelism (default 1)")
    imp.add_argument("--vpp", type=positive, default=1,
                     help="virtual pipeline stages per pipeline rank (interleaved; needs --pp > 1; default 1)")
    _common(imp)

    exp = directions.add_parser(
        "export",
        help="Megatron torch_dist checkpoint -> Hugging Face safetensors",
        description="Convert a Megatron torch_dist checkpoint written by `convert import` (or by "
        "Megatron-Bridge's save_megatron_model) back into a Hugging Face model folder, on the CPU.",
    )
    exp.add_argument("--megatron", required=True, metavar="DIR", help="the Megatron checkpoint folder")
    exp.add_argument("--hf-config", required=True, metavar="DIR",
                     help="the original Hugging Face model folder, or any folder with its config.json (and tokenizer)")
    exp.add_argument("--out", required=True, metavar="DIR", help="where to write the Hugging Face model")
    _common(exp)
    return p


def _common(p):
    p.add_argument("--verify", action="store_true",
                   help="reload what was written and compare every tensor with the source")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out (never a source folder)")
    p.add_argument("--timeout", type=positive, default=300,
                   help="seconds a rank waits for its peers in a collective (default 300)")
    p.set_defaults(func=run, parser=p)


# --- The run ---


def execute(spec, work, stream=None, command=None):
    """Run the ranks of ``spec`` in ``work`` with progress on ``stream``; returns the
    outcome of ``supervise``."""
    stream = stream or sys.stdout
    ranks = launch.start_ranks(spec, work, "convert_worker", command)
    return launch.supervise(ranks, phases_of(spec), launch.Progress(stream))


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def run(args):
    if convert_torchrun.launched():  # this process is one of the ranks torchrun started
        return convert_torchrun.run(args)
    prog = f"mcore-cpu-shim convert {args.direction}"
    try:
        spec, config, source = check(args)
    except InputError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    out = spec["out"]
    existed = os.path.isdir(out)
    backup = move_aside(out)
    work = tempfile.mkdtemp(prefix="mcore-cpu-shim-convert-")
    if spec.get("dequantize"):  # beside --out, where check_room found the space; removed at the end
        spec["dequantize"] = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.dequantized-", dir=os.path.dirname(out))
    print(f"{prog}: {describe(spec, source)}", flush=True)
    outcome = None
    previous = signal.signal(signal.SIGTERM, _interrupt)  # a SIGTERM stops the ranks as Ctrl-C does
    try:
        outcome = execute(spec, work)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; every rank stopped, {out} left as it was", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        if spec.get("dequantize"):
            shutil.rmtree(spec["dequantize"], ignore_errors=True)
        failure = outcome["failure"] if outcome else {}
        settle(out, backup, existed, success=failure is None)
        if failure is None or failure.get("input") or failure.get("mismatch"):
            shutil.rmtree(work, ignore_errors=True)
    if failure is not None:
        return launch.report_failure(prog, failure, work)
    print(facts_line(outcome["facts"]))
    print(f"done: {out}")
    return 0
