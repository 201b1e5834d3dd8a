"""The Megatron-Bridge round trip of ``mcore-cpu-shim demo``: one pass, and its workers.

A pass writes a tiny Hugging Face model (``hf_models.write``: ``transformers``, random
weights, no hub), converts it HF -> ``torch_dist`` -> HF with ``mcore-cpu-shim convert``'s own
code, compares every tensor of the result with the original exactly, and compares the CPU
logits of the HF model (``transformers``, float32, eager attention) with those of the megatron
model built from the converted checkpoint, and the exported folder's logits (loaded by
``transformers`` as a user loads it) with the source's, bit for bit. Its workers run in three
groups (``passes``: each started and followed by the launcher, as ``convert`` runs its ranks, in
a folder of its own):

- ``write``: one process writes the HF model;
- ``import``: ``--ranks`` processes run convert's import (``convert_worker.run_import``: Bridge's
  ``AutoBridge`` provider, ``save_megatron_model``) with expert parallelism ``--ep``;
- ``export``: one process runs convert's export (``convert_worker.run_export``:
  ``load_megatron_model``, ``save_hf_pretrained``), then compares the tensors, then the logits.

Every worker is ``python -m <package>.app.demo_bridge SPEC`` (``RANK`` set): ``worker.main``
with this module's ``run``. In the pass with the shim (``strict`` in the spec) each phase runs under
``forbid_cuda()``, so a CUDA call that the code catches and hides still fails it.

Nothing is imported from torch, transformers, megatron or Bridge at module level: the parent
imports this module.
"""

import os
import sys

from . import convert_worker, passes
from .convert_worker import PHASES as CONVERT_PHASES
from .convert_worker import check_comparison, compare
from .quantized import SafetensorsFolder
from .passes import Group
from .worker import VerifyMismatch, directory_size, main

STEPS = (
    "write HF model",
    "import (HF -> torch_dist)",
    "export (torch_dist -> HF)",
    "compare tensors",
    "CPU logits HF vs megatron",
)
# The phases each step is made of: the import and export steps are convert's phases (without
# its verify: the comparison with the written model is the demo's own step).
STEP_PHASES = {
    STEPS[0]: ("write HF model",),
    STEPS[1]: tuple(p for p in CONVERT_PHASES["import"] if p != "verify"),
    STEPS[2]: tuple(p for p in CONVERT_PHASES["export"] if p != "verify"),
    STEPS[3]: ("compare tensors",),
    STEPS[4]: ("CPU logits",),
}
# The worker groups of a pass, in order: (direction, its steps).
GROUPS = (("write", STEPS[:1]), ("import", STEPS[1:2]), ("export", STEPS[2:]))

# The parity bar of the logits: max |megatron - HF| <= PARITY x max |HF|, and the same argmax
# at every position.
PARITY = 1e-4
PARITY_TEXT = "1e-4"
BATCH = 2

# The environment of a group's workers, on top of the pass's. The export group runs the
# megatron forward: megatron-core compiles its fused activations (GPT-OSS's gated quick-GELU
# with per-token router weights, ``jit_fuser``) with torch.compile, and on the CPU TorchInductor
# asks ``torch.cuda.current_device()`` for its cache key (torch/_inductor/codecache.py,
# ``CacheBase.get_system``, which catches the failure): a CUDA call forbid_cuda() counts, which
# on a host with a driver maps it, and a C++ compiler the host may not have. With
# TORCHDYNAMO_DISABLE=1, torch.compile returns those functions as they are: the same code runs
# eagerly.
GROUP_ENV = {"export": {"TORCHDYNAMO_DISABLE": "1"}}

# Demo options -> config fields of the tiny HF model (only the options given are passed on).
CONFIG_FIELDS = {
    "layers": "num_hidden_layers",
    "hidden": "hidden_size",
    "heads": "num_attention_heads",
    "query_groups": "num_key_value_heads",
    "ffn": "intermediate_size",  # a MoE family's: its expert FFN (hf_models.EXPERT_FIELDS)
    "experts": None,  # hf_models.EXPERT_FIELDS
    "topk": "num_experts_per_tok",
    "vocab": "vocab_size",
}


# --- The parent: one pass ---


def overrides(args):
    """The config fields of the tiny model that the demo's size options change."""
    from .hf_models import EXPERT_FIELDS

    names = dict(CONFIG_FIELDS)
    if args.model in EXPERT_FIELDS:
        names["experts"], names["ffn"] = EXPERT_FIELDS[args.model]
    fields = {names[k]: getattr(args, k) for k in names if getattr(args, k) is not None}
    if args.hidden is not None or args.heads is not None:
        fields["head_dim"] = (args.hidden or 64) // (args.heads or 4)
    return fields


def group_spec(direction, args, folder, strict):
    paths = dict(hf=os.path.join(folder, "hf"), megatron=os.path.join(folder, "megatron"),
                 back=os.path.join(folder, "hf-back"))
    common = dict(timeout=args.timeout, strict=strict, verify=False, tp=1)
    if direction == "write":
        return dict(common, direction="write", family=args.model, hf=paths["hf"], overrides=overrides(args),
                    ranks=1, ep=1)
    if direction == "import":
        return dict(common, direction="import", hf=paths["hf"], out=paths["megatron"], dtype=None,
                    ranks=args.ranks, ep=args.ep)
    return dict(common, direction="export", megatron=paths["megatron"], hf_config=paths["hf"],
                out=paths["back"], ranks=1, ep=1, seq_len=args.seq_len, batch=BATCH)


def groups(args, folder, strict):
    """The worker groups of one pass, in order."""
    return [Group(direction, "demo_bridge", group_spec(direction, args, folder, strict), steps,
                  {step: STEP_PHASES[step] for step in steps}, GROUP_ENV.get(direction, {}))
            for direction, steps in GROUPS]


def run_pass(args, label, folder, extra_env, progress):
    """Run the worker groups of one pass (``passes.run_pass``; ``ranks``: the last record of
    every worker)."""
    return passes.run_pass(groups(args, folder, strict=not extra_env), STEPS, label, folder, extra_env,
                           progress, args.timeout)


# --- The workers ---


def write_model(spec, phases):
    phases.start("write HF model")
    import json

    from . import hf_models

    hf_models.write(spec["family"], spec["hf"], **spec["overrides"])
    weights = SafetensorsFolder(spec["hf"])
    with open(os.path.join(spec["hf"], "config.json")) as f:
        config = json.load(f)
    tensors = [weights.get(n) for n in weights.names()]
    phases.end(size=directory_size(spec["hf"]), hf_tensors=len(tensors),
               parameters=sum(t.numel() for t in tensors), dtype=str(tensors[0].dtype).replace("torch.", ""),
               architecture=(config.get("architectures") or ["?"])[0], config=_model_config(config))


def _model_config(config):
    """What the demo says about the model: the fields that make it GPT-OSS-like (or not)."""
    keys = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "num_local_experts", "num_experts_per_tok", "sliding_window",
            "vocab_size", "rope_scaling", "rope_parameters", "layer_types")
    return {k: config[k] for k in keys if config.get(k) is not None}


def compare_tensors(spec, phases):
    """Every tensor of the exported folder against the written one: same names, dtype, shape
    and values (convert's ``compare``)."""
    phases.start("compare tensors")

    exported = SafetensorsFolder(spec["out"])
    facts = compare(((name, exported.get(name)) for name in exported.names()), SafetensorsFolder(spec["hf_config"]))
    check_comparison(facts)
    phases.end(**facts)


def tokens(vocab, batch, seq_len):
    """The fixed token ids both models see."""
    import torch

    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab, (batch, seq_len), generator=generator)


def hf_logits(folder, ids):
    """The HF model's logits: ``transformers``, float32, eager attention, on the CPU."""
    import torch
    import transformers

    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    dtype = {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": torch.float32}
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", **dtype)
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits, model.config


def megatron_logits(spec, ids):
    """The logits of the megatron model built from the converted checkpoint by Bridge
    (``load_megatron_model``, the checkpoint's own run_config.yaml), in float32, on the CPU."""
    import torch
    from megatron.core.tensor_parallel import random

    bridge = convert_worker.bridge_for(convert_worker.auto_bridge(), spec["hf_config"])
    # Megatron's RNG tracker for inference: the local attention forks the tracker around its
    # dropout in every forward; the training tracker keeps CUDA generator states.
    random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    # The checkpoint says bf16 (GPT-OSS's provider forces it); built with bf16 off, Bridge makes
    # the parameters float32 (build_and_load_model) and the bf16 weights load exactly.
    model = convert_worker.load_checkpoint(bridge, spec["megatron"], spec, bf16=False, fp16=False)[0]
    positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    model.eval()
    with torch.no_grad():
        logits = model(ids, positions, None)
    config = model.config
    return logits, {
        "params_dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "window_size": list(config.window_size) if getattr(config, "window_size", None) else None,
    }


def parity(expected, actual):
    """The comparison of two logits tensors ``[batch, seq, vocab]`` (``actual`` may have a
    padded vocabulary): max abs diff, scale, the bar, argmax agreement, first position off."""
    actual = actual[..., : expected.shape[-1]].float()
    if actual.shape != expected.shape:
        raise AssertionError(f"logits of shape {list(actual.shape)}, HF's are {list(expected.shape)}")
    diff = (actual - expected).abs()
    scale = expected.abs().max().item()
    bar = PARITY * scale
    off = (diff > bar).any(dim=(0, 2)).nonzero()
    same_argmax = (actual.argmax(-1) == expected.argmax(-1))
    return dict(
        max_abs_diff=diff.max().item(), scale=scale, bar=bar, parity=PARITY_TEXT,
        argmax_equal=int(same_argmax.sum().item()), positions=same_argmax.numel(),
        first_position_off=int(off[0].item()) if len(off) else None,
        tokens=list(expected.shape[:2]),
    )


def window_note(hf_config, megatron):
    """Where Bridge built another sliding window than the HF model has, say so (Megatron's
    ``window_size=(w, 0)`` lets a token see w before it and itself: HF's ``sliding_window`` is
    w + 1)."""
    window = getattr(hf_config, "sliding_window", None)
    built = megatron.get("window_size")
    if window and built and built[0] != window - 1:
        return (f"; Megatron-Bridge built window_size {tuple(built)} for the HF model's sliding_window "
                f"{window}, which is window_size ({window - 1}, 0)")
    return ""


def cpu_logits(spec, phases):
    phases.start("CPU logits")
    ids = tokens(_vocab(spec["hf_config"]), spec["batch"], spec["seq_len"])
    expected, hf_config = hf_logits(spec["hf_config"], ids)
    # The exported folder as its users load it: transformers, from its own config.json. Its
    # tensors are the source's, so its logits must be the source's to the bit.
    exported = hf_logits(spec["out"], ids)[0]
    actual, megatron = megatron_logits(spec, ids)
    facts = dict(parity(expected, actual), megatron=megatron, dtype="float32",
                 sliding_window=getattr(hf_config, "sliding_window", None),
                 export_logits_equal=bool(exported.shape == expected.shape and exported.equal(expected)))
    problems = []
    if exported.shape != expected.shape:
        problems.append(f"transformers' logits of the exported folder have shape {list(exported.shape)}, "
                        f"the source's {list(expected.shape)}")
    elif not facts["export_logits_equal"]:
        problems.append("transformers' logits of the exported folder differ from the source's (max abs diff "
                        f"{(exported - expected).abs().max().item():.2e})")
    if not facts["max_abs_diff"] <= facts["bar"]:  # NaN fails too
        problems.append(f"max abs diff {facts['max_abs_diff']:.2e} > {PARITY_TEXT} x scale {facts['scale']:.2e}"
                        f" = {facts['bar']:.2e}, from position {facts['first_position_off']} on")
    if facts["argmax_equal"] != facts["positions"]:
        problems.append(f"argmax equal at {facts['argmax_equal']}/{facts['positions']} positions")
    if problems:
        raise VerifyMismatch("logits differ: " + "; ".join(problems) + window_note(hf_config, megatron), facts)
    phases.end(**facts)


def _vocab(folder):
    import json

    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)["vocab_size"]


def run(spec, rank, phases):
    if spec["direction"] == "write":
        write_model(spec, phases)
    elif spec["direction"] == "import":
        convert_worker.run_import(spec, rank, phases)
    else:
        convert_worker.run_export(spec, rank, phases)
        compare_tensors(spec, phases)
        cpu_logits(spec, phases)


if __name__ == "__main__":
    main(sys.argv[1], int(os.environ["RANK"]), run)
