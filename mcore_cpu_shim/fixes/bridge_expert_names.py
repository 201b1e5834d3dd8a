"""bridge_expert_names: Megatron-Bridge exports experts of a local (non-TE) MoE layer.

Exporting a MoE model back to Hugging Face, ``MegatronParamMapping.gather_from_ep_ranks``
(``models/conversion/param_mapping.py``) reads the expert's number from the end of the
parameter name, the way Transformer Engine's grouped experts name them
(``experts.linear_fc1.weight3``: ``int(name.split(".weight")[-1])``). megatron-core's
``SequentialMLP``, the expert layer of the local layer spec (what a host without TE builds,
and any model without ``moe_grouped_gemm``), names them ``experts.local_experts.3.linear_fc1.weight``:
the split leaves ``""`` and the export dies (``invalid literal for int() with base 10: ''``).
Megatron-Bridge 0.3.1; main reads both forms (``extract_expert_number_from_param``).

Fix: the number is read from ``local_experts.<N>.`` where the name has it, else from the end
of the name as before. TE names give the same number as before, so a GPU export is unchanged.
"""

from .._engine import Fix, Target, occurs, rewriting

READ = "int(self.megatron_param.split(key)[-1])"


def expert_number(name: str, key: str) -> int:
    """The expert number in a megatron parameter name, SequentialMLP's or TE's form."""
    import re

    found = re.search(r"\.local_experts\.(\d+)\.", name)
    return int(found.group(1)) if found else int(name.split(key)[-1])


_rewrite = rewriting(
    __import__(__name__, fromlist=["expert_number"]),
    {READ: "_mcore_cpu_shim.expert_number(self.megatron_param, key)"},
)

FIX = Fix(
    name="bridge_expert_names",
    summary="Megatron-Bridge's export reads expert numbers from SequentialMLP parameter names "
    "(local MoE layers) as well as from TE's",
    targets=(
        Target(
            module="megatron.bridge.models.conversion.param_mapping",
            qualname="MegatronParamMapping.gather_from_ep_ranks",
            known_buggy={"0d210fb049f183fa": "0.3.1"},
            bug=(READ,),
            replacement=_rewrite,
            drift=_rewrite,
            site=(occurs(READ),),
        ),
    ),
)
