"""bridge_local_layers: without a usable Transformer Engine, a Bridge provider builds local layers,
and the checkpoint still describes the model as a GPU with TE would build it.

Megatron-Bridge's GPT provider always asks for the TE layer spec
(``gpt_provider.default_layer_spec`` -> ``transformer_engine_layer_spec``, which without TE
fails on names TE would have provided), and model bridges switch on fusions that only exist in
TE: Llama sets ``persist_layer_norm`` and ``apply_rope_fusion``, GPT-OSS ``moe_grouped_gemm``
and ``moe_permute_fusion``. megatron-core's config checks reject those without TE
(``TransformerConfig.__post_init__``, which Bridge runs in ``finalize()``: e.g. "apply_rope_fusion
is not available. Please install TE >= 1.4."). On a CPU-only host (no TE, or TE treated as absent
by the shim's guard) no model can be built. Megatron-Bridge 0.3.1 and main 067f987d.

Fix, only where TE is unusable (no usable CUDA device, or no importable ``transformer_engine``):
- ``transformer_engine_layer_spec(config)`` returns Bridge's own ``local_layer_spec(config)``
  (same modules and parameter names as a local megatron-core model; the checkpoint's keys are
  the same as with TE, the TE-specific extra state aside, which megatron-core's loading of
  ``torch_dist`` tolerates);
- ``finalize()`` switches the TE-only flags off before megatron-core's checks run, with one
  warning per flag and process saying so (the values these flags select are the same math:
  fused and unfused RoPE, permutation and per-expert GEMMs give the same result up to floating
  point order, and conversion copies weights without running them); where CUDA is
  unavailable it also switches off ``moe_shared_expert_overlap`` (DeepSeek-V2/V3: the shared
  expert on a CUDA side stream, which megatron-core's ``SharedExpertMLP`` makes in its
  constructor; without the overlap the shared expert runs in line, the same computation);
- the values the CPU run changed are kept on the provider and written to ``run_config.yaml``
  as they were: the checkpoint says ``transformer_layer_spec: default_layer_spec`` and the
  fusions on, so the GPU side (``load_megatron_model``, training) builds the TE model it would
  have built from a GPU conversion.
Where TE is usable nothing changes.
"""

import importlib.util
import logging

from ..engine import Fix, Target, occurs, takes

logger = logging.getLogger("mcore_cpu_shim")

# TransformerConfig flags that select code only Transformer Engine provides (or, for grouped
# GEMM, TE or the CUDA-only grouped_gemm package).
TE_ONLY = ("persist_layer_norm", "apply_rope_fusion", "moe_grouped_gemm", "moe_permute_fusion")
# Flags that select CUDA-only code, set by DeepSeek-V2/V3's bridges: the shared expert overlapped
# with the token dispatch on a CUDA side stream (megatron-core's SharedExpertMLP makes the stream
# in its constructor), and the weight-gradient accumulation fused in APEX's (or TE's) CUDA
# extension (megatron-core's linear layers refuse to build without it). Off only where CUDA is
# unavailable.
CUDA_ONLY = ("moe_shared_expert_overlap", "gradient_accumulation_fusion")
# Where a provider keeps the values the CPU run changed (not a dataclass field: never copied
# into megatron-core's own config handling, skipped by Bridge's serialisation).
KEPT = "_mcore_cpu_shim_kept"
_told = set()
# What patches/bridge/0003 calls in finalize() (the patched tree switches the flags itself).
FLAGS_OFF = "_disable_te_only_flags(self)"
WRITTEN_BACK = "_te_only_flags_as_configured"  # and where 0003 writes them back


def te_usable() -> bool:
    """Whether this process can use Transformer Engine: a CUDA device and an importable TE (the
    shim's TE guard makes an unusable one unimportable)."""
    import torch

    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def _layer_spec(original, module):
    def transformer_engine_layer_spec(config, *args, **kwargs):
        if te_usable():
            return original(config, *args, **kwargs)
        return module.local_layer_spec(config)

    return transformer_engine_layer_spec


def _finalize(original, module):
    import torch

    def finalize(self, *args, **kwargs):
        if not te_usable():
            _switch_off(self, TE_ONLY, "Transformer Engine")
        if not torch.cuda.is_available():
            _switch_off(self, CUDA_ONLY, "CUDA")
        return original(self, *args, **kwargs)

    return finalize


def _switch_off(provider, flags, needs):
    """Switch ``flags`` off on ``provider``, keeping their values for run_config.yaml; one
    warning per flag and process."""
    kept = provider.__dict__.setdefault(KEPT, {})
    for flag in flags:
        if getattr(provider, flag, False):
            kept.setdefault(flag, getattr(provider, flag))
            setattr(provider, flag, False)
            if flag not in _told:
                _told.add(flag)
                logger.warning(
                    "mcore_cpu_shim: %s=True needs %s, which is unusable here: off for this run "
                    "(the checkpoint's run_config.yaml keeps True)",
                    flag,
                    needs,
                )


def _to_dict(original, module):
    def _convert_value_to_dict(cls, value):
        result = original(cls, value)
        kept = getattr(value, "__dict__", {}).get(KEPT) if not isinstance(value, type) else None
        if kept and isinstance(result, dict):
            result.update((name, v) for name, v in kept.items() if name in result)
        return result

    return _convert_value_to_dict


FIX = Fix(
    name="bridge_local_layers",
    summary="without a usable Transformer Engine a Megatron-Bridge provider builds local "
    "layers with TE-only fusions off; run_config.yaml keeps the GPU configuration",
    targets=(
        Target(
            module="megatron.bridge.models.gpt_provider",
            qualname="transformer_engine_layer_spec",
            known_buggy={"8256d0d0009dae5f": "0.3.1", "d616c7e49f3062f5": "main 067f987d (2026-08-22)"},
            bug=("get_gpt_layer_with_transformer_engine_spec(",),
            fixed_by=("if not is_te_usable():",),  # patches/bridge/0003's own branch
            replacement=_layer_spec,
            site=(takes("config"), occurs("get_gpt_layer_with_transformer_engine_spec(")),
        ),
        *(
            Target(
                module="megatron.bridge.models.transformer_config",
                qualname=f"{config}.finalize",
                known_buggy=known,
                bug=(f"MCore{config}.__post_init__(self)",),
                fixed_by=(FLAGS_OFF,),
                replacement=_finalize,
                site=(occurs(f"MCore{config}.__post_init__(self)"),),
            )
            for config, known in (
                ("TransformerConfig", {"22369e2743215679": "0.3.1", "f9d7d451ebf604cf": "main 067f987d (2026-08-22)"}),
                ("MLATransformerConfig", {"f97e7927bc8e2364": "0.3.1", "b24df07b8eec2749": "main 067f987d (2026-08-22)"}),
                ("HeterogeneousTransformerConfig", {"0a8800bbece15adc": "0.3.1", "4c623916c19e0e91": "main 067f987d (2026-08-22)"}),
            )
        ),
        Target(
            module="megatron.bridge.training.utils.config_utils",
            qualname="_ConfigContainerBase._convert_value_to_dict",
            known_buggy={"98fe55237d6d97ab": "0.3.1", "6d20a16b2fb79146": "main 067f987d (2026-08-22)"},
            bug=("def _convert_value_to_dict(",),
            fixed_by=(WRITTEN_BACK,),
            absent_in="Megatron-Bridge 0.5, whose container is megatron.training's (the next target)",
            replacement=_to_dict,
            whole=True,
            site=(takes("cls", "value"),),
        ),
        # The config container megatron-training has since mid 2026: Bridge 0.5 uses it as it is,
        # Bridge main derives from it (both wrappers write the same values: idempotent).
        Target(
            module="megatron.training.config.container",
            qualname="ConfigContainerBase._convert_value_to_dict",
            known_buggy={"cd5ff91ad4a59d27": "2a75ac12, the commit Megatron-Bridge main pins (2026-08-13)"},
            bug=("def _convert_value_to_dict(",),
            fixed_by=(WRITTEN_BACK,),
            absent_in="megatron trees without megatron.training.config (releases, Bridge 0.3/0.4 pins)",
            replacement=_to_dict,
            whole=True,
            site=(takes("cls", "value"),),
        ),
    ),
)
