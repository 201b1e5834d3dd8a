"""What one conversion is, wherever its ranks run (started by ``convert``'s launcher or by
torchrun): its arguments and folders checked into the spec the ranks run, the lines that
describe it, and what becomes of ``--out`` when it ends. Nothing here imports torch."""

import os
import shutil
import tempfile

from . import launch
from .inputs import (
    InputError,
    check_megatron,
    check_out,
    check_packages,
    check_quantization,
    check_room,
    check_safetensors,
    existing_folder,
    read_config,
)


def check(args, world=None):
    """Check the arguments and folders; returns the spec for the ranks (without the paths of
    this run's own files). ``world``: the number of ranks torchrun started (None: convert
    starts ``--ranks`` itself)."""
    if args.direction == "import":
        parallel = f"--tp {args.tp} x --pp {args.pp} x --ep {args.ep}" if args.pp > 1 else f"--tp {args.tp} x --ep {args.ep}"
        model = args.tp * args.pp * args.ep  # (experts: EP within the data-parallel ranks of a stage)
        if world is None:
            ranks = args.ranks or model
            if ranks % model:
                raise InputError(f"--ranks {ranks} is not a multiple of {parallel}")
        else:
            ranks = world
            if args.ranks not in (None, world):
                raise InputError(f"--ranks {args.ranks}: under torchrun the ranks are the processes torchrun "
                                 f"started (WORLD_SIZE {world}); leave --ranks out")
            if world % model:
                raise InputError(f"torchrun started {world} process{'es' if world > 1 else ''} (WORLD_SIZE), not a multiple of {parallel}: "
                                 f"start a multiple of {model} in all (--nnodes x --nproc-per-node)")
        hf = existing_folder(args.hf, "--hf", "the Hugging Face model folder: config.json and *.safetensors")
        config = read_config(hf, "--hf")
        method = check_quantization(config, hf)
        source = check_safetensors(hf, "--hf")
        out = check_out(args.out, [("--hf", hf)], args.overwrite)
        check_stages(config, args.pp, args.vpp)
        spec = dict(hf=hf, dtype=args.dtype, tp=args.tp, pp=args.pp, ep=args.ep, ranks=ranks)
        if args.vpp > 1:
            spec["vpp"] = args.vpp
        if method == "fp8":  # dequantized into a folder next to --out first (run() makes it)
            check_room(out, 4 * source["bytes"], "the dequantized copy of the FP8 source and the checkpoint")
            spec["dequantize"] = True
    else:
        megatron = check_megatron(args.megatron)
        hf = existing_folder(args.hf_config, "--hf-config", "the original Hugging Face model folder, or one with its config.json")
        config = read_config(hf, "--hf-config")
        check_safetensors(hf, "--hf-config", required=False)
        source = None
        out = check_out(args.out, [("--megatron", megatron), ("--hf-config", hf)], args.overwrite)
        spec = dict(megatron=megatron, hf_config=hf, ranks=world or 1, tp=1, ep=1)
    check_packages()
    spec.update(direction=args.direction, out=out, verify=args.verify, timeout=args.timeout)
    return spec, config, source


def check_stages(config, pp, vpp):
    """Virtual pipeline stages: only with pipeline stages, and the layers (``num_hidden_layers``
    of config.json, where it says) split evenly into ``pp x vpp`` model chunks."""
    if vpp == 1:
        return
    if pp == 1:
        raise InputError(f"--vpp {vpp} needs --pp > 1: virtual stages interleave the layers of the pipeline stages")
    layers = config.get("num_hidden_layers", config.get("text_config", {}).get("num_hidden_layers"))
    if isinstance(layers, int) and layers % (pp * vpp):
        fits = [v for v in range(1, layers // pp + 1) if layers % (pp * v) == 0]
        raise InputError(f"config.json has {layers} layers, not a multiple of --pp {pp} x --vpp {vpp} = {pp * vpp}: "
                         f"with --pp {pp}, --vpp {' or '.join(map(str, fits)) or '1'} would fit")


def facts_line(facts):
    versions = [f"{name} {facts[key]}" for name, key in (("megatron-core", "megatron_core"),
                ("Megatron-Bridge", "megatron_bridge"), ("torch", "torch")) if facts.get(key)]
    cuda = {True: "yes", False: "no"}.get(facts.get("cuda_initialized"), "unknown")
    return f"{', '.join(versions)}; CUDA initialised: {cuda}"


def describe(spec, source):
    if spec["direction"] == "import":
        stages = f", PP {spec['pp']}" if spec.get("pp", 1) > 1 else ""
        stages += f" x VPP {spec['vpp']}" if spec.get("vpp", 1) > 1 else ""
        parallel = f"{spec['ranks']} rank{'s' if spec['ranks'] > 1 else ''}, TP {spec['tp']}{stages}, EP {spec['ep']}"
        dtype = spec["dtype"] or "the model's dtype"
        weights = f"{source['tensors']} tensors, {launch.size_text(source['bytes'])} in {source['files']} file(s)"
        return f"{spec['hf']} ({weights}) -> {spec['out']} ({parallel}, {dtype})"
    return f"{spec['megatron']} -> {spec['out']} (config and tokenizer from {spec['hf_config']})"


def move_aside(out):
    """Make ``out`` an empty folder; an existing non-empty one (``--overwrite``) is renamed to
    a hidden sibling first and returned, to be deleted on success or put back on failure."""
    backup = None
    if os.path.isdir(out) and os.listdir(out):
        backup = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.replaced-", dir=os.path.dirname(out))
        os.rmdir(backup)
        os.rename(out, backup)
    os.makedirs(out, exist_ok=True)
    return backup


def settle(out, backup, existed, success):
    if success:
        if backup:
            shutil.rmtree(backup, ignore_errors=True)
        return
    shutil.rmtree(out, ignore_errors=True)  # what the failed conversion wrote
    if backup:
        os.rename(backup, out)
    elif existed:
        os.makedirs(out, exist_ok=True)
