"""local_moe_norm_keys: MoE layers of the local spec write the pre-MLP norm under TE's key.

A checkpoint written on a CPU host comes from the local (non-Transformer-Engine) GPT layer
spec, and must later load into the Transformer Engine (TE) model on a GPU. To make that
possible the local spec renames two norms in its ``sharded_state_dict_keys_map`` to the keys TE
gives them:

- ``input_layernorm.`` -> ``self_attention.linear_qkv.layer_norm_``: TE fuses the input norm
  into ``linear_qkv`` (``TELayerNormColumnParallelLinear``), in dense and MoE layers alike;
- ``pre_mlp_layernorm.`` -> ``mlp.linear_fc1.layer_norm_``: right for a dense layer, where TE
  fuses the pre-MLP norm into ``mlp.linear_fc1``. In a MoE layer TE has no ``linear_fc1`` to
  fuse it into: its spec builds ``pre_mlp_layernorm=TENorm if num_experts else IdentityOp``,
  and the norm is saved standalone as ``pre_mlp_layernorm.weight`` (``.bias``).

Every release from 0.13 to 0.19 applies the second entry to MoE layers too, so a local MoE
checkpoint stores the pre-MLP norm as ``decoder.layers.mlp.linear_fc1.layer_norm_weight``: the
TE MoE model asks for ``decoder.layers.pre_mlp_layernorm.weight`` and the load fails with a
missing key (and the norm weights of a mixed dense/MoE model would collide under one key).

Fix: the local spec keeps the ``pre_mlp_layernorm.`` entry only where TE fuses that norm, i.e.
exactly where TE's spec has no standalone one (``not num_experts``, TE's own test). Dense
layers keep the fused key; ``input_layernorm.`` stays mapped everywhere. Nothing but the keys
map changes: the modules, their ``state_dict()`` and the dense checkpoint layout stay as before.

Where: 0.13 … 0.16 build the map in ``get_gpt_layer_local_spec``; 0.17 on in
``get_gpt_layer_local_submodules``, which ``get_gpt_layer_local_spec`` wraps. The decoder block
spec (``get_gpt_decoder_block_spec``, which builds a dense and a MoE spec from
``config.num_moe_experts`` and picks per layer by ``moe_layer_freq``) calls those functions
through the module, so it gets the fixed map too. The replacement calls the original and drops
the entry from the map of the result it returns; the multi-latent-attention branch has no map
and is returned as is.

On code that differs from every known release (drift), the same wrapper runs (it does not
depend on the body); the site checks make sure the builder still takes ``num_experts`` and
builds one keys map with the entry.
"""

import inspect

from ..engine import Fix, Target, occurs, takes

PRE_MLP_NORM = "pre_mlp_layernorm."


def _without_moe_norm_mapping(submodules):
    keys_map = dict(submodules.sharded_state_dict_keys_map)
    keys_map.pop(PRE_MLP_NORM, None)
    submodules.sharded_state_dict_keys_map = keys_map


def _local_builder(submodules_of):
    """A replacement factory for a local-spec builder; ``submodules_of`` finds the
    ``TransformerLayerSubmodules`` in what the builder returns."""

    def replacement(original, module):
        signature = inspect.signature(original)

        def build(*args, **kwargs):
            result = original(*args, **kwargs)
            if signature.bind(*args, **kwargs).arguments.get("num_experts"):
                _without_moe_norm_mapping(submodules_of(result))
            return result

        return build

    return replacement


# Normalised source (ast.unparse quotes strings with ').
FEATURE = "'input_layernorm.': 'self_attention.linear_qkv.layer_norm_'"
BUG = ("'pre_mlp_layernorm.': 'mlp.linear_fc1.layer_norm_'",)
SITE = (takes("num_experts"), occurs(BUG[0]), occurs("sharded_state_dict_keys_map="))

FIX = Fix(
    name="local_moe_norm_keys",
    summary="local-spec MoE layers save pre_mlp_layernorm standalone, as Transformer Engine does",
    targets=(
        Target(
            module="megatron.core.models.gpt.gpt_layer_specs",
            qualname="get_gpt_layer_local_spec",
            known_buggy={"d4d94859ce135f36": "0.13.1-0.15.3", "9c853cae2c4463b8": "0.16.1"},
            bug=BUG,
            # 0.17 on: a thin wrapper around get_gpt_layer_local_submodules, no map of its own.
            feature=FEATURE,
            replacement=_local_builder(lambda spec: spec.submodules),
            site=SITE,
        ),
        Target(
            module="megatron.core.models.gpt.gpt_layer_specs",
            qualname="get_gpt_layer_local_submodules",
            known_buggy={"50d9470e602178d9": "0.17.1-0.19.2"},
            bug=BUG,
            feature=FEATURE,
            absent_in="0.13-0.16",
            replacement=_local_builder(lambda submodules: submodules),
            site=SITE,
        ),
    ),
)
