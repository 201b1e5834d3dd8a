"""local_moe_norm_keys: a local-spec checkpoint has the norm keys the Transformer Engine model asks for."""


import pytest
from helpers import (
    MCORE_VERSION,
    assert_same_tensors,
    init_gloo,
    needs_unfixed,
    run_without_fix,
    save_and_reload,
    tensors,
    tiny_gpt,
)

FIX = "local_moe_norm_keys"
MODULE = "megatron.core.models.gpt.gpt_layer_specs"
# Where each release builds the local layer's keys map (0.17 on, the spec function wraps the
# submodules function).
BUILDER = "get_gpt_layer_local_submodules" if MCORE_VERSION >= (0, 17) else "get_gpt_layer_local_spec"
# 0.13 refuses biases in MoE layers; without biases the expected layouts below stay short.
NO_BIAS = dict(add_bias_linear=False)
MOE = dict(num_moe_experts=4, **NO_BIAS)

# The checkpoint keys (ShardedTensor keys; `_extra_state` objects aside, their presence in TE
# modules depends on the Transformer Engine release) of one GPT layer as
# get_gpt_layer_with_transformer_engine_spec builds it (…_submodules from 0.17), read off that
# function in each release, with LayerNorm, no biases, no MLA, moe_grouped_gemm=False:
# - linear_qkv is TELayerNormColumnParallelLinear: the input norm is fused into it, in dense
#   and MoE layers alike (input_layernorm is IdentityOp);
# - pre_mlp_layernorm is `backend.layer_norm() if num_experts else IdentityOp` (0.17 on with
#   has_residual=True, which changes no key): a dense layer fuses the pre-MLP norm into
#   mlp.linear_fc1 (TELayerNormColumnParallelLinear), a MoE layer keeps it standalone;
# - MoE experts: SequentialMLP, whose sharded_state_dict stacks the experts under
#   mlp.experts.experts.*; the router is the same TopKRouter as in the local spec.
ATTENTION = {
    "self_attention.linear_qkv.layer_norm_weight",
    "self_attention.linear_qkv.layer_norm_bias",
    "self_attention.linear_qkv.weight",
    "self_attention.linear_proj.weight",
}
TE_DENSE_LAYER = ATTENTION | {
    "mlp.linear_fc1.layer_norm_weight",
    "mlp.linear_fc1.layer_norm_bias",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc2.weight",
}
TE_MOE_LAYER = ATTENTION | {
    "pre_mlp_layernorm.weight",
    "pre_mlp_layernorm.bias",
    "mlp.router.weight",
    "mlp.experts.experts.linear_fc1.weight",
    "mlp.experts.experts.linear_fc2.weight",
}
# Per release (major, minor): (dense layer, MoE layer). The same in every release read so far;
# a release missing here has not been read, and the key tests fail until it is. (0, 20) is
# unreleased megatron-core main and the commit Megatron-Bridge pins (2026-08): their
# get_gpt_layer_with_transformer_engine_submodules is 0.19.2's, unchanged.
TE_LAYOUT = {
    release: (TE_DENSE_LAYER, TE_MOE_LAYER)
    for release in ((0, 13), (0, 14), (0, 15), (0, 16), (0, 17), (0, 18), (0, 19), (0, 20))
}


def te_layout():
    if MCORE_VERSION not in TE_LAYOUT:
        pytest.fail(f"megatron-core {MCORE_VERSION}: read its TE layer spec into TE_LAYOUT first")
    return TE_LAYOUT[MCORE_VERSION]


def checkpoint_keys(model):
    """{checkpoint key of a layer tensor, without 'decoder.layers.' and layer number: the set of
    layer numbers that store a tensor under it}.

    Homogeneous layers share one key with the layer number as the first axis (its offset);
    a mixed dense/MoE block (moe_layer_freq not 1) keeps the number in the key instead.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    layers = {}
    for entry in model.sharded_state_dict().values():
        if not (isinstance(entry, ShardedTensor) and entry.key.startswith("decoder.layers.")):
            continue
        name = entry.key[len("decoder.layers.") :]
        number, _, rest = name.partition(".")
        if number.isdigit():
            layers.setdefault(rest, set()).add(int(number))
        else:
            layers.setdefault(name, set()).add(entry.global_offset[0])
    return layers


def block_gpt(seed, moe_layer_freq):
    """A 2-layer local GPT built through get_gpt_decoder_block_spec (dense and MoE per layer)."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        moe_layer_freq=moe_layer_freq,
        **MOE,
    )
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=16)


@pytest.mark.cuda_hidden
def test_moe_layer_keys_match_the_te_layout(tmp_path, forbid_cuda):
    init_gloo(tmp_path)
    model = tiny_gpt(seed=1, **MOE)
    keys = checkpoint_keys(model)
    assert set(keys) == te_layout()[1]
    assert keys["pre_mlp_layernorm.weight"] == {0, 1}
    # Only the checkpoint key moved: the module and its plain state dict are as before.
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in model.state_dict()


@pytest.mark.cuda_hidden
def test_dense_layer_keys_match_the_te_layout(tmp_path, forbid_cuda):
    init_gloo(tmp_path)
    keys = checkpoint_keys(tiny_gpt(seed=1, **NO_BIAS))
    assert set(keys) == te_layout()[0]
    assert keys["mlp.linear_fc1.layer_norm_weight"] == {0, 1}


@pytest.mark.cuda_hidden
def test_decoder_block_spec_maps_each_layer_by_its_kind(tmp_path, forbid_cuda):
    """moe_layer_freq=[1, 0]: layer 0 is MoE, layer 1 dense; each gets its TE key."""
    init_gloo(tmp_path)
    keys = checkpoint_keys(block_gpt(seed=1, moe_layer_freq=[1, 0]))
    dense, moe = te_layout()
    assert set(keys) == dense | moe
    assert keys["pre_mlp_layernorm.weight"] == {0}
    assert keys["pre_mlp_layernorm.bias"] == {0}
    assert keys["mlp.linear_fc1.layer_norm_weight"] == {1}
    assert keys["mlp.linear_fc1.layer_norm_bias"] == {1}
    assert keys["self_attention.linear_qkv.layer_norm_weight"] == {0, 1}


@pytest.mark.cuda_hidden
def test_spec_builders_keep_everything_but_the_moe_entry():
    from megatron.core.models.gpt import gpt_layer_specs

    fused = {
        "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
        "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
    }
    dense = gpt_layer_specs.get_gpt_layer_local_spec()
    assert dense.submodules.sharded_state_dict_keys_map == fused
    moe = gpt_layer_specs.get_gpt_layer_local_spec(4)  # num_experts given positionally
    assert moe.submodules.sharded_state_dict_keys_map == {
        "input_layernorm.": "self_attention.linear_qkv.layer_norm_"
    }
    # The rest of the spec is untouched: same modules as the dense/MoE spec the original builds.
    assert moe.submodules.pre_mlp_layernorm is dense.submodules.pre_mlp_layernorm
    assert moe.submodules.mlp != dense.submodules.mlp
    # Multi-latent attention layers have no keys map in the local spec; nothing to change.
    mla = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=4, multi_latent_attention=True)
    assert mla.submodules.sharded_state_dict_keys_map == {}


@pytest.mark.cuda_hidden
@pytest.mark.parametrize("moe_layer_freq", [1, [1, 0]], ids=["all-moe", "moe-then-dense"])
def test_round_trip_without_cuda(tmp_path, forbid_cuda, moe_layer_freq):
    import torch
    from megatron.core import dist_checkpointing

    init_gloo(tmp_path)
    model = block_gpt(seed=1, moe_layer_freq=moe_layer_freq)
    fresh = block_gpt(seed=2, moe_layer_freq=moe_layer_freq)
    expected = tensors(model)
    norm = "decoder.layers.0.pre_mlp_layernorm.weight"
    expected[norm].data.uniform_()  # LayerNorm starts at ones in both models: make it differ
    assert not torch.equal(expected[norm], tensors(fresh)[norm])

    save_and_reload(model, fresh, tmp_path / "ckpt")

    assert_same_tensors(expected, tensors(fresh))
    stored = set(dist_checkpointing.load_tensors_metadata(str(tmp_path / "ckpt")))
    if moe_layer_freq == 1:  # homogeneous layers: one key, the layer number as first axis
        assert "decoder.layers.pre_mlp_layernorm.weight" in stored
        assert not any("linear_fc1.layer_norm" in key for key in stored)
    else:  # mixed layers: the layer number in the key
        assert "decoder.layers.0.pre_mlp_layernorm.weight" in stored
        assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in stored
        assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" not in stored
    assert not torch.cuda.is_initialized()


@pytest.mark.cuda_hidden
@needs_unfixed(f"{MODULE}:{BUILDER}")
def test_moe_keys_are_fused_without_the_fix():
    """The key tests above are real checks: unfixed megatron-core writes the fused key."""
    stderr = run_without_fix(
        FIX,
        """
        import mcore_cpu_shim
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        keys_map = get_gpt_layer_local_spec(num_experts=4).submodules.sharded_state_dict_keys_map
        assert "pre_mlp_layernorm." not in keys_map, keys_map
        """,
    )
    assert "AssertionError" in stderr and "mlp.linear_fc1.layer_norm_" in stderr, stderr


@pytest.mark.cuda_visible
@pytest.mark.parametrize("moe_layer_freq", [1, [1, 0]], ids=["all-moe", "moe-then-dense"])
def test_keys_of_a_model_on_the_gpu(tmp_path, moe_layer_freq):
    import torch

    torch.cuda.set_device(0)
    init_gloo(tmp_path)
    model = block_gpt(seed=1, moe_layer_freq=moe_layer_freq).cuda()
    assert next(model.parameters()).is_cuda
    keys = checkpoint_keys(model)
    dense, moe = te_layout()
    assert set(keys) == (moe if moe_layer_freq == 1 else dense | moe)
    assert keys["pre_mlp_layernorm.weight"] == ({0, 1} if moe_layer_freq == 1 else {0})
