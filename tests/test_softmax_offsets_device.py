"""softmax_offsets_device: attention softmax offsets built with CUDA absent, and unchanged with CUDA."""


import pytest
from helpers import (
    MCORE_VERSION,
    MODE,
    assert_same_tensors,
    init_gloo,
    needs_unfixed,
    run_without_fix,
    save_and_reload,
    tensors,
    tiny_gpt,
    upstream_fixed,
)

FIX = "softmax_offsets_device"
TARGET = "megatron.core.transformer.dot_product_attention:DotProductAttention.__init__"
OFFSET_TYPES = ["off-by-one", "learnable"]
HEADS = 4

# The state-dict keys of an unpatched DotProductAttention (megatron-core 0.16.1 ... 0.19.2), read
# off its constructor: "off-by-one" keeps its zeros in a plain attribute (nothing in the state
# dict), "learnable" registers the Parameter "softmax_offset". test_state_dict_keys_unchanged
# also checks this against the unpatched constructor itself where the shim holds it.
UNPATCHED_KEYS = {"vanilla": set(), "off-by-one": set(), "learnable": {"softmax_offset"}}

needs_offsets = pytest.mark.skipif(
    MCORE_VERSION < (0, 15), reason="megatron-core < 0.15 has no softmax_type"
)
# 0.15 has softmax offsets but allocates them without naming a device (off-by-one: a plain CPU
# attribute; learnable: an uninitialised CPU Parameter); the fix does not concern it.
needs_fix = pytest.mark.skipif(
    MCORE_VERSION < (0, 16), reason="megatron-core < 0.16 places no softmax offset on a device"
)


def config(softmax_type, **settings):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    values = dict(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=HEADS,
        use_cpu_initialization=True,
        params_dtype=torch.bfloat16,  # not the default dtype: the offset must follow it
        softmax_type=softmax_type,
    )
    values.update(settings)
    return TransformerConfig(**values)


def attention(cfg, init=None):
    """A DotProductAttention for ``cfg``; ``init`` replaces the class's __init__ (the original)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    args = dict(layer_number=2, attn_mask_type=AttnMaskType.causal, attention_type="self")
    if init is None:
        return DotProductAttention(cfg, **args)
    module = DotProductAttention.__new__(DotProductAttention)
    init(module, cfg, **args)
    return module


def unpatched_init():
    """The constructor megatron-core ships, as the shim replaced it (None if it did not)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    init = DotProductAttention.__init__
    return init.__wrapped__ if getattr(init, "__mcore_cpu_shim__", None) else None


def unpatched_on_meta(cfg):
    """Run the unpatched constructor with its device redirected to "meta": no CUDA, no memory.

    It asks torch.cuda.current_device() for the device of the offset; answering "meta" lets the
    real original code run to the end on a host without CUDA and shows what it registers.
    """
    from unittest import mock

    import torch

    with mock.patch.object(torch.cuda, "current_device", lambda: "meta"):
        return attention(cfg, init=unpatched_init())


def sharded_keys(module):
    from megatron.core import parallel_state

    metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    return set(module.sharded_state_dict(prefix="", metadata=metadata))


@pytest.mark.cuda_hidden
@needs_offsets
@pytest.mark.parametrize("softmax_type", OFFSET_TYPES)
def test_construction_touches_no_cuda(tmp_path, forbid_cuda, softmax_type):
    import torch

    init_gloo(tmp_path)
    module = attention(config(softmax_type))
    assert module.softmax_offset.device == torch.device("cpu")
    assert module.softmax_offset.shape == (HEADS,)
    assert not torch.cuda.is_initialized()


@pytest.mark.cuda_hidden
@needs_fix
def test_off_by_one_is_a_non_persistent_cpu_buffer(tmp_path, forbid_cuda):
    import torch

    init_gloo(tmp_path)
    module = attention(config("off-by-one"))
    offset = module.softmax_offset
    assert offset.device == torch.device("cpu")
    assert offset.dtype == torch.bfloat16 and offset.shape == (HEADS,)
    assert torch.equal(offset, torch.zeros(HEADS, dtype=torch.bfloat16))
    assert not isinstance(offset, torch.nn.Parameter)
    assert dict(module.named_buffers()) == {"softmax_offset": offset}
    assert "softmax_offset" in module._non_persistent_buffers_set
    assert list(module.parameters()) == []
    assert "softmax_offset" not in module.state_dict()


@pytest.mark.cuda_hidden
@needs_fix
def test_off_by_one_follows_the_module(tmp_path, forbid_cuda):
    import torch

    init_gloo(tmp_path)
    module = attention(config("off-by-one"))
    module.to("meta")
    assert module.softmax_offset.device == torch.device("meta")
    assert module.softmax_offset.shape == (HEADS,)


@pytest.mark.cuda_hidden
@needs_fix
def test_learnable_is_a_cpu_parameter_initialised_as_before(tmp_path, forbid_cuda):
    import torch

    init_gloo(tmp_path)
    cfg = config("learnable")
    torch.manual_seed(7)
    module = attention(cfg)
    after_module = torch.get_rng_state()

    offset = module.softmax_offset
    assert isinstance(offset, torch.nn.Parameter) and offset.requires_grad
    assert offset.device == torch.device("cpu")
    assert offset.dtype == torch.bfloat16 and offset.shape == (HEADS,)
    assert dict(module.named_parameters()) == {"softmax_offset": offset}
    assert list(module.buffers()) == []
    assert module.state_dict()["softmax_offset"] is not None

    # The constructor's only random draw is one config.init_method call on the offset.
    torch.manual_seed(7)
    expected = cfg.init_method(torch.nn.Parameter(torch.empty(HEADS, dtype=torch.bfloat16)))
    assert torch.equal(offset, expected)
    assert torch.equal(after_module, torch.get_rng_state())


@pytest.mark.cuda_hidden
@needs_fix
def test_learnable_without_perform_initialization_is_not_initialised(tmp_path, forbid_cuda):
    import torch

    init_gloo(tmp_path)
    calls = []
    cfg = config("learnable", perform_initialization=False, init_method=calls.append)
    module = attention(cfg)
    assert calls == []
    assert isinstance(module.softmax_offset, torch.nn.Parameter)
    assert module.softmax_offset.device == torch.device("cpu")


@pytest.mark.cuda_hidden
@needs_fix
@pytest.mark.parametrize("softmax_type", ["vanilla"] + OFFSET_TYPES)
def test_state_dict_keys_unchanged(tmp_path, softmax_type):
    import torch

    init_gloo(tmp_path)
    cfg = config(softmax_type)
    module = attention(cfg)
    assert set(module.state_dict()) == UNPATCHED_KEYS[softmax_type]
    assert sharded_keys(module) == UNPATCHED_KEYS[softmax_type]

    if unpatched_init() is None:
        if upstream_fixed(TARGET):
            pytest.skip(needs_unfixed(TARGET).kwargs["reason"])
        pytest.skip(f"mode {MODE}: the shim did not replace the constructor, no original to run")
    original = unpatched_on_meta(cfg)
    assert set(original.state_dict()) == UNPATCHED_KEYS[softmax_type]
    assert sharded_keys(original) == UNPATCHED_KEYS[softmax_type]
    assert not torch.cuda.is_initialized()


def public_state(module):
    """A module's own attributes, comparable across instances (process groups by identity)."""
    state = {}
    for name, value in vars(module).items():
        if name.startswith("_") or name == "softmax_offset":
            continue
        if name == "pg_collection":
            value = value.tp
        state[name] = value
    return state


@pytest.mark.cuda_hidden
@needs_fix
@needs_unfixed(TARGET)
@pytest.mark.parametrize("softmax_type", ["vanilla"] + OFFSET_TYPES)
def test_everything_but_the_offset_is_built_as_before(tmp_path, softmax_type):
    import torch

    if unpatched_init() is None:
        pytest.skip(f"mode {MODE}: the shim did not replace the constructor, no original to run")
    init_gloo(tmp_path)
    cfg = config(softmax_type, apply_query_key_layer_scaling=True, fp16=True, attention_dropout=0.25)
    patched, original = attention(cfg), unpatched_on_meta(cfg)

    assert patched.config is cfg and cfg.softmax_type == softmax_type
    assert public_state(patched) == public_state(original)
    assert [n for n, _ in patched.named_children()] == [n for n, _ in original.named_children()]
    for (_, mine), (_, theirs) in zip(patched.named_children(), original.named_children()):
        assert type(mine) is type(theirs) and public_state(mine) == public_state(theirs)
    if softmax_type == "vanilla":
        assert patched.softmax_offset is None and original.softmax_offset is None
    else:
        assert patched.softmax_offset.shape == original.softmax_offset.shape
        assert patched.softmax_offset.dtype == original.softmax_offset.dtype
        assert type(patched.softmax_offset) is type(original.softmax_offset)
    assert not torch.cuda.is_initialized()


@pytest.mark.cuda_hidden
@needs_fix
def test_unknown_softmax_type_still_raises(tmp_path):
    init_gloo(tmp_path)
    cfg = config("vanilla")
    cfg.softmax_type = "sigmoid"
    with pytest.raises(ValueError, match="Softmax type not supported"):
        attention(cfg)


@pytest.mark.cuda_hidden
@needs_offsets
@pytest.mark.parametrize("softmax_type", OFFSET_TYPES)
def test_gpt_round_trip_without_cuda(tmp_path, forbid_cuda, softmax_type):
    import torch

    init_gloo(tmp_path)
    model = tiny_gpt(seed=1, softmax_type=softmax_type)
    fresh = tiny_gpt(seed=2, softmax_type=softmax_type)
    offsets = [k for k in tensors(model) if k.endswith("softmax_offset")]
    if softmax_type == "off-by-one":
        assert offsets == []
    else:
        assert len(offsets) == 2  # one per layer
        if MCORE_VERSION < (0, 16):
            # 0.15 leaves the learnable offset uninitialised (torch.empty): give it values, so
            # that a NaN bit pattern cannot make torch.equal fail.
            for seed, gpt in ((1, model), (2, fresh)):
                generator = torch.Generator().manual_seed(seed)
                for name, param in gpt.named_parameters():
                    if name.endswith("softmax_offset"):
                        param.data.copy_(torch.randn(param.shape, generator=generator))
    expected = tensors(model)
    for key in offsets:
        assert not torch.equal(expected[key], tensors(fresh)[key])

    save_and_reload(model, fresh, tmp_path / "ckpt")

    assert_same_tensors(expected, tensors(fresh))
    assert not torch.cuda.is_initialized()


@pytest.mark.cuda_hidden
@needs_fix
@needs_unfixed(TARGET)
def test_construction_fails_without_the_fix(tmp_path):
    """The tests above are real checks: unfixed megatron-core cannot build the offsets here."""
    stderr = run_without_fix(
        FIX,
        f"""
        import mcore_cpu_shim
        from helpers import init_gloo, tiny_gpt
        init_gloo({str(tmp_path)!r})
        tiny_gpt(seed=1, softmax_type="learnable")
        """,
    )
    assert "NVIDIA driver" in stderr or "not compiled with CUDA" in stderr, stderr
    assert "current_device" in stderr, stderr


@pytest.mark.cuda_visible
@needs_fix
@pytest.mark.parametrize("softmax_type", OFFSET_TYPES)
def test_cpu_initialised_module_moves_to_cuda(tmp_path, softmax_type):
    import torch

    init_gloo(tmp_path)
    module = attention(config(softmax_type))
    cpu_values = module.softmax_offset.detach().clone()
    module.cuda()
    assert module.softmax_offset.device.type == "cuda"
    assert torch.equal(module.softmax_offset.cpu(), cpu_values)
    assert set(module.state_dict()) == UNPATCHED_KEYS[softmax_type]


@pytest.mark.cuda_visible
@needs_fix
@pytest.mark.parametrize("softmax_type", OFFSET_TYPES)
def test_gpu_initialisation_as_before(tmp_path, softmax_type):
    import torch

    torch.cuda.set_device(0)
    init_gloo(tmp_path)
    cfg = config(softmax_type, use_cpu_initialization=False)
    torch.manual_seed(3)
    module = attention(cfg)
    rng_after = torch.cuda.get_rng_state()

    offset = module.softmax_offset
    assert offset.device == torch.device("cuda", torch.cuda.current_device())
    assert offset.dtype == torch.bfloat16 and offset.shape == (HEADS,)
    assert isinstance(offset, torch.nn.Parameter) == (softmax_type == "learnable")
    assert set(module.state_dict()) == UNPATCHED_KEYS[softmax_type]

    original_init = unpatched_init()
    if original_init is None:
        return  # patched modes: there is no unpatched constructor in this process to compare with
    torch.manual_seed(3)
    original = attention(cfg, init=original_init)
    assert original.softmax_offset.device == offset.device
    assert original.softmax_offset.dtype == offset.dtype
    assert torch.equal(original.softmax_offset, offset)
    assert torch.equal(torch.cuda.get_rng_state(), rng_after)
