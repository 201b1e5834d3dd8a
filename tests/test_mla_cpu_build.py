"""mla_cpu_build, its rotary part: multi-latent attention (DeepSeek-V2/V3-style) builds its
YaRN or plain rotary embedding as the config's use_cpu_initialization says, so an MLA model
builds, and runs, on a host without CUDA; the embedding equals one built directly on the CPU.

Most checks build MLASelfAttention with the local spec's projections and a stand-in core
attention that takes any arguments, so they hold whatever the core attention is; one builds
and runs a whole GPTModel with the local spec (which also needs the fix's core attention part).
"""

import dataclasses
import importlib

import pytest
from helpers import (
    MODE,
    NO_CUDA,
    cpu_logits,
    inference_rng_tracker,
    init_gloo,
    needs_unfixed,
    run_without_fix,
)

FIX = "mla_cpu_build"
MODULE = "megatron.core.transformer.multi_latent_attention"
TARGET = f"{MODULE}:MultiLatentAttention.__init__"
EMBEDDINGS = "megatron.core.models.common.embeddings"
SHIM_ONLY = pytest.mark.skipif(MODE != "shim", reason=f"mode {MODE}: needs the unpatched code")
ROPE_TYPES = ["yarn", "rope"]

# Tiny, with rotary settings away from the defaults, so an argument MLA failed to pass on
# would show as a difference from the directly built embedding.
ROPE_DIM = 8  # qk_pos_emb_head_dim: the rotary part of each query/key head
ORIGINAL_LENGTH = 32  # YaRN's original_max_position_embeddings: its cos/sin cache length
MLA = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_head_dim=8,
    qk_pos_emb_head_dim=ROPE_DIM,
    v_head_dim=8,
    rotary_base=5000.0,
    rotary_percent=1.0,
    rotary_scaling_factor=4.0,
    beta_fast=16.0,
    beta_slow=2.0,
    mscale=1.0,
    mscale_all_dim=0.707,
)


def mla_module():
    return importlib.import_module(MODULE)


def mla_config(rope_type, use_cpu_initialization=True, **settings):
    import torch
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    # YaRN's original length: max_position_embeddings on 0.13, original_... from 0.14 on.
    fields = {field.name for field in dataclasses.fields(MLATransformerConfig)}
    length = next(
        name for name in ("original_max_position_embeddings", "max_position_embeddings") if name in fields
    )
    values = dict(MLA, **{length: ORIGINAL_LENGTH})
    values.update(settings)
    return MLATransformerConfig(
        rope_type=rope_type,
        use_cpu_initialization=use_cpu_initialization,
        params_dtype=torch.float32,
        **values,
    )


def core_attention_stub():
    """A core attention that takes whatever MLA gives it (k_channels, v_channels, ...)."""
    import torch

    class CoreAttentionStub(torch.nn.Module):
        def __init__(self, **kwargs):
            super().__init__()
            self.kwargs = kwargs

    return CoreAttentionStub


def local_mla_spec(stub_core_attention=False):
    """The local GPT layer spec with MLA; with ``stub_core_attention``, its core attention
    replaced by the stand-in."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(multi_latent_attention=True, normalization="RMSNorm")
    if not stub_core_attention:
        return spec
    attention = spec.submodules.self_attention
    submodules = dataclasses.replace(attention.submodules, core_attention=core_attention_stub())
    attention = dataclasses.replace(attention, submodules=submodules)
    layer = dataclasses.replace(spec.submodules, self_attention=attention)
    return dataclasses.replace(spec, submodules=layer)


def mla_attention(rope_type, use_cpu_initialization=True, **settings):
    """MLASelfAttention (layer 1, causal) of the local spec with the stand-in core attention."""
    from megatron.core.transformer.enums import AttnMaskType

    spec = local_mla_spec(stub_core_attention=True).submodules.self_attention
    return spec.module(
        config=mla_config(rope_type, use_cpu_initialization, **settings),
        submodules=spec.submodules,
        layer_number=1,
        attn_mask_type=AttnMaskType.causal,
    )


def mla_gpt(rope_type, seed=1):
    """A 2-layer MLA GPTModel of the local spec, built on the CPU."""
    import torch
    from megatron.core.models.gpt.gpt_model import GPTModel

    torch.manual_seed(seed)
    return GPTModel(
        config=mla_config(rope_type),
        transformer_layer_spec=local_mla_spec(),
        vocab_size=64,
        max_sequence_length=16,
        position_embedding_type="rope",
    )


def direct_embedding(config):
    """The rotary embedding MLA should make for ``config``, built here directly on the CPU with
    the arguments upstream's MLA passes."""
    if config.rope_type == "rope":
        module = importlib.import_module(f"{EMBEDDINGS}.rotary_pos_embedding")
        return module.RotaryEmbedding(
            config.qk_pos_emb_head_dim,
            rotary_percent=config.rotary_percent,
            rotary_base=config.rotary_base,
            use_cpu_initialization=True,
        )
    module = importlib.import_module(f"{EMBEDDINGS}.yarn_rotary_pos_embedding")
    return module.YarnRotaryEmbedding(
        config.qk_pos_emb_head_dim,
        rotary_base=config.rotary_base,
        scaling_factor=config.rotary_scaling_factor,
        original_max_position_embeddings=ORIGINAL_LENGTH,
        beta_fast=config.beta_fast,
        beta_slow=config.beta_slow,
        mscale=config.mscale,
        mscale_all_dim=config.mscale_all_dim,
        use_cpu_initialization=True,
    )


def embedding_class(rope_type):
    if rope_type == "rope":
        return importlib.import_module(f"{EMBEDDINGS}.rotary_pos_embedding").RotaryEmbedding
    return importlib.import_module(f"{EMBEDDINGS}.yarn_rotary_pos_embedding").YarnRotaryEmbedding


def frequency_tensors(rope):
    """The embedding's tensors: frequencies (buffers or plain attributes) and YaRN's cache."""
    import torch

    found = {name: value for name, value in vars(rope).items() if isinstance(value, torch.Tensor)}
    found.update(rope.named_buffers())
    return found


def assert_same(expected, actual, what):
    import torch

    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    assert actual.device == expected.device, what
    assert torch.equal(actual, expected), what


@pytest.mark.cuda_hidden
@pytest.mark.parametrize("rope_type", ROPE_TYPES)
def test_mla_attention_builds_on_cpu(tmp_path, forbid_cuda, rope_type):
    import torch

    init_gloo(str(tmp_path))
    attention = mla_attention(rope_type)
    rope = attention.rotary_pos_emb
    assert type(rope) is embedding_class(rope_type)
    tensors = frequency_tensors(rope)
    assert ("inv_freq" if rope_type == "rope" else "cos_cached") in tensors, tensors.keys()
    for name, tensor in tensors.items():
        assert tensor.device == torch.device("cpu"), name
    for name, tensor in [*attention.named_parameters(), *attention.named_buffers()]:
        assert tensor.device == torch.device("cpu"), name
    # MLA's head sizes reach its core attention (query/key: nope + rope part; value).
    stub = attention.core_attention.kwargs
    assert (stub["k_channels"], stub["v_channels"]) == (MLA["qk_head_dim"] + ROPE_DIM, MLA["v_head_dim"])
    assert forbid_cuda == []
    assert not torch.cuda.is_initialized()


@pytest.mark.cuda_hidden
@pytest.mark.parametrize("rope_type", ROPE_TYPES)
def test_embedding_equals_one_built_directly_on_cpu(tmp_path, forbid_cuda, rope_type):
    import torch

    init_gloo(str(tmp_path))
    attention = mla_attention(rope_type)
    rope, direct = attention.rotary_pos_emb, direct_embedding(attention.config)
    tensors, expected = frequency_tensors(rope), frequency_tensors(direct)
    assert tensors.keys() == expected.keys()
    for name in expected:
        assert_same(expected[name], tensors[name], name)

    if rope_type == "rope":
        assert_same(direct(24, 3), rope(24, 3), "embedding")
    else:
        (emb, mscale), (want_emb, want_mscale) = rope(24, 3), direct(24, 3)
        assert_same(want_emb, emb, "embedding")
        assert mscale == want_mscale and mscale != 1.0
        beyond = 2 * ORIGINAL_LENGTH  # a rebuild of the cache, past the constructor's length
        for got, want in zip(rope.get_cached_cos_sin(beyond), direct.get_cached_cos_sin(beyond)):
            assert_same(want, got, "cos/sin beyond the original length")
            assert got.device == torch.device("cpu")
    assert forbid_cuda == []


@pytest.mark.cuda_hidden
@pytest.mark.parametrize("rope_type", ROPE_TYPES)
@pytest.mark.parametrize("flag", [True, False], ids=["cpu-init", "gpu-init"])
def test_the_embedding_is_given_the_config_flag(tmp_path, monkeypatch, rope_type, flag):
    """MLA hands its config's use_cpu_initialization on, whichever way it is set: with the flag
    off the embedding is made on the current CUDA device, as upstream makes it (here "the
    current CUDA device" is sent to the CPU, as for the whole GPU-initialised module)."""
    import torch

    init_gloo(str(tmp_path))
    real = embedding_class(rope_type)
    flags = []

    def spy(*args, **kwargs):
        flags.append(kwargs.get("use_cpu_initialization", "not given"))
        return real(*args, **kwargs)

    monkeypatch.setattr(mla_module(), real.__name__, spy)
    if not flag:
        monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    attention = mla_attention(rope_type, use_cpu_initialization=flag, perform_initialization=flag)
    assert type(attention.rotary_pos_emb) is real
    assert flags == [flag]


@pytest.mark.cuda_hidden
@pytest.mark.parametrize("rope_type", ROPE_TYPES)
def test_mla_gpt_model_builds_and_runs_on_cpu(tmp_path, forbid_cuda, rope_type):
    """DeepSeek-V3-style: a GPTModel of MLA layers with the local spec (no TE), built on the CPU,
    rotary embedding and all, and run there."""
    import torch

    init_gloo(str(tmp_path))
    inference_rng_tracker()
    model = mla_gpt(rope_type)
    assert getattr(model, "rotary_pos_emb", None) is None  # MLA layers make their own
    direct = frequency_tensors(direct_embedding(model.config))
    for layer in model.decoder.layers:
        rope = layer.self_attention.rotary_pos_emb
        assert type(rope) is embedding_class(rope_type)
        for name, tensor in direct.items():
            assert_same(tensor, frequency_tensors(rope)[name], name)

    logits = cpu_logits(model)
    assert logits.shape == (2, 8, 64) and logits.device == torch.device("cpu")
    assert torch.isfinite(logits).all()
    assert torch.equal(logits, cpu_logits(mla_gpt(rope_type)))
    assert forbid_cuda == []
    assert not torch.cuda.is_initialized()


@SHIM_ONLY
@needs_unfixed(TARGET)
@pytest.mark.cuda_hidden
@pytest.mark.parametrize("rope_type", ROPE_TYPES)
def test_without_the_fix_mla_needs_cuda(tmp_path, rope_type):
    """The tests above are real checks: unfixed megatron-core makes MLA's rotary embedding on
    the current CUDA device, even with use_cpu_initialization."""
    stderr = run_without_fix(
        FIX,
        f"""
        from helpers import init_gloo
        from test_mla_cpu_build import mla_attention
        init_gloo({str(tmp_path)!r})
        mla_attention({rope_type!r})
        """,
    )
    embedding_file = "yarn_rotary_pos_embedding.py" if rope_type == "yarn" else "rotary_pos_embedding.py"
    assert "current_device" in stderr and embedding_file in stderr, stderr[-3000:]
    assert any(marker in stderr for marker in NO_CUDA), stderr[-3000:]


@pytest.mark.cuda_visible
@pytest.mark.parametrize("rope_type", ROPE_TYPES)
def test_with_cuda_the_embedding_is_made_where_the_config_says(tmp_path, rope_type):
    """On a GPU host: with use_cpu_initialization off the embedding is on the current CUDA
    device, as upstream makes it; with it on, on the CPU, equal to a directly built one."""
    import torch

    torch.cuda.set_device(0)
    gpu = torch.device("cuda", torch.cuda.current_device())
    init_gloo(str(tmp_path))
    on_gpu = mla_attention(rope_type, use_cpu_initialization=False, perform_initialization=False)
    for name, tensor in frequency_tensors(on_gpu.rotary_pos_emb).items():
        assert tensor.device == gpu, name

    on_cpu = mla_attention(rope_type, use_cpu_initialization=True)
    direct = direct_embedding(on_cpu.config)
    for name, tensor in frequency_tensors(direct).items():
        assert_same(tensor, frequency_tensors(on_cpu.rotary_pos_emb)[name], name)
        assert tensor.device == torch.device("cpu"), name
