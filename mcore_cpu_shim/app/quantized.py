"""Quantized Hugging Face checkpoints as vendors publish them, read as the model they describe.

Two layouts, named by ``config.json``'s ``quantization_config.quant_method``:

- ``mxfp4`` (GPT-OSS): each expert weight ``W`` is stored as ``W_blocks`` (uint8, two E2M1
  4-bit values per byte, the low nibble first, 16 bytes = 32 values per block) and
  ``W_scales`` (uint8 E8M0 exponents, one per block): value = E2M1[nibble] x 2^(scale - 127).
  The blocks run along the input dimension, so the decoded tensor is ``[experts, out, in]``:
  transformers' parameter is its transpose, ``[experts, in, out]``.
- ``fp8`` (DeepSeek-V3/R1, Kimi-K2, Qwen3 ``-FP8``): a linear weight ``W`` is float8 e4m3 with a
  float32 ``W_scale_inv`` per 128 x 128 block (``weight_block_size``): value = W x scale_inv
  over its block, cast to the checkpoint's dtype.

``SourceTensors`` presents a folder's tensors under the names and values of the dequantized
model: the reference of ``convert import --verify``. It is this project's own decoding,
independent of Megatron-Bridge's. ``dequantize_folder`` writes an FP8 folder dequantized, shard
by shard, for a Bridge that would load the float8 values without their scales (0.3.1 for every
model, main for most). Torch is imported on first use.
"""

import json
import os
import shutil

SUPPORTED = ("mxfp4", "fp8")
# E2M1: sign, two exponent bits, one mantissa bit; index = the 4-bit code.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def quant_method(config):
    """The ``quant_method`` of a parsed config.json (None for an unquantized model)."""
    quantization = config.get("quantization_config") if isinstance(config, dict) else None
    return (quantization or {}).get("quant_method") if isinstance(quantization, dict) else None


def dequantize_mxfp4(blocks, scales, dtype):
    """The tensor ``[..., rows, blocks x 32]`` that MXFP4 ``blocks`` ``[..., rows, blocks, 16]``
    (uint8) and ``scales`` ``[..., rows, blocks]`` (uint8) hold, in ``dtype``."""
    import torch

    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks of shape {list(blocks.shape)} do not fit scales of shape {list(scales.shape)}")
    table = torch.tensor(E2M1, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # low nibble first
    values = table[codes].reshape(*blocks.shape[:-1], 32)
    exponent = scales.to(torch.int32) - 127
    values = torch.ldexp(values, exponent.unsqueeze(-1).to(torch.float32))
    return values.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32).to(dtype)


def dequantize_fp8(weight, scale_inv, block, dtype):
    """``weight`` (float8) times its per-block ``scale_inv``, blocks of ``block`` =
    ``(rows, columns)``, in ``dtype``."""
    rows, columns = weight.shape
    expanded = scale_inv.repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :columns]
    return (weight.float() * expanded.float()).to(dtype)


class SafetensorsFolder:
    """The tensors of the ``*.safetensors`` files in a folder, read one at a time."""

    def __init__(self, folder):
        from safetensors import safe_open

        self.files, self.shapes = {}, {}
        for name in sorted(os.listdir(folder)):
            if name.endswith(".safetensors"):
                path = os.path.join(folder, name)
                with safe_open(path, framework="pt") as f:
                    for key in f.keys():
                        self.files[key] = path
                        self.shapes[key] = tuple(f.get_slice(key).get_shape())

    def names(self):
        return list(self.files)

    def get(self, name):
        from safetensors import safe_open

        with safe_open(self.files[name], framework="pt") as f:
            return f.get_tensor(name)

    def shape(self, name):
        """The tensor's shape, from its file's header (nothing read)."""
        return self.shapes[name]


class SourceTensors:
    """The tensors of a model folder (``SafetensorsFolder``) under the dequantized model's
    names, each decoded on ``get``: ``W_blocks``/``W_scales`` become ``W`` (transformers'
    layout), ``W``/``W_scale_inv`` become ``W``. ``dtype``: the dequantized tensors' dtype
    (the model's, from config.json)."""

    def __init__(self, folder, config, dtype):
        self.source, self.dtype = SafetensorsFolder(folder), dtype
        self.method = quant_method(config)
        quantization = config.get("quantization_config") or {}
        self.block = tuple(quantization.get("weight_block_size") or (128, 128))
        stored = set(self.source.names())
        self.decoded = {}
        for name in stored:
            if self.method == "mxfp4" and name.endswith("_blocks") and name[: -len("_blocks")] + "_scales" in stored:
                self.decoded[name[: -len("_blocks")]] = "mxfp4"
            elif self.method == "fp8" and name.endswith("_scale_inv") and name[: -len("_scale_inv")] in stored:
                self.decoded[name[: -len("_scale_inv")]] = "fp8"
        parts = {f"{n}_blocks" for n, kind in self.decoded.items() if kind == "mxfp4"}
        parts |= {f"{n}_scales" for n, kind in self.decoded.items() if kind == "mxfp4"}
        parts |= {f"{n}_scale_inv" for n, kind in self.decoded.items() if kind == "fp8"}
        self.plain = sorted(stored - parts - set(self.decoded))

    def names(self):
        return self.plain + sorted(self.decoded)

    def shape(self, name):
        """The dequantized tensor's shape, from the headers (nothing decoded)."""
        kind = self.decoded.get(name)
        if kind == "mxfp4":  # blocks [..., out, groups, 16] -> [..., in = groups x 32, out]
            *outer, out, groups, _ = self.source.shape(f"{name}_blocks")
            return (*outer, groups * 32, out)
        return self.source.shape(name)

    def get(self, name):
        kind = self.decoded.get(name)
        if kind == "mxfp4":
            value = dequantize_mxfp4(self.source.get(f"{name}_blocks"), self.source.get(f"{name}_scales"), self.dtype)
            return value.transpose(-1, -2).contiguous()
        if kind == "fp8":
            return dequantize_fp8(self.source.get(name), self.source.get(f"{name}_scale_inv"), self.block, self.dtype)
        return self.source.get(name)


COMPLETE = ".complete"  # written last into a dequantized folder


def dequantize_folder(folder, staging):
    """Write the FP8 model in ``folder`` to ``staging`` dequantized: each shard in turn (one
    shard's tensors in memory at a time, never the whole model, never in float32), under the
    same file names, without the ``*_scale_inv`` tensors; the index, config (without
    ``quantization_config``) and tokenizer beside them; ``COMPLETE`` last."""
    from safetensors.torch import save_file

    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    source = source_tensors(folder)
    os.makedirs(staging, exist_ok=True)
    by_file = {}
    for name in source.names():
        stored = name if name in source.source.files else f"{name}_scale_inv"
        by_file.setdefault(os.path.basename(source.source.files[stored]), []).append(name)
    for file, names in sorted(by_file.items()):
        save_file({name: source.get(name) for name in names}, os.path.join(staging, file), metadata={"format": "pt"})
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isfile(path) and not name.endswith(".safetensors") and name not in ("config.json",):
            shutil.copy2(path, os.path.join(staging, name))
    index = os.path.join(staging, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            content = json.load(f)
        content["weight_map"] = {k: v for k, v in content["weight_map"].items() if not k.endswith("_scale_inv")}
        with open(index, "w") as f:
            json.dump(content, f, indent=1)
    config.pop("quantization_config", None)
    config["torch_dtype"] = str(source.dtype).replace("torch.", "")
    with open(os.path.join(staging, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    open(os.path.join(staging, COMPLETE), "w").close()
    return staging


def source_tensors(folder):
    """The tensors of the model in ``folder``: a ``SourceTensors`` where its config.json names
    a quantization (dequantized to the dtype it names, ``torch_dtype`` or ``dtype``, else
    bfloat16), else the files' own (``SafetensorsFolder``)."""
    import json

    import torch

    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    if quant_method(config) is None:
        return SafetensorsFolder(folder)
    return SourceTensors(folder, config, getattr(torch, config.get("torch_dtype") or config.get("dtype") or "bfloat16"))
