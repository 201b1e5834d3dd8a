"""bridge_yarn_config: a Megatron-Bridge checkpoint keeps its model's YaRN settings.

Megatron-Bridge 0.3.1's ``GPTModelProvider`` has no fields for the YaRN RoPE settings: model
bridges set them as plain attributes (``MegatronModelBridge.provider_bridge`` with ``setattr``
from the HF ``rope_scaling``, ``GPTOSSBridge.provider_bridge`` by assignment), the provider's
``provide()`` reads them, and the checkpoint's ``run_config.yaml``, written from the dataclass
fields, leaves them out. ``load_megatron_model`` (what ``AutoBridge.export_ckpt`` and any
reload use) rebuilds the provider from that file, and its ``provide()`` fails
(``'GPTModelProvider' object has no attribute 'yarn_rotary_scaling_factor'``): a YaRN model
(GPT-OSS, and every HF model with ``rope_scaling.rope_type == "yarn"``) converts to
``torch_dist`` but never back. Not CPU-specific: the same on a GPU host.

Fix: ``to_dict`` writes the YaRN attributes a config holds outside its fields next to the
fields, and ``load_model_config`` gives them back to the provider it instantiates (as
attributes, the way the model bridge set them; Bridge's lenient instantiation would drop them
as unknown keywords). Values are copied as they are, so the reloaded model's rotary embedding
is the one the converted model had.

Megatron-Bridge main declares the settings as fields of ``GPTModelProvider`` (so they are
written and read like any other): upstream-fixed there.
"""


from ..engine import Fix, Target, declares, occurs, rewriting, takes

# The provider attributes model bridges set for YaRN (model_bridge.YARN_ROPE_SCALING_MAPPING
# and GPTOSSBridge.provider_bridge).
YARN = (
    "yarn_rotary_scaling_factor",
    "yarn_original_max_position_embeddings",
    "yarn_beta_fast",
    "yarn_beta_slow",
    "yarn_mscale",
    "yarn_mscale_all_dim",
    "yarn_correction_range_round_to_int",
)
FIELDS = declares("megatron.bridge.models.gpt_provider", "GPTModelProvider", *YARN[:4])
INSTANTIATE = "instantiate(run_config['model'])"


def _extra(value) -> dict:
    """The YaRN attributes ``value`` holds outside its dataclass fields."""
    import dataclasses

    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        return {}
    fields = {f.name for f in dataclasses.fields(value)}
    held = getattr(value, "__dict__", {})
    return {name: held[name] for name in YARN if name in held and name not in fields}


def _to_dict(original, module):
    def to_dict(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        for name, section in result.items():
            extra = _extra(getattr(self, name, None))
            if extra and isinstance(section, dict):
                section.update(extra)
        return result

    return to_dict


def instantiate_provider(instantiate, section):
    """``instantiate(section)``, with the YaRN settings the provider class does not take as
    fields set on the result afterwards."""
    import dataclasses

    section = dict(section)
    extra = {name: section.pop(name) for name in YARN if name in section}
    provider = instantiate(section)
    for name, value in extra.items():
        setattr(provider, name, value)  # a field or not: the value the checkpoint recorded
    return provider


_rewrite = rewriting(
    __name__,
    {INSTANTIATE: "_mcore_cpu_shim.instantiate_provider(instantiate, run_config['model'])"},
)

FIX = Fix(
    name="bridge_yarn_config",
    summary="a Megatron-Bridge checkpoint's run_config.yaml keeps the YaRN settings its model "
    "bridge set, and reloading restores them",
    targets=(
        Target(
            module="megatron.bridge.training.utils.config_utils",
            qualname="_ConfigContainerBase.to_dict",
            known_buggy={"0c9a97fdd4cf82f5": "0.3.1"},
            bug=("dataclass_fields(self)",),
            fixed_by=(FIELDS,),
            absent_in="Megatron-Bridge main, which inherits megatron-core's and declares the fields",
            replacement=_to_dict,
            site=(takes("self"), occurs("dataclass_fields(self)")),
        ),
        Target(
            module="megatron.bridge.training.model_load_save",
            qualname="load_model_config",
            known_buggy={"92d155fac9368ebe": "0.3.1"},
            bug=(INSTANTIATE,),
            fixed_by=(FIELDS,),
            replacement=_rewrite,
            drift=_rewrite,
            site=(occurs(INSTANTIATE),),
        ),
    ),
)
