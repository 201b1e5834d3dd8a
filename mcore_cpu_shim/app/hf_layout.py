"""What a Hugging Face model folder of a given config must hold, and the check that an export
holds exactly that.

Megatron-Bridge's ``save_hf_pretrained`` writes the tensors its mappings yield into the
sharding of the ``--hf-config`` folder's files; with ``strict=False`` (what its own
``export_ckpt`` passes) it skips, with a printed warning, every tensor whose name is not in
those files, and it writes a shard that lacks tensors. So an export can succeed while tensors
are missing: a source whose files hold other names (MXFP4 ``*_blocks``/``*_scales``, where the
export writes the dequantized tensor) loses them all, and transformers later fills what is
missing with random values.

The reference here is the target architecture, not the source's files: the ``transformers``
model built from ``config.json`` on the ``meta`` device (names and shapes, no memory), its
state dict in the layout ``save_pretrained`` writes (transformers 5 reverts its load-time
weight conversions, e.g. fused MoE experts, on save: the same reversal is applied here). The
output embedding of a model with tied embeddings is the input embedding: a folder may hold it
or not (``save_pretrained`` leaves it out). Torch and transformers are imported on first use.
"""

import json
import os
import re
import shutil

from .worker import InputProblem, VerifyMismatch

# What a model folder holds besides its config and tokenizer: not staged for an export.
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".index.json")
SHARD_BYTES = 5 * 1024**3  # as save_pretrained's default max_shard_size, counted in bfloat16


def expected_tensors(folder):
    """``(required, optional)``: ``{name: shape}`` of the tensors a Hugging Face folder of the
    model in ``folder/config.json`` holds; ``optional`` are tied aliases it may leave out."""
    import torch
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(folder)
    except (ValueError, KeyError, OSError) as exc:
        first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise InputProblem(f"{os.path.join(folder, 'config.json')}: transformers cannot read this config: "
                           f"{first}") from exc
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    state = model.state_dict(keep_vars=True)
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: the state dict is what save_pretrained writes
        pass
    else:
        state = revert_weight_conversion(model, state)
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_save", None) or ()]
    shapes, first_of = {}, {}
    optional = {}
    for name, tensor in state.items():
        if any(p.search(name) for p in ignored):
            continue
        if id(tensor) in first_of:  # the same tensor under a second name: tied
            optional[name] = tuple(tensor.shape)
            continue
        first_of[id(tensor)] = name
        shapes[name] = tuple(tensor.shape)
    output = model.get_output_embeddings() if getattr(config, "tie_word_embeddings", False) else None
    if output is not None:
        for name, module in model.named_modules():
            if module is output and f"{name}.weight" in shapes:
                optional[f"{name}.weight"] = shapes.pop(f"{name}.weight")
    return shapes, optional


def check_source(source, expected, folder):
    """Raise ``InputProblem`` where the model in ``folder`` (``source``: its tensors as
    ``quantized.source_tensors`` reads them) lacks a tensor of the architecture its config.json
    describes (``expected``), or holds one in another shape: the conversion would fail later,
    or convert another model than the config says. Tensors beyond the architecture (e.g.
    DeepSeek-V3's multi-token-prediction layer) are left to the converter."""
    required, optional = expected
    names = set(source.names())
    missing = sorted(set(required) - names)
    misshaped = sorted(f"{n} {list(source.shape(n))} (config.json: {list(want)})"
                       for n, want in {**required, **optional}.items() if n in names and source.shape(n) != want)
    problems = [f"{len(items)} {what} (e.g. {', '.join(items[:3])})"
                for items, what in ((missing, "missing"), (misshaped, "of another shape than its config.json says"))
                if items]
    if problems:
        raise InputProblem(f"{folder} does not hold the model its config.json describes: {'; '.join(problems)}; "
                           "copy or download the model again, or fix its config.json")


def written_tensors(folder):
    """``{name: shape}`` of the tensors in the ``*.safetensors`` files of ``folder`` (headers
    only)."""
    from safetensors import safe_open

    found = {}
    for file in sorted(n for n in os.listdir(folder) if n.endswith(".safetensors")):
        with safe_open(os.path.join(folder, file), framework="pt") as f:
            for name in f.keys():
                found[name] = tuple(f.get_slice(name).get_shape())
    return found


def stage_config(config_folder, staging, expected):
    """A folder for Bridge's export to read: ``config_folder``'s config (without a
    ``quantization_config``: the export's weights are not quantized), tokenizer and other
    small files, and a ``model.safetensors.index.json`` that puts every tensor of ``expected``
    (``expected_tensors``) into shards of about ``SHARD_BYTES``. Bridge then writes the
    architecture's tensors in that sharding, whatever names the source's own files hold."""
    os.makedirs(staging)
    for name in os.listdir(config_folder):
        path = os.path.join(config_folder, name)
        if os.path.isfile(path) and not name.endswith(WEIGHT_FILES) and name != "config.json":
            shutil.copy2(path, os.path.join(staging, name))
    with open(os.path.join(config_folder, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    with open(os.path.join(staging, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    required, optional = expected
    shards, size = [[]], 0
    for name, shape in {**required, **optional}.items():
        nbytes = 2
        for n in shape:
            nbytes *= n
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map = {}
    for number, names in enumerate(shards, 1):
        file = "model.safetensors" if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        weight_map.update(dict.fromkeys(names, file))
    with open(os.path.join(staging, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    return staging


def check_complete(folder, expected):
    """Raise ``VerifyMismatch`` naming every tensor the export in ``folder`` lacks, holds
    beyond ``expected`` (``expected_tensors``: the architecture), or holds in another shape;
    returns the counts when it holds exactly the architecture's tensors."""
    required, optional = expected
    written = written_tensors(folder)
    missing = sorted(set(required) - set(written))
    extra = sorted(set(written) - set(required) - set(optional))
    misshaped = sorted(f"{n} {list(written[n])} (expected {list(want)})" for n, want in {**required, **optional}.items()
                       if n in written and written[n] != want)
    facts = {"expected": len(required), "written": len(written), "missing": missing, "extra": extra,
             "misshaped": misshaped}
    problems = [f"{len(names)} {what} (e.g. {', '.join(names[:3])})" for names, what in (
        (missing, "missing"), (extra, "not in the architecture"), (misshaped, "of another shape")) if names]
    if problems:
        raise VerifyMismatch(f"the export does not hold the {len(required)} tensors of the model its config.json "
                             f"describes: {'; '.join(problems)}", facts)
    return facts


TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json")


def has_tokenizer(folder):
    """Whether a Hugging Face folder holds a tokenizer (one of its usual files)."""
    return any(os.path.exists(os.path.join(folder, name)) for name in TOKENIZER_FILES)
