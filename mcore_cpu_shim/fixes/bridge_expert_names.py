"""bridge_expert_names: Megatron-Bridge numbers the experts of a local (non-TE) MoE layer.

Exporting a MoE model back to Hugging Face, ``MegatronParamMapping.gather_from_ep_ranks``
(``models/conversion/param_mapping.py``) reads the expert's number from the end of the
parameter name, the way Transformer Engine's grouped experts name them
(``experts.linear_fc1.weight3``: ``int(name.split(".weight")[-1])``). megatron-core's
``SequentialMLP``, the expert layer of the local layer spec (what a host without TE builds,
and any model without ``moe_grouped_gemm``), names them ``experts.local_experts.3.linear_fc1.weight``:
the split leaves ``""`` and the export dies (``invalid literal for int() with base 10: ''``).
Megatron-Bridge 0.3.1; main reads both forms (``extract_expert_number_from_param``).

The import side has the same blind spot with expert parallelism: ``_megatron_local_name_to_global``
(``models/conversion/model_bridge.py``) turns a rank's local expert numbers into global ones
only for TE's names, so with ``--ep 2`` every rank loads HF experts 0 … k-1 into its local
``SequentialMLP`` experts (rank 1 gets experts 0 and 1 instead of 2 and 3): a silently wrong
checkpoint. Megatron-Bridge 0.3.1; main renumbers both forms.

Fix: the number is read from ``local_experts.<N>.`` where the name has it, else from the end
of the name as before; and a name with ``local_experts.<N>.`` that the original left alone gets
the global number ``experts per rank * EP rank + N``, as the original gives TE's names. TE names
come out as before, so a GPU conversion is unchanged.
"""


from ..engine import Fix, Target, occurs, rewriting, takes

READ = "int(self.megatron_param.split(key)[-1])"
GROUPED_ONLY = "'.mlp.experts.linear_fc' in param_name"


def expert_number(name: str, key: str) -> int:
    """The expert number in a megatron parameter name, SequentialMLP's or TE's form."""
    import re

    found = re.search(r"\.local_experts\.(\d+)\.", name)
    return int(found.group(1)) if found else int(name.split(key)[-1])


_rewrite = rewriting(
    __name__,
    {READ: "_mcore_cpu_shim.expert_number(self.megatron_param, key)"},
)

def _to_global(original, module):
    import re

    def _megatron_local_name_to_global(models, config, param_name, *args, **kwargs):
        name = original(models, config, param_name, *args, **kwargs)
        if ".experts.local_experts." not in name or ".adapter." in name:
            return name
        group = module.parallel_state.get_expert_model_parallel_group()
        size = module.get_pg_size(group)
        if size <= 1:
            return name
        first = config.num_moe_experts // size * group.rank()
        renumber = lambda found: f".local_experts.{first + int(found.group(1))}."  # noqa: E731
        return re.sub(r"\.local_experts\.(\d+)\.", renumber, name, count=1)

    return _megatron_local_name_to_global


FIX = Fix(
    name="bridge_expert_names",
    summary="Megatron-Bridge numbers the experts of SequentialMLP (local MoE layers) like TE's, "
    "on import with expert parallelism and on export",
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
        Target(
            module="megatron.bridge.models.conversion.model_bridge",
            qualname="_megatron_local_name_to_global",
            known_buggy={"b51930632ac24e3a": "0.3.1"},
            bug=(GROUPED_ONLY,),
            fixed_by=("'.experts.local_experts.'",),
            replacement=_to_global,
            site=(takes("models", "config", "param_name"), occurs(GROUPED_ONLY)),
        ),
    ),
)
