"""bridge_local_experts: Megatron-Bridge maps the experts of many MoE families only in
Transformer Engine's grouped form, which a host without TE does not build.

A model bridge lists its weight mappings in a ``MegatronMappingRegistry``. For the routed
experts several families give only the grouped-GEMM names TE's ``TEGroupedMLP`` has
(``decoder.layers.*.mlp.experts.linear_fc1.weight*``, the expert's number at the end), not
megatron-core's ``SequentialMLP`` names (``...mlp.experts.local_experts.*.linear_fc1.weight``),
the expert layer of the local layer spec: what a host without a usable TE builds (see
``bridge_local_layers``), and any model without ``moe_grouped_gemm``. Such a model has
parameters no mapping names, and the import stops (0.3.1, DeepSeek-V3: "AttributeError:
'NoneType' object has no attribute 'megatron_module'"). Megatron-Bridge 0.3.1: DeepSeek-V2/V3 and Kimi (``deepseek/common.py``),
GLM-4.5 and GLM-4.5V, OLMoE, Qwen3-Next; main 067f987d has the local names for DeepSeek but
not for OLMoE, MiniMax-M2, MiMo-V2-Flash, Sarvam, Bailing-MoE-2 and EXAONE-MoE. Qwen3-MoE,
GPT-OSS and Nemotron-H list both forms already.

Fix: the registry gets, for each grouped expert mapping of a plain kind (``AutoMapping``,
``GatedMLPMapping``) whose local twin is not listed, the same mapping under the
``local_experts.*`` name: the same Hugging Face tensors, the wildcards in the same order (layer,
expert). Mappings of other kinds (Qwen3-VL's, and on main the fused or stacked expert layouts of
GLM-4.5, Gemma 4 and Step-3.5 under transformers 5) are left as they are. The
twins are added after the bridge's own mappings, so every name the bridge maps resolves as
before, and a GPU conversion with TE's grouped experts is unchanged. The expert numbers of the
local names under expert parallelism are ``bridge_expert_names``'s part.
"""

import re

from ..engine import Fix, Target, occurs

GROUPED = re.compile(r"^(?P<experts>.*\.experts)\.linear_fc(?P<n>[12])\.weight\*$")
# What patches/bridge/0005 calls in MegatronMappingRegistry.__init__.
ADDS_TWINS = "self._add_local_expert_mappings()"


def local_twins(mappings):
    """The ``local_experts.*`` mappings ``mappings`` lack for their grouped expert mappings."""
    from megatron.bridge.models.conversion.param_mapping import AutoMapping, GatedMLPMapping

    listed = {mapping.megatron_param for mapping in mappings}
    twins = []
    for mapping in mappings:
        found = GROUPED.match(mapping.megatron_param)
        if found is None:
            continue
        twin = f"{found['experts']}.local_experts.*.linear_fc{found['n']}.weight"
        if twin in listed:
            continue
        if type(mapping) is GatedMLPMapping:
            twins.append(GatedMLPMapping(twin, mapping.hf_param["gate"], mapping.hf_param["up"]))
        elif type(mapping) is AutoMapping:
            twins.append(AutoMapping(twin, mapping.hf_param, permute_dims=mapping.permute_dims))
        else:
            continue
        listed.add(twin)
    return twins


def _with_twins(original, module):
    def __init__(self, *mappings, **kwargs):
        return original(self, *mappings, *local_twins(mappings), **kwargs)

    return __init__


FIX = Fix(
    name="bridge_local_experts",
    summary="Megatron-Bridge maps the experts of SequentialMLP (local MoE layers) wherever a "
    "bridge maps only TE's grouped experts",
    targets=(
        Target(
            module="megatron.bridge.models.conversion.mapping_registry",
            qualname="MegatronMappingRegistry.__init__",
            known_buggy={"af93e13317e777de": "0.3.0, 0.3.1", "b093ff96af300a05": "0.6.0 … main 067f987d (2026-08-22)"},
            bug=("self.mappings = list(mappings)",),
            fixed_by=(ADDS_TWINS,),
            replacement=_with_twins,
            whole=True,
            site=(occurs("self.mappings = list(mappings)"),),
        ),
    ),
)
