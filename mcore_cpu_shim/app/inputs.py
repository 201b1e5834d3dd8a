"""The checks of ``convert``'s input, before any work: folders, config.json, safetensors
headers and the shard index, ``--out`` and the packages the ranks need. Each failure is an
``InputError`` whose message names the problem and the fix (the command exits 2). Nothing here
imports torch."""

import importlib.util
import json
import os
import sys

INSTALL_BRIDGE = "pip install --no-deps megatron-bridge && pip install 'mcore-cpu-shim[bridge]'"


class InputError(Exception):
    """Bad input: the command prints the message and exits 2."""


def positive(text):
    """An option that counts something: a whole number, 1 or more (argparse's ``type``)."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def real_path(path):
    return os.path.realpath(os.path.abspath(os.path.expanduser(path)))


def within(inner, outer):
    """Whether ``inner`` is ``outer`` or below it (both real paths)."""
    return inner == outer or inner.startswith(outer.rstrip(os.sep) + os.sep)


def existing_folder(path, option, what):
    real = real_path(path)
    if not os.path.exists(real):
        raise InputError(f"{option} {path}: no such folder (give {what})")
    if not os.path.isdir(real):
        raise InputError(f"{option} {path} is a file, not a folder (give {what})")
    return real


def read_config(folder, option):
    """The parsed config.json of a Hugging Face model folder."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise InputError(
            f"{option} {folder} has no config.json: not a Hugging Face model folder "
            "(a folder written by save_pretrained or downloaded from the Hub has one)"
        )
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path} cannot be read as JSON ({exc}): copy or download it again") from None
    architectures = config.get("architectures") if isinstance(config, dict) else None
    if not architectures or not isinstance(architectures, list):
        raise InputError(
            f"{path} names no \"architectures\": Megatron-Bridge picks the conversion by it; "
            "add the model class, e.g. \"architectures\": [\"LlamaForCausalLM\"]"
        )
    return config


def safetensors_header(path):
    """``(tensor names, data bytes)`` of a safetensors file; InputError if it is not whole."""
    fix = "copy or download it again"
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise InputError(f"{path} is corrupt: {size} bytes, not even a safetensors header; {fix}")
        length = int.from_bytes(head, "little")
        if length > size - 8:
            raise InputError(f"{path} is corrupt: its header should be {length} bytes, the file has "
                             f"{size - 8} after the length (truncated?); {fix}")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise InputError(f"{path} is corrupt: its header is not valid JSON; {fix}") from None
    if not isinstance(header, dict):
        raise InputError(f"{path} is corrupt: its header is not a table of tensors; {fix}")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    try:
        needed = max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        raise InputError(f"{path} is corrupt: its header has a tensor without valid data offsets; {fix}") from None
    have = size - 8 - length
    if have != needed:
        problem = "truncated" if have < needed else "has extra bytes at the end"
        raise InputError(f"{path} is corrupt ({problem}): its header describes {needed} bytes of tensor "
                         f"data, the file holds {have}; {fix}")
    return list(tensors), needed


def check_safetensors(folder, option, required=True):
    """Check every ``*.safetensors`` file (and the shard index) of a model folder; returns
    ``{"files", "tensors", "bytes"}``."""
    names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    index_path = os.path.join(folder, "model.safetensors.index.json")
    weight_map = None
    if os.path.exists(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError):
            raise InputError(f"{index_path} is corrupt (no readable \"weight_map\"): copy or download it again") from None
        absent = sorted(set(weight_map.values()) - set(names))
        if absent:
            raise InputError(f"{folder}: model.safetensors.index.json lists shard(s) that are not there: "
                             f"{', '.join(absent[:5])}; copy or download the missing files")
    if not names:
        if not required:
            return {"files": 0, "tensors": 0, "bytes": 0}
        others = [n for n in os.listdir(folder) if n.endswith((".bin", ".pt", ".pth", ".gguf"))]
        hint = (f" It has {', '.join(sorted(others)[:3])}: load the model with transformers and save it "
                "with save_pretrained(folder, safe_serialization=True) first." if others else "")
        raise InputError(f"{option} {folder} has no *.safetensors weights: the conversion reads "
                         f"safetensors checkpoints.{hint}")
    count, total = 0, 0
    for name in names:
        tensors, size = safetensors_header(os.path.join(folder, name))
        if weight_map is not None:
            stray = [t for t, shard in weight_map.items() if shard == name and t not in tensors]
            if stray:
                raise InputError(f"{os.path.join(folder, name)} lacks tensor(s) the index puts there "
                                 f"(e.g. {stray[0]}): copy or download it again")
        count, total = count + len(tensors), total + size
    return {"files": len(names), "tensors": count, "bytes": total}


def check_quantization(config, folder):
    """The quantization of a model to import (None or ``"mxfp4"``); InputError for one this
    conversion cannot read exactly."""
    from .quantized import quant_method

    method = quant_method(config)
    path = os.path.join(folder, "config.json")
    redo = "dequantize it first (load it with transformers and save_pretrained it in bfloat16)"
    if method is None:
        return None
    if method == "mxfp4":
        if config.get("architectures") != ["GptOssForCausalLM"]:
            raise InputError(f"{path}: MXFP4 weights convert for GPT-OSS (GptOssForCausalLM), not "
                             f"{config.get('architectures')}: {redo}")
        return method
    if method == "fp8":
        quantization = config["quantization_config"]
        block = quantization.get("weight_block_size") or [128, 128]
        if quantization.get("fmt", "e4m3") != "e4m3" or len(block) != 2:
            raise InputError(f"{path}: FP8 as fmt {quantization.get('fmt')!r} with weight_block_size {block} is "
                             f"not a layout this conversion reads (it reads e4m3 with 2-D blocks): {redo}")
        return method
    raise InputError(f"{path}: quant_method {method!r} is not a layout this conversion reads (it reads "
                     f"unquantized safetensors and GPT-OSS's MXFP4): use the unquantized model, or {redo}")


def check_room(out, needed, what):
    """InputError unless the file system of ``out``'s folder has ``needed`` bytes free."""
    import shutil

    from .launch import size_text

    free = shutil.disk_usage(os.path.dirname(out)).free
    if free < needed:
        raise InputError(f"--out {out}: {what} need about {size_text(needed)}, its file system has "
                         f"{size_text(free)} free; free some space or give another --out")


def check_megatron(path):
    real = existing_folder(path, "--megatron", "the folder `convert import --out` wrote")
    candidates = [real] + sorted(
        os.path.join(real, n) for n in os.listdir(real)
        if n.startswith("iter_") and os.path.isdir(os.path.join(real, n))
    )
    if not any(os.path.isfile(os.path.join(c, "run_config.yaml")) for c in candidates):
        raise InputError(
            f"--megatron {path} is not a Megatron-Bridge checkpoint (no run_config.yaml in it or in "
            "an iter_* folder): export reads checkpoints written by `mcore-cpu-shim convert import` "
            "or Megatron-Bridge's save_megatron_model"
        )
    return real


def check_out(path, sources, overwrite):
    """The real path of ``--out``; refuses a non-empty one without ``overwrite`` and anything
    that would write into, or delete, a source folder."""
    out = real_path(path)
    for option, source in sources:
        if out == source:
            raise InputError(f"--out {path} is the {option} folder: give another --out")
        if within(source, out):
            raise InputError(f"--out {path} contains the {option} folder {source}: "
                             "replacing it would delete the source; give another --out")
        if overwrite and within(out, source) and os.path.exists(out):
            raise InputError(f"--out {path} is inside the {option} folder {source}: --overwrite "
                             "would delete part of the source; give another --out")
    if os.path.exists(out):
        if not os.path.isdir(out):
            raise InputError(f"--out {path} is a file: give a folder")
        if os.listdir(out) and not overwrite:
            raise InputError(f"--out {path} exists and is not empty: pass --overwrite to replace it, "
                             "or give another --out")
    try:
        os.makedirs(os.path.dirname(out), exist_ok=True)
    except OSError as exc:
        raise InputError(f"--out {path}: cannot create its parent folder ({exc.strerror or exc})") from None
    return out


def not_installed(module):
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


def check_packages():
    """What the workers need, looked up without importing it."""
    if not_installed("megatron.bridge"):
        raise InputError(
            f"Megatron-Bridge is not installed in this Python ({sys.executable}): install it "
            f"without its GPU-only dependencies, then what the conversion needs: {INSTALL_BRIDGE}"
        )
    missing = [m for m in ("torch", "megatron.core", "transformers", "safetensors") if not_installed(m)]
    if missing:
        raise InputError(f"not installed in this Python ({sys.executable}): {', '.join(missing)}; "
                         f"install them with: pip install 'mcore-cpu-shim[bridge]'")
