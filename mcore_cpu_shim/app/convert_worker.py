"""One rank of ``mcore-cpu-shim convert``: Megatron-Bridge's public API, phase by phase.

Started by the launcher (``launch.start_ranks``) as ``python -m <package>.app.convert_worker
SPEC`` with ``RANK`` set; the rank's life, its event records and its last facts are
``worker.main``'s. SPEC holds the direction, folders, world, parallelism and timeout.

The conversion itself is Bridge's: ``AutoBridge.from_hf_pretrained``, the model provider
(``to_megatron_provider``, ``provide_distributed_model``, its weight-loading hook),
``save_megatron_model``, ``load_megatron_model``, ``save_hf_pretrained`` and, to verify,
``export_hf_weights``. What this module adds: the Gloo process group (on loopback, with the
parent's timeout on every collective, also in megatron-core's own groups), the phases, and the
tensor-by-tensor comparison.

Nothing is imported from torch, megatron or Bridge at module level: the parent and the tests
import this module for ``PHASES`` and the comparison helpers.
"""

import os
import sys
import time

from .hf_layout import check_complete, check_source, expected_tensors, has_tokenizer, stage_config
from .quantized import COMPLETE, dequantize_folder, source_tensors
from .worker import InputProblem, VerifyMismatch, directory_size, init_gloo, main, timeout_minutes

PHASES = {
    "import": ("load HF", "build model", "copy weights", "save", "verify"),
    "export": ("load HF config", "load Megatron", "save HF", "verify"),
}


def phases_of(spec):
    """The phases a conversion of ``spec`` runs, in order (verify only when asked for; an FP8
    source is dequantized once it is read and checked)."""
    phases = [p for p in PHASES[spec["direction"]] if p != "verify" or spec.get("verify")]
    if spec.get("dequantize"):
        phases.insert(1, "dequantize")
    return tuple(phases)


# --- Reading safetensors and comparing tensors ---


def compare(exported, expected, dtype=None):
    """Compare the ``(name, tensor)`` pairs of ``exported`` with the tensors of ``expected``
    (a ``SafetensorsFolder``): same dtype, same shape and ``torch.equal``; with ``dtype``, the expected tensors are cast
    to it first (a conversion to another dtype). Returns the counts and names:
    ``{"tensors", "equal", "differing", "missing", "unexpected", "how"}`` where ``tensors``
    counts the expected tensors, ``missing`` are expected ones that were never exported,
    ``unexpected`` exported ones that are not expected, and ``how`` says by how much the
    worst of the differing ones differ (max abs diff, or their dtypes or shapes)."""
    import torch

    names = set(expected.names())
    seen, differing, unexpected, how = set(), [], [], {}
    for name, tensor in exported:
        if name not in names:
            unexpected.append(name)
            continue
        if name in seen:
            continue
        seen.add(name)
        want = expected.get(name)
        if dtype is not None and want.dtype.is_floating_point:
            want = want.to(dtype)
        tensor = tensor.detach().cpu()
        # torch.equal compares values across dtypes: the dtype must match as well
        if tensor.dtype != want.dtype:
            how[name] = f"dtype {str(tensor.dtype).replace('torch.', '')}, the reference's {str(want.dtype).replace('torch.', '')}"
        elif tensor.shape != want.shape:
            how[name] = f"shape {list(tensor.shape)}, the reference's {list(want.shape)}"
        elif not torch.equal(tensor, want):
            how[name] = (tensor.double() - want.double()).abs().max().item()
        if name in how:
            differing.append(name)
    missing = sorted(names - seen)
    # By how much (the ten largest value differences, then the dtype and shape ones).
    worst = sorted((n for n in how if isinstance(how[n], float)), key=lambda n: -how[n])[:10]
    worst += sorted(n for n in how if not isinstance(how[n], float))[: 10 - len(worst)]
    return {
        "tensors": len(names),
        "equal": len(seen) - len(differing),
        "differing": sorted(differing),
        "missing": missing,
        "unexpected": sorted(unexpected),
        "how": {n: how[n] for n in worst},
    }


def check_comparison(facts):
    """Raise ``VerifyMismatch`` unless every expected tensor was exported equal."""
    problems = []
    for key, text in (("differing", "differ"), ("missing", "missing from the export"),
                      ("unexpected", "exported but not in the reference")):
        if facts[key]:
            problems.append(f"{len(facts[key])} {text} (e.g. {', '.join(facts[key][:3])})")
    for name, how in list(facts.get("how", {}).items())[:3]:
        problems.append(f"{name}: " + (f"max abs diff {how:.3e}" if isinstance(how, float) else how))
    if problems or facts["tensors"] == 0:
        summary = f"{facts['equal']}/{facts['tensors']} tensors equal"
        raise VerifyMismatch(f"{summary}: {'; '.join(problems) or 'nothing to compare'}", facts)


# --- The conversion ---


def auto_bridge():
    try:
        from megatron.bridge import AutoBridge
    except ImportError as exc:
        raise ImportError(f"cannot import Megatron-Bridge: {type(exc).__name__}: {exc}") from exc
    return AutoBridge


def _first_line(exc):
    lines = [line.strip(" ✗\t") for line in str(exc).splitlines() if line.strip(" ✗\t")]
    return lines[0] if lines else type(exc).__name__


def bridge_for(AutoBridge, folder, **kwargs):
    """``AutoBridge.from_hf_pretrained(folder)``, after checking with ``from_hf_config`` that
    Bridge can convert the model at all: a config it rejects is an ``InputProblem``."""
    import transformers

    config_file = os.path.join(folder, "config.json")
    try:
        config = transformers.AutoConfig.from_pretrained(folder)
    except (ValueError, KeyError, OSError) as exc:
        raise InputProblem(f"{config_file}: transformers cannot read this config: {_first_line(exc)}") from exc
    try:
        AutoBridge.from_hf_config(config)
    except ValueError as exc:
        supported = ", ".join(AutoBridge.list_supported_models())
        architectures = getattr(config, "architectures", None)
        raise InputProblem(
            f"{config_file}: Megatron-Bridge cannot convert architectures {architectures}: "
            f"{_first_line(exc)}. This Megatron-Bridge converts: {supported}"
        ) from exc
    return AutoBridge.from_hf_pretrained(folder, **kwargs)


# Routed experts are split between ranks by --ep only, never by --tp (expert tensor parallelism
# 1): megatron-core refuses TP-split experts with biases (GPT-OSS), and a torch_dist checkpoint
# reshards to any expert layout when it is loaded.
EXPERTS_WHOLE = 1


def configure(provider, spec, dtype):
    """The parallelism of this conversion (and ``--dtype``) on a Bridge model provider."""
    import torch

    provider.tensor_model_parallel_size = spec["tp"]
    provider.pipeline_model_parallel_size = spec.get("pp", 1)
    provider.virtual_pipeline_model_parallel_size = spec.get("vpp")  # (set only where > 1)
    provider.expert_model_parallel_size = spec["ep"]
    provider.expert_tensor_parallel_size = EXPERTS_WHOLE
    if dtype is not None:
        provider.params_dtype = dtype
        provider.bf16 = dtype == torch.bfloat16
        provider.fp16 = dtype == torch.float16
    return provider


def load_checkpoint(bridge, folder, spec, **config):
    """A fresh model with the weights of the ``torch_dist`` checkpoint in ``folder``, the way
    ``AutoBridge.export_ckpt`` and any later reload get it: ``load_megatron_model`` rebuilds the
    model from the checkpoint's own ``run_config.yaml`` (on this Gloo group, CPU
    initialisation), with this conversion's parallelism. ``config``: further values to set on
    the config read from the checkpoint (``load_megatron_model`` sets every key of its
    overrides that the config has; e.g. ``bf16=False`` for a float32 model)."""
    overrides = {"tensor_model_parallel_size": spec["tp"], "pipeline_model_parallel_size": spec.get("pp", 1),
                 "virtual_pipeline_model_parallel_size": spec.get("vpp"), "expert_model_parallel_size": spec["ep"],
                 "expert_tensor_parallel_size": EXPERTS_WHOLE, **config}
    return bridge.load_megatron_model(folder, mp_overrides=overrides)


def run_import(spec, rank, phases):
    phases.start("load HF")
    import torch

    AutoBridge = auto_bridge()
    dtype = getattr(torch, spec["dtype"]) if spec.get("dtype") else None
    options = {"torch_dtype": dtype} if dtype else {}
    bridge = bridge_for(AutoBridge, spec["hf"], **options)
    # Before any work: the files hold the model config.json describes (names and shapes).
    check_source(source_tensors(spec["hf"]), expected_tensors(spec["hf"]), spec["hf"])
    hf = spec["hf"]
    if spec.get("dequantize"):
        # No Bridge reads FP8 block scales for every model (0.3.1 for none): rank 0 writes the
        # source dequantized, shard by shard, and every rank converts that copy.
        phases.start("dequantize")
        if rank == 0:
            dequantize_folder(hf, spec["dequantize"])
        while not os.path.exists(os.path.join(spec["dequantize"], COMPLETE)):
            time.sleep(1)  # (the parent stops this rank if rank 0 fails)
        phases.end(**({"size": directory_size(spec["dequantize"])} if rank == 0 else {}))
        hf = spec["dequantize"]
        bridge = bridge_for(AutoBridge, hf, **options)
    init_gloo(spec, rank)

    phases.start("build model")
    provider = configure(bridge.to_megatron_provider(load_weights=True), spec, dtype)
    try:
        provider.finalize()  # megatron-core's config checks
    except (ValueError, AssertionError) as exc:
        if spec["tp"] * spec.get("pp", 1) * spec["ep"] == 1:
            raise
        raise InputProblem(f"megatron-core rejects this model with --tp {spec['tp']} --pp {spec.get('pp', 1)} --ep {spec['ep']}: "
                           f"{_first_line(exc)}") from exc
    # What provide_distributed_model would do, with this conversion's timeout on the groups.
    provider.initialize_model_parallel(seed=0, distributed_timeout_minutes=timeout_minutes(spec))

    def built(model):  # runs before Bridge's own hook, which copies the HF weights in
        phases.start("copy weights")
        return model

    provider.register_pre_wrap_hook(built, prepend=True)
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    if phases.current == "build model":  # no pre-wrap hook ran: the copy happened in the build
        phases.start("copy weights")

    phases.start("save")
    # As import_ckpt, with the tokenizer recorded in the checkpoint, where the folder has one.
    tokenizer = hf if has_tokenizer(hf) else None
    bridge.save_megatron_model(model, spec["out"], hf_tokenizer_path=tokenizer, low_memory_save=True)
    del model
    torch.distributed.barrier()
    phases.end(**({"size": directory_size(spec["out"])} if rank == 0 else {}))

    if spec.get("verify"):
        phases.start("verify")
        fresh = load_checkpoint(bridge, spec["out"], spec)
        verify(bridge, fresh, spec["hf"], rank, phases, dtype)


def run_export(spec, rank, phases):
    phases.start("load HF config")
    AutoBridge = auto_bridge()
    # The tensors to write come from the architecture of --hf-config's config.json, not from
    # the names in its files (an MXFP4 source names *_blocks/*_scales; a config-only folder
    # none): Bridge reads a staged copy whose index lists exactly them.
    expected = expected_tensors(spec["hf_config"])
    bridge = bridge_for(AutoBridge, stage_config(spec["hf_config"], os.path.join(spec["events"], f"hf-config{rank}"),
                                                 expected))
    init_gloo(spec, rank)
    from megatron.core import parallel_state

    # What Bridge's export_ckpt does (its temporary_distributed_context), on this group.
    parallel_state.initialize_model_parallel(distributed_timeout_minutes=timeout_minutes(spec))

    phases.start("load Megatron")
    model = load_checkpoint(bridge, spec["megatron"], spec)

    phases.start("save HF")
    if not has_tokenizer(spec["hf_config"]):
        # save_hf_pretrained saves the tokenizer with the model, and loading one the folder does
        # not have fails: there is none to save (Bridge's public setter; the rest as it does).
        bridge.hf_pretrained.tokenizer = None
    # strict=False writes a shard even where the model yields fewer tensors than the index
    # lists, and skips a tensor the index does not list: check_complete is the check (every
    # tensor of the architecture, nothing else, each in its shape), before anything is kept.
    bridge.save_hf_pretrained(model, spec["out"], show_progress=False, strict=False)
    if rank == 0:
        complete = check_complete(spec["out"], expected)
        phases.end(size=directory_size(spec["out"]), expected=complete["expected"])
    else:
        phases.end()

    if spec.get("verify"):
        phases.start("verify")
        verify(bridge, model, spec["out"], rank, phases, None)


def verify(bridge, model, reference, rank, phases, dtype):
    """Export ``model``'s weights with Bridge and compare them with the model in the folder
    ``reference`` on rank 0 (the other ranks take part in the gathers): its tensors, dequantized
    by this project's own decoding where the folder is quantized (``quantized.source_tensors``)."""
    exported = bridge.export_hf_weights(model, cpu=True, show_progress=False)
    if rank != 0:
        for _ in exported:
            pass
        phases.end()
        return
    facts = compare(exported, source_tensors(reference), dtype=dtype)
    check_comparison(facts)
    phases.end(**facts)


def run(spec, rank, phases):
    """The conversion the spec's direction names."""
    (run_import if spec["direction"] == "import" else run_export)(spec, rank, phases)


if __name__ == "__main__":
    main(sys.argv[1], int(os.environ["RANK"]), run)
