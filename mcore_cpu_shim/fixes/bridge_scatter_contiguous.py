"""bridge_scatter_contiguous: Megatron-Bridge scatters whole shards to the TP ranks over Gloo.

``MegatronParamMapping.scatter_to_tp_ranks`` (``models/conversion/param_mapping.py``) sends
each tensor-parallel rank its shard of a Hugging Face weight with
``torch.distributed.scatter``. A row-parallel weight (attention ``o_proj``, MLP ``down_proj``)
is split along dimension 1 with ``torch.chunk``, which returns views that are not contiguous,
and Megatron-Bridge 0.3.0 and 0.3.1 scatter those views as they are. Gloo's scatter sends the
bytes from where a view starts, as if it were contiguous (torch 2.13 and 2.14, no error): each
rank gets its shard's first row right and the rest from the wrong columns. A ``--tp 2`` import
then writes a checkpoint whose ``o_proj``/``down_proj`` differ from the source (max abs diff
~0.28 on the test model), silently without ``--verify``. Megatron-Bridge 0.4.0 and later make
every shard contiguous before the scatter.

Fix: as 0.4.0 does, every shard is made contiguous (``.contiguous()``) after its move to the
parameter's device and dtype, on every host (a contiguous shard is left as it is; NCCL is
given the same values as before). The values each rank receives are then its shard's, bit for
bit; the rest of the method is unchanged.
"""

from ..engine import Fix, Target, occurs, rewriting

SHARD = "s.to(device=device, dtype=dtype)"

_rewrite = rewriting(__name__, {SHARD: f"{SHARD}.contiguous()"})

FIX = Fix(
    name="bridge_scatter_contiguous",
    summary="Megatron-Bridge sends each TP rank a contiguous copy of its shard, which Gloo "
    "scatters correctly",
    targets=(
        Target(
            module="megatron.bridge.models.conversion.param_mapping",
            qualname="MegatronParamMapping.scatter_to_tp_ranks",
            known_buggy={"ca0b4e5daa5e963e": "0.3.0, 0.3.1"},
            bug=(SHARD,),
            fixed_by=(f"{SHARD}.contiguous()",),
            replacement=_rewrite,
            drift=_rewrite,
            site=(occurs(SHARD), occurs("torch.distributed.scatter(")),
        ),
    ),
)
